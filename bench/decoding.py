"""Generation throughput (new tokens/s) of the default backbone, base versus with a full ATLAS
residual attached, at batch 1 and batch 8 (greedy, fixed number of new tokens).

    .venv/bin/python bench/decoding.py [--new-tokens 64 --dtype auto --repeat 3]
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
from atlas_core.atlas import AtlasConfig, fit_atlas  # noqa: E402
from atlas_core.backbone import load_backbone  # noqa: E402
from atlas_core.extract import sample_activations  # noqa: E402
from atlas_core.residual import ResidualConfig, attach, build_residual  # noqa: E402
from bench.common import machine  # noqa: E402
from evaluation.contexts import retained_contexts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    bb = load_backbone("smollm2-135m", args.dtype)
    _, texts = retained_contexts(bb.tokenizer, "gsm8k", limit=256)
    x = sample_activations(bb.model, bb.tokenizer, texts, args.layer, 1024, per_example=4, progress=False)
    atlas = fit_atlas(x, AtlasConfig(num_charts=32, rank=16, num_vectors=len(x)), {"layer": args.layer})
    residual = build_residual(ResidualConfig(variant="atlas", layer=args.layer), bb.model, atlas)
    torch.nn.init.normal_(residual.B, std=0.01)
    bb.tokenizer.padding_side = "left"
    prompts = [t[: t.index("<|im_start|>assistant")] + "<|im_start|>assistant\n" for t in texts]

    def run(batch: int) -> float:
        enc = bb.tokenizer(prompts[:batch], return_tensors="pt", padding=True)
        start = time.perf_counter()
        bb.model.generate(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                          pad_token_id=bb.tokenizer.pad_token_id)
        return batch * args.new_tokens / (time.perf_counter() - start)

    print(f"machine: {machine()}")
    print(f"{bb.name} ({bb.dtype}), full ATLAS residual at layer {args.layer} (K=32, m=16, r=16), "
          f"{args.new_tokens} new tokens, best of {args.repeat} (base and adapted interleaved)")
    print(f"{'batch':>6} {'base tok/s':>11} {'adapted tok/s':>14} {'overhead':>9}")
    with torch.no_grad():
        for batch in (1, 8):
            base, adapted = [], []
            for _ in range(args.repeat):
                base.append(run(batch))
                with attach(bb.model, residual):
                    adapted.append(run(batch))
            b, a = max(base), max(adapted)
            print(f"{batch:6d} {b:11.1f} {a:14.1f} {b / a - 1:9.1%}")


if __name__ == "__main__":
    main()
