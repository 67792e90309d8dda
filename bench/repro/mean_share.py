"""Why an uncentered residual moves retained outputs: how much of the layer-l hidden state is a
mean shared by every position and domain.

A plain residual adds B A h at every position. Write h = mu + e (mu: the mean over positions).
If ||mu||^2 is most of E||h||^2, training on code makes B A mu large, and that one vector is then
added at every position of every domain, math included. A centered residual applies B A (h - mu)
and carries no such shared shift. This prints, for the experiment's own layer and data, per domain
(the MBPP training examples, the GSM8K test contexts of the KL measure): the mean's share of the
energy ||mu||^2 / E||h||^2, and the cosine between the two domain means. A few positions carry
"massive activations" with norms ~100x the median (here the same norm in both domains, so a
position of the shared chat-template prefix) and dominate E||h||^2,
so the share is also printed without positions whose norm exceeds 5x the median.

    .venv/bin/python -m bench.repro.mean_share --config configs/repro/smollm2.yaml
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline, like the runner
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import torch

from .config import load_repro_config


def mean_share(x: torch.Tensor) -> float:
    """||mean||^2 / mean ||x||^2 over the rows of x (N, d): 1 = every row is the same vector."""
    return float(x.mean(0).square().sum() / x.square().sum(1).mean())


def typical(x: torch.Tensor) -> torch.Tensor:
    """The rows of x whose norm is at most 5x the median norm (drops massive-activation positions)."""
    norms = x.norm(dim=1)
    return x[norms <= 5 * norms.median()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--vectors", type=int, default=1024, help="positions sampled per domain (2 per text)")
    args = parser.parse_args()
    config = load_repro_config(args.config)

    from atlas_core.backbone import load_backbone
    from atlas_core.extract import sample_activations
    from atlas_core.train import render_chat
    from evaluation.contexts import retained_contexts
    from evaluation.data import mbpp_pairs

    backbone = load_backbone(config.backbone, config.dtype)
    tok = backbone.tokenizer
    code = [
        "".join(render_chat(tok, p["prompt"], p["response"])) for p in mbpp_pairs("train")
    ]  # as the trainer sees them
    _, math = retained_contexts(tok, "gsm8k", "test", limit=args.vectors // 2)
    per_domain = {}
    for name, texts in (("mbpp train", code), ("gsm8k test", math)):
        n = min(args.vectors, 2 * len(texts))
        per_domain[name] = sample_activations(backbone.model, tok, texts, config.layer, n, progress=False)  # (n, d)
    print(f"layer {config.layer} of {backbone.name} ({backbone.dtype})")
    kept = {name: typical(x) for name, x in per_domain.items()}
    for name, x in per_domain.items():
        norms, t = x.norm(dim=1), kept[name]
        print(
            f"  {name:11s} positions {len(x):5d}  mean's share of E||h||^2 {mean_share(x):.3f}  "
            f"median ||h|| {float(norms.median()):7.1f}  max {float(norms.max()):7.1f}  |  "
            f"without massive positions ({len(x) - len(t)} dropped): share {mean_share(t):.3f}"
        )
    a, b = (t.mean(0) for t in kept.values())
    both = typical(torch.cat(list(per_domain.values())))
    print(
        f"  without massive positions: cosine between the two domain means "
        f"{float(torch.nn.functional.cosine_similarity(a, b, dim=0)):.3f}; "
        f"both domains pooled: share {mean_share(both):.3f}"
    )


if __name__ == "__main__":
    main()
