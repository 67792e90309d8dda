"""Fitting an atlas: k-means charts with a local PCA basis each (spec section 1).

Fast on CPU because every heavy step is one GEMM: Lloyd distances as
||x||^2 - 2 x.c + ||c||^2, and each chart's PCA from the eigendecomposition of its small
members x members Gram matrix instead of an SVD of a members x d matrix.
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError
from .config import AtlasConfig
from .model import Atlas

_SEEDING_SAMPLE = 1024  # k-means++ runs on at most this many vectors (or 32 per chart)


def sq_distances(x: torch.Tensor, centers: torch.Tensor, x_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Squared Euclidean distances (N, K) between rows of x (N, d) and centers (K, d)."""
    x_sq = (x * x).sum(1) if x_sq is None else x_sq
    return (x_sq[:, None] - 2.0 * (x @ centers.T) + (centers * centers).sum(1)[None, :]).clamp_min_(0.0)


def kmeans_plus_plus(
    x: torch.Tensor, k: int, restarts: int, generator: torch.Generator, x_sq: torch.Tensor
) -> torch.Tensor:
    """Greedy k-means++ seeding (as scikit-learn: 2 + log k candidates per step, keep the one
    that lowers the potential most), for `restarts` independent seedings at once.

    Returns seed indices (R, K). All seedings share one GEMM per step, so x is read once a step.
    """
    n = x.shape[0]
    trials = 2 + int(math.log(k))
    # The random draws use the CPU generator and move to x's device: same seeds on every device.
    rows = torch.arange(restarts, device=x.device)
    chosen = torch.randint(n, (restarts, 1), generator=generator).to(x.device)  # (R, 1)
    closest = (x_sq[chosen] - 2.0 * (x[chosen[:, 0]] @ x.T)[:, None] + x_sq).clamp_min_(0.0)[:, 0]  # (R, N)
    for _ in range(1, k):
        candidates = torch.multinomial(closest.cpu() + 1e-12, trials, replacement=True, generator=generator).to(
            x.device
        )  # (R, T)
        dots = (x[candidates.flatten()] @ x.T).view(restarts, trials, n)
        d_cand = (x_sq[candidates][:, :, None] - 2.0 * dots + x_sq).clamp_min_(0.0)  # (R, T, N)
        d_cand = torch.minimum(closest[:, None, :], d_cand)
        best = d_cand.sum(-1).argmin(-1)  # (R,)
        chosen = torch.cat([chosen, candidates[rows, best][:, None]], 1)
        closest = d_cand[rows, best]
    return chosen


def kmeans(
    x: torch.Tensor, k: int, seed: int = 0, max_iter: int = 100, restarts: int = 1
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Lloyd's algorithm from k-means++ seeds; the best of `restarts` runs, all run together.

    Returns (centers (K, d), labels (N,), inertia). Restarts matter on well-separated data:
    a seeding that puts two seeds in one cluster is a local optimum Lloyd cannot leave.
    Each iteration is one GEMM against all restarts' centers (R*K columns).
    """
    n, d = x.shape
    if n < k:
        raise InputError(f"num_vectors: k-means with {k} charts needs at least {k} vectors, got {n}")
    generator = torch.Generator().manual_seed(seed)
    x_sq = (x * x).sum(1)
    # Seed on a subsample: seeding reads the data once per chart, Lloyd then refines on all of it.
    sub = torch.randperm(n, generator=generator)[: max(_SEEDING_SAMPLE, 32 * k)].to(x.device)
    centers = x[sub[kmeans_plus_plus(x[sub], k, restarts, generator, x_sq[sub]).flatten()]]  # (R*K, d)
    offset = (torch.arange(restarts, device=x.device) * k)[None, :]  # run r owns rows r*K .. r*K+K-1
    labels = torch.full((n, restarts), -1, dtype=torch.long, device=x.device)
    for _ in range(max_iter):
        dist = sq_distances(x, centers, x_sq).view(n, restarts, k)
        new_labels = dist.argmin(-1)  # (N, R)
        if torch.equal(new_labels, labels):
            break
        labels = new_labels
        members = torch.zeros(n, restarts * k, dtype=x.dtype, device=x.device)  # (N, R*K) one-hot
        members.scatter_(1, labels + offset, 1.0)
        counts = members.sum(0)
        centers = (members.T @ x) / counts.clamp_min(1)[:, None]  # member means, one GEMM for all runs
        empty = (counts == 0).nonzero().flatten()
        if len(empty):  # rare: re-seed each empty chart at its run's point farthest from its center
            own = dist.gather(2, labels[:, :, None])[:, :, 0]  # (N, R)
            for chart in empty.tolist():
                far = int(own[:, chart // k].argmax())
                centers[chart] = x[far]
                own[far, chart // k] = -1.0
    dist = sq_distances(x, centers, x_sq).view(n, restarts, k)
    nearest, labels = dist.min(-1)  # (N, R)
    inertia = nearest.sum(0)  # (R,)
    r = int(inertia.argmin())
    return centers.view(restarts, k, d)[r], labels[:, r], float(inertia[r])


def local_pca(
    members: torch.Tensor, center: torch.Tensor, m: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-m principal directions (d, m) and singular values (m,) of `members` around `center`.

    Uses the n x n Gram matrix (n members << d). A chart with fewer than m independent
    offsets gets its basis completed with random orthonormal directions (singular value 0).
    """
    # In float64: U = X^T V / sigma is orthonormal only to eps * lambda_max / lambda, and kept
    # directions go down to 1e-5 of lambda_max (fp32 would leave errors of ~1e-2 there).
    offsets = (members - center).double()  # (n, d)
    gram = offsets @ offsets.T  # (n, n)
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    evals, evecs = evals.flip(0)[:m], evecs.flip(1)[:, :m]
    # Eigenvalues below fp32 round-off of the largest are noise, not directions.
    keep = evals > evals.max().clamp_min(1e-30) * 1e-5 if len(evals) else evals.bool()
    sigma = torch.zeros(m, dtype=members.dtype, device=members.device)
    sigma[: int(keep.sum())] = evals[keep].sqrt().to(members.dtype)
    basis = (offsets.T @ evecs[:, keep] / evals[keep].sqrt()).to(members.dtype)  # (d, rank) orthonormal
    if basis.shape[1] < m:
        basis = _complete_basis(basis, m, generator)
    return basis, sigma


def _complete_basis(basis: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
    d = basis.shape[0]
    filler = torch.randn(d, m - basis.shape[1], generator=generator, dtype=basis.dtype).to(basis.device)
    q, _ = torch.linalg.qr(torch.cat([basis, filler], 1))
    # QR keeps span(basis) in the first columns; restore their exact values and signs.
    return torch.cat([basis, q[:, basis.shape[1] :]], 1)


def random_bases(k: int, d: int, m: int, generator: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(k, d, m, generator=generator))
    return q


def fit_atlas(x: torch.Tensor, config: AtlasConfig, meta: dict | None = None) -> Atlas:
    """Fit an atlas to calibration activations `x` (N, d). `meta` (backbone, layer, data hashes)
    is stored in the manifest."""
    if x.ndim != 2:
        raise ValueError(f"calibration activations: expected a (N, d) matrix, got shape {tuple(x.shape)}")
    if not torch.isfinite(x.sum()):  # any NaN/inf makes the sum non-finite; one pass, no mask
        raise ValueError("calibration activations contain NaN or inf")
    x = x.float()
    k, m = config.num_charts, config.rank
    if m > x.shape[1]:
        raise InputError(f"rank: expected at most d={x.shape[1]} directions per chart, got {m}")
    generator = torch.Generator().manual_seed(config.seed + 1)
    centers, labels, inertia = (
        kmeans(x, k, config.seed, config.max_iter, config.restarts)
        if k > 1
        else (x.mean(0, keepdim=True), torch.zeros(len(x), dtype=torch.long, device=x.device), 0.0)
    )
    dist = sq_distances(x, centers)
    if k == 1:
        inertia = float(dist.sum())

    if config.variant == "random-local":
        bases, sigma = random_bases(k, x.shape[1], m, generator).to(x.device), torch.zeros(k, m, device=x.device)
    else:
        if config.equal_support:
            support = dist.topk(min(config.equal_support, len(x)), dim=0, largest=False).indices.T  # (K, S)
            groups = [x[support[c]] for c in range(k)]
        else:
            groups = [x[labels == c] for c in range(k)]
        # One small eigendecomposition per chart; K is small and this runs once per atlas.
        fitted = [local_pca(g, centers[c], m, generator) for c, g in enumerate(groups)]
        bases = torch.stack([b for b, _ in fitted])  # (K, d, m)
        sigma = torch.stack([s for _, s in fitted])  # (K, m)
        if config.variant == "shuffled-patch" and k > 1:
            perm = _derangement(k, generator)
            bases, sigma = bases[perm], sigma[perm]

    tau = float(dist.min(1).values.mean())
    sample = torch.randperm(len(x), generator=generator)[: config.calibration_sample]
    counts = torch.bincount(labels, minlength=k)
    meta = {
        **(meta or {}),
        "config": config.to_dict(),
        "num_vectors": len(x),
        "inertia": inertia,
        "chart_sizes": counts.tolist(),
    }
    return Atlas(centers=centers, bases=bases, sigma=sigma, tau=tau, calibration=x[sample].clone(), meta=meta)


def _derangement(k: int, generator: torch.Generator) -> torch.Tensor:
    """A permutation with no fixed point, so every chart gets another chart's basis."""
    order = torch.randperm(k, generator=generator)
    perm = torch.empty_like(order)
    perm[order] = order.roll(-1)  # a random k-cycle: chart order[i] takes order[i+1]'s basis
    return perm
