"""Retained KL of an adapted checkpoint: cached (frozen prefix + reference final hidden states,
computed once per context set) versus a naive two-full-forward implementation, same contexts.

    .venv/bin/python bench/kl_cache.py [--contexts 32 --layer 15 --dtype auto]
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
from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.backbone import load_backbone
from atlas_core.extract import sample_activations
from atlas_core.residual import ResidualConfig, attach, build_residual
from bench.common import machine, reading
from evaluation.contexts import retained_contexts
from evaluation.kl import RetainedKL, kl_per_position


@torch.no_grad()
def naive_kl(model, residual, batches) -> float:
    """Reference and candidate each run every layer on every context."""
    total, count = 0.0, 0
    for ids, mask in batches:
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with attach(model, residual):
            new = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        total += float((kl_per_position(ref, new) * mask).sum())
        count += int(mask.sum())
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=32)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--checkpoints", type=int, default=2, help="adapted checkpoints scored by each method")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    bb = load_backbone("smollm2-135m", args.dtype)
    _, texts = retained_contexts(bb.tokenizer, "gsm8k", limit=args.contexts)
    x = sample_activations(bb.model, bb.tokenizer, texts, args.layer, 8 * len(texts), per_example=8, progress=False)
    atlas = fit_atlas(x, AtlasConfig(num_charts=8, rank=16, num_vectors=len(x)), {"layer": args.layer})
    residuals = []
    for seed in range(args.checkpoints):
        r = build_residual(ResidualConfig(variant="atlas", layer=args.layer, seed=seed), bb.model, atlas)
        torch.nn.init.normal_(r.B, std=0.01, generator=torch.Generator().manual_seed(seed))
        residuals.append(r)

    start = time.perf_counter()
    kl = RetainedKL(bb.model, bb.tokenizer, texts, args.layer, batch_size=args.batch, progress=False)
    reference = kl.reference()  # builds the prefix cache too
    t_setup = time.perf_counter() - start
    start = time.perf_counter()
    cached = [kl.kl(reference, r).mean for r in residuals]
    t_cached = (time.perf_counter() - start) / len(residuals)
    start = time.perf_counter()
    naive = [naive_kl(bb.model, r, kl.batches) for r in residuals]
    t_naive = (time.perf_counter() - start) / len(residuals)

    print(f"machine: {machine()}")
    print(
        f"{bb.name} ({bb.dtype}), {args.contexts} GSM8K contexts ({kl.positions} positions), layer {args.layer} "
        f"of {bb.num_layers}, batch {args.batch}"
    )
    print(f"  one-time caches (prefix + reference): {t_setup:.1f} s, {2 * kl.cache_bytes() / 2**20:.1f} MiB")
    print(
        f"  per checkpoint: cached {t_cached:.1f} s, naive two full forwards {t_naive:.1f} s -> "
        f"speed-up {t_naive / t_cached:.2f}x"
    )
    print(f"  KL agreement: cached {cached} vs naive {naive}")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(cached, naive))
    reading(
        "retained KL with caches vs two full forwards",
        f"{t_naive / t_cached:.2f}x per checkpoint, KL within {worst:.1e} relative",
        ">= 1.5x",
        "yes" if t_naive / t_cached >= 1.5 else "**no**",
    )


if __name__ == "__main__":
    main()
