"""Atlas fit (k-means++ + Lloyd with GEMM distances, Gram-matrix local PCA) versus a
straightforward scikit-learn KMeans + per-chart PCA, same clustered synthetic data.

    .venv/bin/python bench/atlas_fit.py [--n 4096 --d 4096 --k 32 --m 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.atlas import AtlasConfig, fit_atlas
from bench.common import machine, reading


def clustered(n: int, d: int, k: int, seed: int = 0) -> torch.Tensor:
    """k Gaussian clusters, each spread mostly along its own 32 random directions."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g) * 3
    labels = torch.randint(k, (n,), generator=g)
    directions = torch.randn(k, 32, d, generator=g) / d**0.5
    coeff = torch.randn(n, 32, generator=g) * torch.linspace(8, 1, 32)
    return (
        centers[labels] + torch.einsum("nj,njd->nd", coeff, directions[labels]) + 0.3 * torch.randn(n, d, generator=g)
    )


def sklearn_fit(x: np.ndarray, k: int, m: int, seed: int) -> float:
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA

    km = KMeans(n_clusters=k, init="k-means++", n_init=1, random_state=seed).fit(x)
    for c in range(k):
        members = x[km.labels_ == c]
        PCA(n_components=min(m, len(members))).fit(members)
    return float(km.inertia_)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    x = clustered(args.n, args.d, args.k)
    config = AtlasConfig(num_charts=args.k, rank=args.m, num_vectors=args.n)

    ours, theirs = [], []
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        start = time.perf_counter()
        atlas = fit_atlas(x, config)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        base_inertia = sklearn_fit(x.numpy(), args.k, args.m, seed=0)
        theirs.append(time.perf_counter() - start)
    t_ours, t_base = min(ours), min(theirs)
    inertia = atlas.meta["inertia"]
    print(f"machine: {machine()}")
    print(f"atlas fit N={args.n} d={args.d} K={args.k} m={args.m} (best of {args.repeat})")
    print(f"  ours (torch GEMM k-means + Gram PCA): {t_ours:7.2f} s   inertia {inertia:.4e}")
    print(f"  scikit-learn KMeans + per-chart PCA: {t_base:7.2f} s   inertia {base_inertia:.4e}")
    print(
        f"  speed-up {t_base / t_ours:.1f}x   inertia ours/sklearn {inertia / base_inertia:.4f} "
        f"({(inertia / base_inertia - 1) * 100:+.2f}%)"
    )
    speed, off = t_base / t_ours, abs(inertia / base_inertia - 1)
    reading(
        f"atlas fit N={args.n}, d={args.d}, K={args.k}, m={args.m}",
        f"{t_ours:.2f} s vs {t_base:.2f} s for scikit-learn: {speed:.1f}x, inertia within {off:.2%}",
        "< 3 s, >= 8x, inertia within 3%",
        "yes" if t_ours < 3 and speed >= 8 and off <= 0.03 else "**no**",
    )


if __name__ == "__main__":
    main()
