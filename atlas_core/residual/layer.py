"""The shared residual Delta(h) and its structural variants (spec section 3).

Full ATLAS, with e = h - mu(h) the offset from the routed center:
    z(h)     = P(h) e                     # filtered offset
    rho(h)   = ||z|| / (||z|| + s)
    Delta(h) = rho(h) P(h) B A z(h)
Only A (r x d) and B (d x r) train. The filter is never materialised: with U = [U_1..U_K]
(d, Km) and per-token chart weights repeated m times (Wm, (N, Km)),
    U^T e = U^T h - W (mu U)              one (N, d) x (d, Km) GEMM
    c     = alpha Wm * U^T e              so z = e - U c
    A z   = A e - c (A U)^T               (A U is r x Km: no second pass over d)
    ||z||^2 = ||e||^2 - 2 c.(U^T e) + c^T (U^T U) c
    P B a = B a - U (alpha Wm * (a (B^T U)))
    Delta = rho [a, c2] [B^T; -U^T]       one (N, r + Km) x (r + Km, d) GEMM
so a token costs two d x Km GEMMs plus small ones, whatever K is.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..atlas import Atlas, route
from .config import FULL_FORM, ResidualConfig


class AtlasResidual(nn.Module):
    def __init__(self, config: ResidualConfig, dim: int, atlas: Atlas | None = None):
        super().__init__()
        self.config, self.dim = config, dim
        needed = config.atlas_variant
        if needed is not None:
            if atlas is None:
                raise ValueError(f"variant {config.variant!r} needs an atlas (variant {needed!r}), got none")
            if atlas.variant != needed:
                raise ValueError(f"variant {config.variant!r} needs an atlas of variant {needed!r}, got {atlas.variant!r}")
            if atlas.dim != dim:
                raise ValueError(f"atlas: fitted for hidden size {atlas.dim}, the residual has d={dim}")
        self.atlas_sha256 = atlas.sha256 if (atlas is not None and needed is not None) else None

        generator = torch.Generator().manual_seed(config.seed)
        bound = 1.0 / math.sqrt(dim)  # as PEFT's LoRA A (kaiming-uniform, a=sqrt(5))
        self.A = nn.Parameter((torch.rand(config.rank, dim, generator=generator) * 2 - 1) * bound)  # (r, d)
        self.B = nn.Parameter(torch.zeros(dim, config.rank))  # (d, r): zero, so Delta starts at 0

        # Frozen atlas geometry; not persistent: adapters record the atlas by sha256 instead.
        if needed is not None:
            k, m = atlas.num_charts, atlas.rank
            flat = atlas.flat_bases().float()  # (d, Km)
            self.register_buffer("centers", atlas.centers.float(), persistent=False)  # (K, d)
            self.register_buffer("U", flat, persistent=False)  # (d, Km)
            self.register_buffer("centers_U", atlas.centers.float() @ flat, persistent=False)  # (K, Km)
            self.register_buffer("gram", flat.T @ flat, persistent=False)  # (Km, Km)
            self.tau, self.m = atlas.tau, m
        # Scales: s for full ATLAS, s_d for centered-distance; set by calibrate() if asked.
        self.register_buffer("s", torch.tensor(float(config.scale) if config.scale != "calibrated" else float("nan")))
        self.register_buffer("s_d", torch.tensor(float("nan")))
        if atlas is not None and needed is not None and self._needs_calibration():
            self.calibrate(atlas.calibration)
        self._cache: dict = {}

    def _needs_calibration(self) -> bool:
        v = self.config.variant
        return (v in FULL_FORM and self.config.scale == "calibrated") or v == "centered-distance"

    def extra_repr(self) -> str:
        return f"variant={self.config.variant}, d={self.dim}, r={self.config.rank}, layer={self.config.layer}"

    # ------------------------------------------------------------------ pieces of the operator
    def _offset(self, x: torch.Tensor, filtered: bool = True):
        """Routing and the pieces of the filtered offset for x (N, d): (Wm, e, U^T e, c)."""
        w = route(x, self.centers, self.tau, self.config.top_n)  # (N, K) fp32
        e = x - (w @ self.centers).to(x.dtype)  # (N, d) offset from the routed center
        if not filtered:
            return None, e, None, None
        wm = w.repeat_interleave(self.m, dim=1).to(x.dtype)  # (N, Km)
        u = self.U.to(x.dtype)
        e_u = x @ u - (w @ self.centers_U).to(x.dtype)  # (N, Km) = U^T e
        c = self.config.alpha * wm * e_u  # (N, Km): z = e - U c
        return wm, e, e_u, c

    def _z_norm(self, e: torch.Tensor, e_u: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """||z|| (N,) in fp32 without forming z."""
        c32 = c.float()
        z2 = e.float().pow(2).sum(-1) - 2 * (c32 * e_u.float()).sum(-1) + ((c32 @ self.gram) * c32).sum(-1)
        return z2.clamp_min(0).sqrt()

    def _products(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A U) (r, Km) and (B^T U) (r, Km); cached while A and B do not change (decoding)."""
        key = (self.A._version, self.B._version, dtype)
        if torch.is_grad_enabled() and (self.A.requires_grad or self.B.requires_grad):
            return self.A.to(dtype) @ self.U.to(dtype), self.B.T.to(dtype) @ self.U.to(dtype)
        if self._cache.get("key") != key:
            with torch.no_grad():
                u = self.U.to(dtype)
                self._cache = {"key": key, "AU": self.A.to(dtype) @ u, "BtU": self.B.T.to(dtype) @ u}
        return self._cache["AU"], self._cache["BtU"]

    # ------------------------------------------------------------------ forward
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Delta(h) for h (..., d); same shape and dtype as h."""
        if h.shape[-1] != self.dim:
            raise ValueError(f"h: expected last dimension d={self.dim}, got shape {tuple(h.shape)}")
        x = h.reshape(-1, self.dim)  # (N, d)
        a_w, b_w = self.A.to(x.dtype), self.B.to(x.dtype)
        variant = self.config.variant
        if variant == "plain":
            return ((x @ a_w.T) @ b_w.T).view_as(h)
        wm, e, e_u, c = self._offset(x, filtered=variant not in ("centered", "centered-distance"))
        if variant in ("centered", "centered-distance"):
            out = (e @ a_w.T) @ b_w.T
            if variant == "centered-distance":
                norm = e.float().norm(dim=-1)
                out = out * (norm / (norm + self.s_d)).to(x.dtype)[:, None]
            return out.view_as(h)
        a_u, bt_u = self._products(x.dtype)
        a = e @ a_w.T - c @ a_u.T  # (N, r) = A z
        if variant == "input-filter":
            return (a @ b_w.T).view_as(h)
        c2 = self.config.alpha * wm * (a @ bt_u)  # (N, Km): U^T-coefficients removed from B a
        out = torch.cat([a, c2], 1) @ torch.cat([b_w.T, -self.U.T.to(x.dtype)], 0)  # (N, d) = P(h) B a
        norm = self._z_norm(e, e_u, c)
        rho = (norm / (norm + self.s)).to(x.dtype)
        return (rho[:, None] * out).view_as(h)

    # ------------------------------------------------------------------ calibration
    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> None:
        """Set s = median ||z|| (if scale='calibrated') and s_d so that centered-distance's mean
        amplitude rho_d matches full ATLAS's mean rho on the calibration vectors x (S, d)."""
        _, e, e_u, c = self._offset(x.float())
        z = self._z_norm(e, e_u, c)
        if self.config.scale == "calibrated":
            self.s.fill_(float(z.median()))
        if self.config.variant == "centered-distance":
            target = float((z / (z + self.s)).mean())
            self.s_d.fill_(_solve_scale(e.norm(dim=-1), target))


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
