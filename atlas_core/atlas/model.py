"""The fitted atlas: charts (centers, local bases), routing and the routed filter (spec 1-2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..io import IntegrityError, expect_shape, load_verified, save_verified

ATLAS_FORMAT = 1


@dataclass
class Atlas:
    centers: torch.Tensor  # (K, d) chart centers mu_c
    bases: torch.Tensor  # (K, d, m) orthonormal local bases U_c
    sigma: torch.Tensor  # (K, m) singular values of each chart's members
    tau: float  # routing temperature: mean nearest-center squared distance
    calibration: torch.Tensor  # (S, d) calibration vectors kept to calibrate residual scales
    meta: dict = field(default_factory=dict)  # backbone, layer, data hashes, config, ...
    sha256: str | None = None  # of the safetensors file once saved or loaded

    def __post_init__(self) -> None:
        k, d = self.centers.shape
        m = self.bases.shape[-1]
        for name, tensor, shape in (("bases", self.bases, (k, d, m)), ("sigma", self.sigma, (k, m))):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
        if self.calibration.ndim != 2 or self.calibration.shape[1] != d:
            raise ValueError(f"calibration: expected shape (S, {d}), got {tuple(self.calibration.shape)}")
        if not self.tau > 0:
            raise ValueError(f"tau: expected a positive temperature, got {self.tau}")

    @property
    def num_charts(self) -> int:
        return self.centers.shape[0]

    @property
    def dim(self) -> int:
        return self.centers.shape[1]

    @property
    def rank(self) -> int:
        return self.bases.shape[2]

    @property
    def variant(self) -> str:
        return self.meta.get("config", {}).get("variant", "local")

    def flat_bases(self) -> torch.Tensor:
        """U = [U_1 ... U_K] (d, K*m): the layout of the fast GEMM form."""
        return self.bases.permute(1, 0, 2).reshape(self.dim, -1)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> dict:
        tensors = {
            "centers": self.centers,
            "bases": self.bases,
            "sigma": self.sigma,
            "tau": torch.tensor([self.tau]),
            "calibration": self.calibration,
        }
        manifest = {
            **self.meta,
            "kind": "atlas",
            "format": ATLAS_FORMAT,
            "K": self.num_charts,
            "d": self.dim,
            "m": self.rank,
            "tau": self.tau,
        }
        manifest = save_verified(path, {k: v.float() for k, v in tensors.items()}, manifest)
        self.sha256 = manifest["sha256"]
        return manifest

    @classmethod
    def load(cls, path: str | Path) -> "Atlas":
        tensors, manifest = load_verified(path, kind="atlas")
        try:
            k, d, m = manifest["K"], manifest["d"], manifest["m"]
        except KeyError as e:
            raise IntegrityError(f"{path}: manifest lacks field {e}") from e
        for name, shape in (("centers", (k, d)), ("bases", (k, d, m)), ("sigma", (k, m)), ("tau", (1,))):
            if name not in tensors:
                raise IntegrityError(f"{path}: tensor {name!r} missing")
            expect_shape(name, tensors[name], shape, str(path))
        if float(tensors["tau"]) != manifest["tau"]:
            raise IntegrityError(
                f"{path}: tau in the file ({float(tensors['tau'])}) differs from the manifest ({manifest['tau']})"
            )
        meta = {
            key: v
            for key, v in manifest.items()
            if key not in ("kind", "format", "K", "d", "m", "tau", "sha256", "file")
        }
        return cls(
            centers=tensors["centers"],
            bases=tensors["bases"],
            sigma=tensors["sigma"],
            tau=manifest["tau"],
            calibration=tensors["calibration"],
            meta=meta,
            sha256=manifest["sha256"],
        )


# ---------------------------------------------------------------------- routing and filter
def route(h: torch.Tensor, centers: torch.Tensor, tau: float, top_n: int) -> torch.Tensor:
    """Chart weights (N, K): softmax(-D_c / tau) over the top_n nearest centers, zero elsewhere."""
    return route_with_offset(h, centers, tau, top_n)[0]


def route_with_offset(
    h: torch.Tensor, centers: torch.Tensor, tau: float, top_n: int, center_gram: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chart weights W (N, K) and ||h - mu(h)||^2 (N,), both fp32.

    Distances are computed in fp32 whatever the input dtype: in bf16 the whole top-n set
    matched fp32 for only 65% of tokens (spec section 2). The squared offset from the routed
    center mu(h) = W C comes from the same dot products, ||h||^2 - 2 W.(h C^T) + W (C C^T) W^T,
    so callers never need to form h - mu(h) (a pass over N x d).
    """
    h = h.float()
    h_sq = (h * h).sum(-1)  # (N,)
    dots = h @ centers.T  # (N, K)
    d2 = h_sq[:, None] - 2.0 * dots + (centers * centers).sum(-1)
    n = min(top_n, centers.shape[0])
    nearest, idx = d2.topk(n, dim=-1, largest=False)  # (N, n)
    weights = torch.zeros_like(d2).scatter_(-1, idx, torch.softmax(-nearest / tau, dim=-1))
    gram = centers @ centers.T if center_gram is None else center_gram  # (K, K)
    offset_sq = h_sq - 2.0 * (weights * dots).sum(-1) + ((weights @ gram) * weights).sum(-1)
    return weights, offset_sq.clamp_min_(0.0)


def apply_filter(x: torch.Tensor, weights: torch.Tensor, flat_bases: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """P(h) x = x - alpha * U (W(h) * (U^T x)) for a batch: x (N, d), weights (N, K), U (d, K*m).

    Two GEMMs with K*m columns; no d x d matrix and no per-token gathered bases.
    """
    k = weights.shape[-1]
    m = flat_bases.shape[1] // k
    coeff = (x @ flat_bases).view(-1, k, m) * weights[:, :, None].to(x.dtype)  # (N, K, m)
    return x - alpha * (coeff.view(x.shape[0], -1) @ flat_bases.T)
