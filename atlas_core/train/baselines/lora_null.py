"""LoRA-Null (Tang et al., arXiv 2503.02659; code HungerPWAY/LoRA-Null): LoRA initialised in the
null space of the retained activations.

    C_max = sum_seq (X_seq / max|X_seq|)^T (X_seq / max|X_seq|)      (d_in, d_in), retained o_proj inputs
    N     = the r eigenvectors of C_max with the SMALLEST eigenvalues (d_in, r)
    W_null = W N N^T = U S V^T                                      thin SVD, rank r
    B0 = U sqrt(S / s),  A0 = sqrt(S / s) V^T                       so  s B0 A0 = W_null
    forward:  h = (W - s B0 A0) x + s B A x,   (A, B) = (A0, B0) at init  ->  h = W x exactly

The rows of A0 lie in span(N), where the retained inputs have (almost) no energy: A0 X_ret^T ~ 0.
v1 trains A and B; v2 freezes A = A0 and trains B only (d_out r numbers), so it runs at rank
2r to match the budget r (d_in + d_out) of a square projection.

(choice) W itself is never rewritten: the frozen product s B0 A0 is subtracted inside the LoRA
branch (a hook on lora_B), the same function as the official W - s B0 A0. The backbone stays
bit-identical, f0 is the adapter switched off, and the delta relative to the ORIGINAL W,
s (B A - B0 A0), is saved as the rank-2r factors [A; A0], [B, -B0] (v2: rank r, A0 and B - B0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...methods import register
from ...methods.weight_lora import WeightMethod
from ...typed_config import ConfigError, field
from ..lora import WeightLoRA
from ..retained_stats import RetainedStats

MODES = ("v1", "v2")


@dataclass
class LoRANullOptions:
    mode: str = field(
        "v1: train A and B; v2: freeze A (its null-space init) and train B only, at rank 2r to match the budget.", "v1"
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: expected one of {MODES}, got {self.mode!r}")


class LoRANull(WeightLoRA):
    method = "lora-null"

    def __init__(
        self, model, layer: int, rank: int, alpha: float, target: str, seed: int, stats: RetainedStats, mode: str = "v1"
    ):
        if mode not in MODES:
            raise ValueError(f"lora_null.mode: expected one of {MODES}, got {mode!r}")
        self.mode, self.stats = mode, stats
        self._x: torch.Tensor | None = None
        super().__init__(model, layer, 2 * rank if mode == "v2" else rank, alpha, target, seed)
        self.budget_rank = rank

    def _setup(self) -> None:
        if self.mode == "v2":
            self.lora_A.requires_grad_(False)
        self._hook(self.lora.lora_A["default"], self._keep_input)
        self._hook(self.lora.lora_B["default"], self._subtract_init)

    def _init_factors(self, g: torch.Generator) -> None:
        r = self.rank
        W = self.base_weight().double()  # (d_out, d_in)
        if r > min(W.shape):
            raise ValueError(f"rank: LoRA-Null needs rank <= min(d_out, d_in) = {min(W.shape)}, got {r}")
        C = self.stats.matrix("cov_max", self.layer, self.target, W.shape[1]).double()
        _, vecs = torch.linalg.eigh(C)  # eigenvalues ascending
        N = vecs[:, :r]  # (d_in, r): the least-used input directions
        U, S, Vh = torch.linalg.svd(W @ N @ N.T, full_matrices=False)
        root = (S[:r] / self.scaling).sqrt()  # (r,)
        # contiguous like PEFT's factors: the same kernels then round B0 A0 x and B A x identically
        self.A0 = (root[:, None] * Vh[:r]).float().contiguous()  # (r, d_in)
        self.B0 = (U[:, :r] * root).float().contiguous()  # (d_out, r)
        self.lora_A.copy_(self.A0)
        self.lora_B.copy_(self.B0)

    def to(self, device) -> "LoRANull":
        super().to(device)
        self.A0, self.B0 = self.A0.to(device), self.B0.to(device)
        return self

    def _keep_input(self, _module, args, out):
        self._x = args[0]  # (..., d_in), already cast to the factors' dtype by PEFT

    def _subtract_init(self, _module, _args, out):
        x, self._x = self._x, None
        # B A x - B0 A0 x, (..., d_out): F.linear as PEFT's Linear layers, so the branch is exactly 0 at init
        return out - F.linear(F.linear(x, self.A0), self.B0)

    def named_trainable(self):
        return [("lora_B", self.lora_B)] if self.mode == "v2" else [("lora_A", self.lora_A), ("lora_B", self.lora_B)]

    def describe(self) -> dict:
        return super().describe() | {"mode": self.mode, "stats_key": self.stats.key}

    @torch.no_grad()
    def delta_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "v2":  # A = A0 throughout: s (B - B0) A0
            return self.A0.clone(), self.lora_B - self.B0
        return torch.cat([self.lora_A, self.A0]), torch.cat([self.lora_B, -self.B0], 1)  # (2r, d_in), (d_out, 2r)


class LoRANullMethod(WeightMethod):
    name = "lora-null"
    summary = "LoRA initialised in the null space of the retained o_proj inputs (v1: A and B train; v2: B only)"
    adapter_class = LoRANull
    options_cls, options_block = LoRANullOptions, "lora_null"
    uses_stats = True

    def adapter_kwargs(self, run_config, stats) -> dict:
        return {"stats": stats, "mode": run_config.lora.lora_null.mode}


register(LoRANullMethod())
