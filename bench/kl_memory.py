"""Peak memory of one checkpoint's retained KL, current vs previous, same contexts and process:
    current   RetainedKL.kl (kl_many): the LM head on real positions only, in chunks of 128
    previous  every batch's whole (B, T, V) logits of the candidate and the reference, padding
              included (bench/eval_candidate.previous_kl, the implementation before kl_many)
on the main job's GSM8K gate contexts at its KL batch of 8, with a random rank-16 residual at
layer 15 (what is measured does not depend on the adapter).

    .venv/bin/python bench/kl_memory.py [--contexts 128 --batch 8 --dtype auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.backbone import load_backbone
from atlas_core.residual import ResidualConfig, build_residual
from bench.common import machine, peak_rss_added, reading
from bench.eval_candidate import previous_kl
from evaluation.domains import domain_contexts
from evaluation.kl import RetainedKL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    bb = load_backbone("smollm2-135m", args.dtype)
    residual = build_residual(ResidualConfig(variant="plain", layer=args.layer, rank=16), bb.model)
    torch.nn.init.normal_(residual.B, std=0.01, generator=torch.Generator().manual_seed(0))
    _, texts = domain_contexts(bb.tokenizer, "gsm8k", "gate", args.contexts)
    kl = RetainedKL(bb.model, bb.tokenizer, texts, args.layer, batch_size=args.batch, max_length=1024, progress=False)
    reference = kl.reference()  # prefix and reference caches, held by both implementations alike

    measured = {}
    for name, run in (
        ("current", lambda: kl.kl(reference, residual).mean),
        ("previous", lambda: previous_kl(kl, reference, residual)),
    ):
        start = time.perf_counter()
        value, mib = peak_rss_added(run)
        measured[name] = (value, mib, time.perf_counter() - start)
    rows, width = kl.batches[0][0].shape  # the longest batch comes first
    logits_mib = rows * width * bb.model.config.vocab_size * 4 / 2**20
    print(f"machine: {machine()}")
    print(
        f"{bb.name} ({bb.dtype}), {args.contexts} GSM8K gate contexts ({kl.positions} positions), batch {args.batch}, "
        f"longest batch {rows} x {width} tokens: its (B, T, V) fp32 logits are {logits_mib:.0f} MiB"
    )
    for name, (value, mib, seconds) in measured.items():
        print(f"  {name:8s} peak memory added {mib:7.0f} MiB   ({seconds:.0f} s)   KL {value:.10g}")
    (_, cur, _), (_, prev, _) = measured["current"], measured["previous"]
    print(
        f"  ratio previous / current: {prev / max(cur, 1):.1f}x; KL relative difference "
        f"{abs(measured['current'][0] - measured['previous'][0]) / measured['previous'][0]:.1e}"
    )
    reading(
        f"peak memory of one checkpoint's retained KL ({args.contexts} GSM8K contexts, batch {args.batch})",
        f"{cur:,.0f} MiB added, previous {prev:,.0f} MiB ({prev / max(cur, 1):.1f}x less)",
        "no (B, T, V) logits held",
        "yes" if cur < logits_mib else "**no**",
    )


if __name__ == "__main__":
    main()
