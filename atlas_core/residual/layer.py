"""The shared residual Delta(h) and its structural variants (spec section 3).

Full ATLAS, with e = h - mu(h) the offset from the routed center:
    z(h)     = P(h) e                     # filtered offset
    rho(h)   = ||z|| / (||z|| + s)
    Delta(h) = rho(h) P(h) B A z(h)
Only A (r x d) and B (d x r) train. Neither the filter nor e is ever materialised. With
U = [U_1..U_K] (d, Km), C the centers (K, d) and Wm the chart weights repeated m times:
    [U^T h, A h] = h [U, A^T]             one (N, d) x (d, Km + r) GEMM
    U^T e = U^T h - W (C U)               (C U is K x Km)
    c     = alpha Wm * U^T e              so that z = e - U c
    A z   = A h - W (C A^T) - c (A U)^T   (A U is r x Km)
    ||e||^2 from the routing distances; ||z||^2 = ||e||^2 - 2 c.(U^T e) + c^T (U^T U) c
    P B a = B a - alpha U c2,  c2 = Wm * (a (B^T U))
    Delta = [rho a, rho c2] [B^T; -alpha U^T]   one (N, r + Km) x (r + Km, d) GEMM
so a token costs two d x (Km + r) GEMMs plus small ones, whatever K is, and the only
passes over (N, d) are reading h and writing Delta.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ..atlas import Atlas, route_with_offset
from .config import FULL_FORM, ResidualConfig

CENTERED = ("centered", "centered-distance")


class AtlasResidual(nn.Module):
    kind = "adapter"  # the kind of its files (save_adapter): frozen deltas are dispatched on it (atlas_core.methods)

    def __init__(self, config: ResidualConfig, dim: int, atlas: Atlas | None = None, calibrate: bool = True):
        """`calibrate=False`: leave s / s_d unset (NaN) for a caller that loads them (saved adapters)."""
        super().__init__()
        self.config, self.dim = config, dim
        needed = config.atlas_variant
        if needed is not None:
            if atlas is None:
                raise ValueError(f"variant {config.variant!r} needs an atlas (variant {needed!r}), got none")
            if atlas.variant != needed:
                raise ValueError(
                    f"variant {config.variant!r} needs an atlas of variant {needed!r}, got {atlas.variant!r}"
                )
            if atlas.dim != dim:
                raise ValueError(f"atlas: fitted for hidden size {atlas.dim}, the residual has d={dim}")
        self.atlas_sha256 = atlas.sha256 if (atlas is not None and needed is not None) else None

        generator = torch.Generator().manual_seed(config.seed)
        bound = 1.0 / math.sqrt(dim)  # as PEFT's LoRA A (kaiming-uniform, a=sqrt(5))
        self.A = nn.Parameter((torch.rand(config.rank, dim, generator=generator) * 2 - 1) * bound)  # (r, d)
        self.B = nn.Parameter(torch.zeros(dim, config.rank))  # (d, r): zero, so Delta starts at 0

        # Frozen atlas geometry; not persistent: adapters record the atlas by sha256 instead.
        if needed is not None:
            flat = atlas.flat_bases().float()  # (d, Km)
            centers = atlas.centers.float()
            self.register_buffer("centers", centers, persistent=False)  # (K, d)
            self.register_buffer("center_gram", centers @ centers.T, persistent=False)  # (K, K)
            self.register_buffer("U", flat, persistent=False)  # (d, Km)
            self.register_buffer("centers_U", centers @ flat, persistent=False)  # (K, Km)
            self.register_buffer("gram", flat.T @ flat, persistent=False)  # (Km, Km)
            self.tau, self.m = atlas.tau, atlas.rank
        # Scales: s for full ATLAS, s_d for centered-distance; set by calibrate() if asked.
        self.register_buffer("s", torch.tensor(float(config.scale) if config.scale != "calibrated" else float("nan")))
        self.register_buffer("s_d", torch.tensor(float("nan")))
        self._cache: dict = {}
        if calibrate and needed is not None and self._needs_calibration():
            self.calibrate(atlas.calibration)

    def _needs_calibration(self) -> bool:
        v = self.config.variant
        return (v in FULL_FORM and self.config.scale == "calibrated") or v == "centered-distance"

    def extra_repr(self) -> str:
        return f"variant={self.config.variant}, d={self.dim}, r={self.config.rank}, layer={self.config.layer}"

    # ------------------------------------------------------------------ pieces of the operator
    def _operands(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Products of the geometry with A and B, in the compute dtype.

        Rebuilt on every call while A or B train (they carry gradients); cached otherwise,
        which is what keeps decoding cheap.
        """
        # The device too: module.to() keeps A's version, and a cache from before a move would
        # leave CPU operands in a CUDA forward.
        key = (self.A._version, self.B._version, dtype, self.A.device)
        if self._cache.get("key") == key and not (torch.is_grad_enabled() and self.A.requires_grad):
            return self._cache
        a, b = self.A.to(dtype), self.B.to(dtype)
        ops = {"A": a, "B": b}
        if self.config.variant != "plain":
            centers = self.centers.to(dtype)
            ops["centers_A"] = centers @ a.T  # (K, r)
        if self.config.variant not in CENTERED and self.config.variant != "plain":
            u = self.U.to(dtype)
            ops["U_A"] = torch.cat([u, a.T], 1)  # (d, Km + r)
            ops["centers_U"] = self.centers_U.to(dtype)  # (K, Km)
            ops["AU"] = a @ u  # (r, Km)
            ops["BtU"] = b.T @ u  # (r, Km)
            ops["out"] = torch.cat([b.T, -self.config.alpha * u.T], 0)  # (r + Km, d)
        if not torch.is_grad_enabled() or not self.A.requires_grad:
            self._cache = {**ops, "key": key}
        return ops

    def _filtered(self, x: torch.Tensor, w: torch.Tensor, ops: dict) -> tuple[torch.Tensor, ...]:
        """(A h, Wm, U^T e, c) for x (N, d) routed with weights w (N, K)."""
        proj = x @ ops["U_A"]  # (N, Km + r)
        km = proj.shape[1] - self.config.rank
        wd = w.to(x.dtype)
        wm = wd.repeat_interleave(self.m, dim=1)  # (N, Km)
        e_u = proj[:, :km] - wd @ ops["centers_U"]  # (N, Km) = U^T e
        c = self.config.alpha * wm * e_u  # z = e - U c
        return proj[:, km:], wm, e_u, c

    def _z_norm(self, e_sq: torch.Tensor, e_u: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """||z|| (N,) in fp32 without forming z."""
        c32 = c.float()
        z2 = e_sq - 2 * (c32 * e_u.float()).sum(-1) + ((c32 @ self.gram) * c32).sum(-1)
        return z2.clamp_min(0).sqrt()

    # ------------------------------------------------------------------ forward
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Delta(h) for h (..., d); same shape and dtype as h."""
        if h.shape[-1] != self.dim:
            raise ValueError(f"h: expected last dimension d={self.dim}, got shape {tuple(h.shape)}")
        x = h.reshape(-1, self.dim)  # (N, d)
        with _one_thread_if_few(x):
            return self._delta(x).view_as(h)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        """Delta(x) (N, d) for x (N, d)."""
        ops = self._operands(x.dtype)
        variant = self.config.variant
        if variant == "plain":
            return (x @ ops["A"].T) @ ops["B"].T
        w, e_sq = route_with_offset(x, self.centers, self.tau, self.config.top_n, self.center_gram)  # fp32
        wd = w.to(x.dtype)
        if variant in CENTERED:
            a = x @ ops["A"].T - wd @ ops["centers_A"]  # (N, r) = A e
            if variant == "centered-distance":
                norm = e_sq.sqrt()
                a = a * (norm / (norm + self.s_d)).to(x.dtype)[:, None]
            return a @ ops["B"].T
        x_a, wm, e_u, c = self._filtered(x, w, ops)
        a = x_a - wd @ ops["centers_A"] - c @ ops["AU"].T  # (N, r) = A z
        if variant == "input-filter":
            return a @ ops["B"].T
        c2 = wm * (a @ ops["BtU"])  # (N, Km): P(h) B a = B a - alpha U c2
        norm = self._z_norm(e_sq, e_u, c)
        rho = (norm / (norm + self.s)).to(x.dtype)[:, None]
        return torch.cat([rho * a, rho * c2], 1) @ ops["out"]  # rho folded in before the GEMM

    # ------------------------------------------------------------------ calibration
    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> None:
        """Set s = median ||z|| (if scale='calibrated') and s_d so that centered-distance's mean
        amplitude rho_d matches full ATLAS's mean rho on the calibration vectors x (S, d)."""
        x = x.float()
        w, e_sq = route_with_offset(x, self.centers, self.tau, self.config.top_n, self.center_gram)
        ops = {"U_A": torch.cat([self.U, self.A.T], 1), "centers_U": self.centers_U}
        _, _, e_u, c = self._filtered(x, w, ops)
        z = self._z_norm(e_sq, e_u, c)
        if self.config.scale == "calibrated":
            self.s.fill_(float(z.median()))
        if self.config.variant == "centered-distance":
            target = float((z / (z + self.s)).mean())
            self.s_d.fill_(_solve_scale(e_sq.sqrt(), target))


# Decoding runs the operator on one token a row. Its GEMVs then read a few hundred KB, and split
# over OpenMP threads that wait passively (OMP_WAIT_POLICY=PASSIVE, set by every entry point) each
# op waits for a sleeping thread to wake, which costs more than the op (SmolLM2's residual, one
# token, bf16, 2 cores: 1.32 ms on two threads, 0.68 ms on one; bench/decoding.py). Training and
# teacher-forced evaluation pass hundreds of tokens and keep every thread.
FEW_TOKENS = 64


@contextmanager
def _one_thread_if_few(x: torch.Tensor) -> Iterator[None]:
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or x.shape[0] > FEW_TOKENS or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _solve_scale(norms: torch.Tensor, target: float) -> float:
    """s_d > 0 with mean(norms / (norms + s_d)) = target, by bisection in log space."""
    lo, hi = -30.0, 30.0
    for _ in range(100):  # mean amplitude decreases monotonically in s_d
        mid = (lo + hi) / 2
        if float((norms / (norms + math.exp(mid))).mean()) > target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)
