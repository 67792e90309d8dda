"""CLoRA (Lu et al., ACL 2025, arXiv 2410.16801; code sutakori/CLoRA): LoRA with a regulariser that
keeps A and B out of fixed random subspaces.

    R = 1/2 ||A P_A||_F^2 + 1/2 ||B^T P_B||_F^2,      loss = L_task + lambda R,  lambda = 1

P_A (d_in, k), P_B (d_out, k): random orthonormal columns (`nn.init.orthogonal_`, seeded,
frozen). k = 512 in the paper, capped (choice) at min(512, d // 2) with d = min(d_in, d_out), so
the constrained subspace never covers the whole space of a small projection. Plain LoRA
otherwise, saved as plain factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...methods import register
from ...methods.weight_lora import WeightMethod
from ...typed_config import ConfigError, field
from ..lora import WeightLoRA


@dataclass
class CLoRAOptions:
    lam: float = field("Weight lambda of R = 1/2 ||A P_A||^2 + 1/2 ||B^T P_B||^2 (the paper: 1).", 1.0)
    k: int | None = field(
        "Columns of the random orthonormal P_A, P_B (null: min(512, d // 2), d = min(d_in, d_out)).", None
    )

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ConfigError(f"lam: expected a number >= 0, got {self.lam!r}")
        if self.k is not None and self.k < 1:
            raise ConfigError(f"k: expected a positive integer or null, got {self.k!r}")


def clora_penalty(A: torch.Tensor, B: torch.Tensor, P_A: torch.Tensor, P_B: torch.Tensor, lam: float) -> torch.Tensor:
    """lambda * (1/2 ||A P_A||^2 + 1/2 ||B^T P_B||^2): A (r, d_in), B (d_out, r), P_A (d_in, k), P_B (d_out, k)."""
    if A.shape[1] != P_A.shape[0] or B.shape[0] != P_B.shape[0] or A.shape[0] != B.shape[1]:
        raise ValueError(
            f"clora: shapes A {tuple(A.shape)}, B {tuple(B.shape)}, P_A {tuple(P_A.shape)}, "
            f"P_B {tuple(P_B.shape)} do not fit"
        )
    return lam * 0.5 * ((A @ P_A).square().sum() + (B.T @ P_B).square().sum())


def clora_k(d_in: int, d_out: int, k: int | None) -> int:
    return min(512, min(d_in, d_out) // 2) if k is None else k


class CLoRA(WeightLoRA):
    method = "clora"

    def __init__(
        self, model, layer: int, rank: int, alpha: float, target: str, seed: int, lam: float = 1.0, k: int | None = None
    ):
        self.lam, self.k = float(lam), k
        super().__init__(model, layer, rank, alpha, target, seed)

    def _setup(self) -> None:
        d_out, d_in = self.base.weight.shape
        self.k = clora_k(d_in, d_out, self.k)
        if not 1 <= self.k <= min(d_in, d_out):
            raise ValueError(f"clora.k: expected 1 <= k <= min(d_in, d_out) = {min(d_in, d_out)}, got {self.k}")
        g = torch.Generator().manual_seed(self.seed + 1)  # not A's stream: P_A is not correlated with A's init
        dev = self.lora_A.device
        self.P_A = nn.init.orthogonal_(torch.empty(d_in, self.k), generator=g).to(dev)  # (d_in, k)
        self.P_B = nn.init.orthogonal_(torch.empty(d_out, self.k), generator=g).to(dev)  # (d_out, k)

    def to(self, device) -> "CLoRA":
        super().to(device)
        self.P_A, self.P_B = self.P_A.to(device), self.P_B.to(device)
        return self

    def penalty(self) -> torch.Tensor:
        return clora_penalty(self.lora_A, self.lora_B, self.P_A, self.P_B, self.lam)

    def describe(self) -> dict:
        return super().describe() | {"lambda": self.lam, "k": self.k}


class CLoRAMethod(WeightMethod):
    name = "clora"
    summary = "LoRA + lambda (1/2 ||A P_A||^2 + 1/2 ||B^T P_B||^2), P_A, P_B fixed random orthonormal"
    adapter_class = CLoRA
    options_cls, options_block = CLoRAOptions, "clora"

    def adapter_kwargs(self, run_config, stats) -> dict:
        return {"lam": run_config.lora.clora.lam, "k": run_config.lora.clora.k}


register(CLoRAMethod())
