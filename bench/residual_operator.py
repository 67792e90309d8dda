"""Cost of the full ATLAS residual operator per token versus one d x 4d matmul (an MLP
up-projection) on the same tokens, in fp32 and bf16.

    .venv/bin/python bench/residual_operator.py [--d 4096 --k 32 --n 4 --m 16 --r 16 --tokens 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.atlas import Atlas
from atlas_core.residual import AtlasResidual, ResidualConfig
from bench.common import machine, reading, timeit


def random_atlas(d: int, k: int, m: int) -> Atlas:
    g = torch.Generator().manual_seed(0)
    bases = torch.linalg.qr(torch.randn(k, d, m, generator=g))[0]
    return Atlas(
        centers=torch.randn(k, d, generator=g),
        bases=bases,
        sigma=torch.ones(k, m),
        tau=2.0 * d,
        calibration=torch.randn(64, d, generator=g),
        meta={"config": {"variant": "local"}},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("d", 4096), ("k", 32), ("n", 4), ("m", 16), ("r", 16), ("tokens", 8192), ("repeat", 7)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    atlas = random_atlas(args.d, args.k, args.m)
    residual = AtlasResidual(ResidualConfig(variant="atlas", layer=0, rank=args.r, top_n=args.n), args.d, atlas)
    torch.nn.init.normal_(residual.B, std=0.02)
    h = atlas.centers[torch.arange(args.tokens) % args.k] + torch.randn(args.tokens, args.d)
    up = torch.randn(args.d, 4 * args.d) / args.d**0.5

    print(f"machine: {machine()}")
    print(
        f"full ATLAS residual, d={args.d} K={args.k} n={args.n} m={args.m} r={args.r}, {args.tokens} tokens, "
        f"median of {args.repeat}"
    )
    print(f"{'dtype':>9} {'residual us/tok':>16} {'d x 4d matmul us/tok':>21} {'ratio':>7}")
    ratios, limits = {}, {torch.float32: 0.25, torch.bfloat16: 0.50}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x, w = h.to(dtype), up.to(dtype)
            t_res = timeit(lambda: residual(x), repeat=args.repeat)
            t_mm = timeit(lambda: x @ w, repeat=args.repeat)
            us = 1e6 / args.tokens
            print(f"{str(dtype).split('.')[-1]:>9} {t_res * us:16.2f} {t_mm * us:21.2f} {t_res / t_mm:7.1%}")
            ratios[dtype] = (t_res * us, t_res / t_mm)
    reading(
        f"residual operator, {args.tokens:,} tokens, d={args.d}",
        ", ".join(f"{us:.1f} us/token {str(dt)[6:]} ({r:.1%} of a d x 4d matmul)" for dt, (us, r) in ratios.items()),
        "<= 25% fp32, <= 50% bf16",
        "yes" if all(r <= limits[dt] for dt, (_, r) in ratios.items()) else "**no**",
    )


if __name__ == "__main__":
    main()
