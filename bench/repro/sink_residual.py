"""What a trained residual adds at the attention sink: ||Delta(h)|| at position 0 against the rest.

Position 0 of every KL context is the chat template's first token; its layer-l state is the same
in every context and ~150x the median norm (docs/RESULTS.md). An atlas that holds it has a chart
center on it, so a centered residual's offset e = h - mu(h), and with it Delta(h), is ~0 there; an
atlas without it (`atlas.positions: after-first`) leaves an offset of the state's own size. This
prints, for each adapter file (a checkpoint in the runner's state dir) on the first `--contexts`
GSM8K test contexts: the distance from h to its nearest chart center and ||Delta(h)||, at position 0,
over the other prompt positions and over the answer positions (median and max). Delta is the
residual's own output, whether or not an update gate masked it in training (answer-only runs).

    .venv/bin/python -m bench.repro.sink_residual --config configs/repro/smollm2.yaml \\
        --adapters <state>/repro/<experiment>/runs/atlas/seed0/lr-0.005/checkpoints/step-000045/adapter.safetensors ...
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline, like the runner
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import torch

from .config import load_repro_config


def find_atlas(folder: Path, sha256: str):
    """The atlas in `folder` whose file has `sha256` (the one the adapter was trained with): found by the
    manifests, so only that atlas is read (and verified)."""
    from atlas_core.atlas import Atlas
    from atlas_core.io import manifest_path

    for path in sorted(folder.glob("*.safetensors")):
        if json.loads(manifest_path(path).read_text()).get("sha256") == sha256:
            return Atlas.load(path)
    raise SystemExit(f"--atlases: no atlas with sha256 {sha256} in {folder}")


def by_kind(values: torch.Tensor, n_prompt: int) -> dict[str, torch.Tensor]:
    """A context's per-position values (T,) as position 0, the other prompt positions, the answer positions."""
    return {"sink": values[:1], "prompt": values[1:n_prompt], "answer": values[n_prompt:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="experiment file: backbone, dtype, layer")
    parser.add_argument("--adapters", nargs="+", type=Path, required=True, help="adapter.safetensors files")
    parser.add_argument("--atlases", type=Path, default=None, help="folder of atlases (default: the state dir's)")
    parser.add_argument("--contexts", type=int, default=16, help="GSM8K test contexts")
    args = parser.parse_args()
    config = load_repro_config(args.config)

    from atlas_core.backbone import hidden_at_layer, load_backbone
    from atlas_core.io import manifest_path
    from atlas_core.paths import state_dir
    from atlas_core.residual import load_adapter
    from evaluation.contexts import retained_prompts

    backbone = load_backbone(config.backbone, config.dtype)
    tok = backbone.tokenizer
    _, prompts, contexts = retained_prompts(tok, "gsm8k", "test", limit=args.contexts)
    hidden = []
    with torch.no_grad():
        for prompt, text in zip(prompts, contexts):
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
            hidden.append((hidden_at_layer(backbone.model, config.layer, ids)[0].float(), n_prompt))  # (T, d)
    atlases = args.atlases or state_dir() / "repro" / "atlases"
    print(f"layer {config.layer} of {backbone.name}, {len(hidden)} GSM8K test contexts; median / max per kind")
    for path in args.adapters:
        atlas = find_atlas(atlases, json.loads(manifest_path(path).read_text())["atlas_sha256"])  # verified on load
        residual = load_adapter(path, atlas).eval()
        rows: dict[str, dict[str, list[torch.Tensor]]] = {"||h - nearest center||": {}, "||Delta(h)||": {}}
        with torch.no_grad():
            for h, n_prompt in hidden:
                values = {
                    "||h - nearest center||": torch.cdist(h, atlas.centers.float()).min(1).values,  # (T,)
                    "||Delta(h)||": residual(h).norm(dim=1),  # (T,)
                }
                for name, v in values.items():
                    for kind, part in by_kind(v, n_prompt).items():
                        rows[name].setdefault(kind, []).append(part)
        print(f"{path} (atlas {atlas.sha256[:12]}, {atlas.num_charts} charts)")
        for name, kinds in rows.items():
            cells = []
            for kind, parts in kinds.items():
                v = torch.cat(parts)
                cells.append(f"{kind} {float(v.median()):10.3f} / {float(v.max()):10.3f}")
            print(f"  {name:24s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
