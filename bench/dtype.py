"""bf16 versus fp32 on this machine: the default backbone's matmul shapes and a full forward.

    .venv/bin/python bench/dtype.py [--batch 8 --repeat 3]

Why it exists: bf16 halves memory everywhere, but it is only faster where the hardware has
native bf16 matmuls (bf16 GPUs, AVX512-BF16 / AMX CPUs). On an AVX2-only CPU PyTorch falls
back to a reference kernel, and `dtype: auto` (atlas_core.backbone.resolve_dtype) picks fp32.
This prints both timings side by side and what `auto` resolved to.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.backbone import load_backbone, resolve_dtype
from bench.common import machine, reading, timeit
from evaluation.contexts import retained_contexts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="GSM8K contexts in the forward batch")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    # SmolLM2-135M's projections at 2,048 tokens: attention q/o, MLP up, LM head.
    shapes = {
        "d x d (576 x 576)": (576, 576),
        "d x 4d-ish (576 x 1536)": (1536, 576),
        "LM head (576 x 49152)": (49152, 576),
    }
    rows = []
    for name, (out_f, in_f) in shapes.items():
        t = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(2048, in_f, dtype=dtype), torch.randn(out_f, in_f, dtype=dtype)
            t[dtype] = timeit(lambda: torch.nn.functional.linear(x, w), repeat=args.repeat)
        rows.append((f"matmul 2,048 tokens, {name}", t[torch.float32], t[torch.bfloat16]))

    t = {}
    for dtype in ("float32", "bfloat16"):
        bb = load_backbone("smollm2-135m", dtype)
        _, texts = retained_contexts(bb.tokenizer, "gsm8k", limit=args.batch)
        batch = bb.tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            t[dtype] = timeit(lambda: bb.model(**batch, use_cache=False), repeat=args.repeat)
        shape = tuple(batch["input_ids"].shape)
    rows.append((f"smollm2-135m full forward, batch {shape}", t["float32"], t["bfloat16"]))

    print(f"machine: {machine()}")
    print(f"dtype auto resolves to: {str(resolve_dtype('auto')).removeprefix('torch.')}; median of {args.repeat}")
    print(f"{'':58s} {'fp32 s':>9s} {'bf16 s':>9s}  bf16 / fp32")
    for name, fp32, bf16 in rows:
        print(f"{name:58s} {fp32:9.4f} {bf16:9.4f}  {bf16 / fp32:6.2f}x")
    forward, auto = rows[-1][2] / rows[-1][1], str(resolve_dtype("auto")).removeprefix("torch.")
    reading(
        "bf16 vs fp32, the default backbone's full forward",
        f"bf16 takes {forward:.2f}x the time of fp32; dtype auto -> {auto}",
        "auto picks the faster",
        "yes" if (forward < 1) == (resolve_dtype("auto") == torch.bfloat16) else "**no**",
    )


if __name__ == "__main__":
    main()
