"""OPLoRA (Xiong & Xie, arXiv 2510.13003): LoRA projected off W's top-k singular subspaces.

    W = U Sigma V^T (frozen);   P_L = I - U_k U_k^T,   P_R = I - V_k V_k^T
    forward:  h = W x + s P_L B A P_R x

P_R is applied to the LoRA input and P_L to its output as rank-k corrections
(x - (x V_k) V_k^T, y - (y U_k) U_k^T), never as a d x d matrix: hooks on PEFT's lora_A
(pre) and lora_B. Since P_R v_i = 0 and u_i^T P_L = 0 for i <= k,

    (W + Delta W) v_i = sigma_i u_i,    u_i^T (W + Delta W) = sigma_i v_i^T

whatever A and B become: W's top-k singular triples are kept exactly. Standard LoRA init
(choice, unconfirmed by the paper). PEFT's merge would drop the projections, so the delta is
saved projected by hand: factors A P_R and P_L B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...methods import register
from ...methods.weight_lora import WeightMethod
from ...typed_config import ConfigError, field
from ..lora import WeightLoRA


@dataclass
class OPLoRAOptions:
    k: int = field("Top-k singular triples of W kept exactly (the paper runs 16 and 128).", 16)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"k: expected a positive integer, got {self.k!r}")


class OPLoRA(WeightLoRA):
    method = "oplora"

    def __init__(self, model, layer: int, rank: int, alpha: float, target: str, seed: int, k: int = 16):
        self.k = k
        super().__init__(model, layer, rank, alpha, target, seed)

    def _setup(self) -> None:
        k = self.k
        W = self.base_weight().double()  # (d_out, d_in)
        if not 1 <= k <= min(W.shape):
            raise ValueError(f"oplora.k: expected 1 <= k <= min(d_out, d_in) = {min(W.shape)}, got {k}")
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        self.U_k = U[:, :k].float().contiguous()  # (d_out, k)
        self.V_k = Vh[:k].T.float().contiguous()  # (d_in, k)
        self._hook(self.lora.lora_A["default"], self._project_input, pre=True)
        self._hook(self.lora.lora_B["default"], self._project_output)

    def to(self, device) -> "OPLoRA":
        super().to(device)
        self.U_k, self.V_k = self.U_k.to(device), self.V_k.to(device)
        return self

    def _project_input(self, _module, args):
        x = args[0]  # (..., d_in)
        return (x - (x @ self.V_k) @ self.V_k.T,)  # P_R x

    def _project_output(self, _module, _args, y):
        return y - (y @ self.U_k) @ self.U_k.T  # P_L y, (..., d_out)

    def describe(self) -> dict:
        return super().describe() | {"k": self.k}

    @torch.no_grad()
    def delta_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        A, B = self.lora_A, self.lora_B  # (r, d_in), (d_out, r)
        return A - (A @ self.V_k) @ self.V_k.T, B - self.U_k @ (self.U_k.T @ B)  # A P_R, P_L B


class OPLoRAMethod(WeightMethod):
    name = "oplora"
    summary = "LoRA projected off W's top-k singular subspaces (data-free)"
    adapter_class = OPLoRA
    options_cls, options_block = OPLoRAOptions, "oplora"

    def adapter_kwargs(self, run_config, stats) -> dict:
        return {"k": run_config.lora.oplora.k}


register(OPLoRAMethod())
