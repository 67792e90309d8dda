"""TopLoRA (Li et al., NeurIPS 2025, arXiv 2510.23123; code Leopold1423/toplora-neurips25): LoRA
with a token-wise diagonal between A and B.

    h = W x + s * B (Sigma_x A x),      Sigma_x = diag(exp(RMSNorm_r(x Theta)))

Theta (d_in, r) is trainable (Kaiming-uniform, a = sqrt 5, fan_out, as the official code),
RMSNorm over the r values has a learnable gain (torch.nn.RMSNorm, eps = the dtype's machine
epsilon as there); B = 0 at init, so the model starts exactly at the base. Trainable:
r d_in (A) + d_out r (B) + d_in r (Theta) + r (gain), 3 d r + r when square: it runs at
r_T = round(2r / 3) to match the budget 2 d r (r = 16 -> 11).

Not mergeable (Sigma_x depends on the token), so a saved TopLoRA is applied frozen by
`FrozenTopLoRA`: a hook on the base Linear computing the same branch (its delta format, kind
"toplora", is registered here: atlas_core.chain loads such files with it). The trainable form is
PEFT's LoRA with the gate as a hook on lora_A's output: PEFT computes
result + lora_B(gate * lora_A(x)) * s.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ...io import expect_shape, save_verified
from ...lora_delta import hooked_linear, read_lora_file
from ...methods import DeltaFormat, register
from ...methods.weight_lora import WeightMethod
from ..lora import WeightLoRA

TOPLORA_FORMAT = 1


def toplora_rank(rank: int) -> int:
    """r_T = round(2 r / 3): 3 d r_T + r_T ~ 2 d r."""
    return max(1, round(2 * rank / 3))


class TokenGate(nn.Module):
    """x (..., d_in) -> exp(RMSNorm(x Theta)) (..., r): the token-wise singular values."""

    def __init__(self, d_in: int, rank: int, generator: torch.Generator | None = None):
        super().__init__()
        self.theta = nn.Parameter(torch.empty(d_in, rank))  # (d_in, r)
        nn.init.kaiming_uniform_(self.theta, a=math.sqrt(5), mode="fan_out", generator=generator)
        self.norm = nn.RMSNorm(rank)  # gain: (r,), ones at init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.norm(x @ self.theta))  # (..., r)


class TopLoRA(WeightLoRA):
    kind = "toplora"
    method = "toplora"

    def __init__(self, model, layer: int, rank: int, alpha: float, target: str, seed: int):
        super().__init__(model, layer, toplora_rank(rank), alpha, target, seed)
        self.budget_rank = rank

    def _setup(self) -> None:
        g = torch.Generator().manual_seed(self.seed + 2)  # not A's stream
        self.gate = TokenGate(self.lora_A.shape[1], self.rank, g).to(self.lora_A.device)
        self._hook(self.lora.lora_A["default"], self._apply_gate)

    def _apply_gate(self, _module, args, out):
        return out * self.gate(args[0])  # Sigma_x A x, (..., r)

    def to(self, device) -> "TopLoRA":
        super().to(device)
        self.gate.to(device)
        return self

    def named_trainable(self):
        return [
            ("lora_A", self.lora_A),
            ("lora_B", self.lora_B),
            ("theta", self.gate.theta),
            ("gain", self.gate.norm.weight),
        ]

    def delta_factors(self):
        raise TypeError("toplora: the update depends on the token (not mergeable); FrozenTopLoRA applies it")

    def save(self, path: str | Path, meta: dict) -> dict:
        manifest = {
            **meta,
            "kind": self.kind,
            "format": TOPLORA_FORMAT,
            **self.describe(),
            "method": self.method,
            "module": self.module_name,
            "scaling": self.scaling,
            "eps": self.gate.norm.eps,
        }
        return save_verified(path, dict(self.named_trainable()), manifest)


class FrozenTopLoRA:
    """A saved TopLoRA applied as a frozen hook: out = W x + s * B ((A x) * exp(RMSNorm(x Theta)))."""

    kind = "toplora"

    def __init__(
        self, module_name: str, tensors: dict[str, torch.Tensor], scaling: float, layer: int, eps: float | None = None
    ):
        A, B, theta, gain = (tensors[k].detach() for k in ("lora_A", "lora_B", "theta", "gain"))
        r, d_in = A.shape
        if B.ndim != 2 or B.shape[1] != r or tuple(theta.shape) != (d_in, r) or tuple(gain.shape) != (r,):
            raise ValueError(
                f"toplora: expected A (r, d_in), B (d_out, r), theta (d_in, r), gain (r,), got "
                f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(theta.shape)}, {tuple(gain.shape)}"
            )
        self.module_name, self.scaling, self.layer, self.eps = module_name, float(scaling), int(layer), eps
        self.A, self.B, self.theta, self.gain = A, B, theta, gain

    @classmethod
    def load(cls, path: str | Path) -> "FrozenTopLoRA":
        tensors, m = read_lora_file(path, "toplora", ("lora_A", "lora_B", "theta", "gain"))
        d_in, rank = tensors["lora_A"].shape[1], m["rank"]
        expect_shape("theta", tensors["theta"], (d_in, rank), str(path))
        expect_shape("gain", tensors["gain"], (rank,), str(path))
        return cls(m["module"], tensors, m["scaling"], m["layer"], m.get("eps"))

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        base = hooked_linear(model, self.module_name, (self.B.shape[0], self.A.shape[1]), "toplora")
        dev = base.weight.device
        A, B, theta, gain = (t.to(dev) for t in (self.A, self.B, self.theta, self.gain))

        def hook(_module, args, out):
            x = args[0].to(A.dtype)  # (..., d_in)
            gate = torch.exp(nn.functional.rms_norm(x @ theta, (theta.shape[1],), gain, self.eps))  # (..., r)
            return out + (((x @ A.T) * gate) @ B.T * self.scaling).to(out.dtype)  # (..., d_out)

        handle = base.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


class TopLoRADelta(DeltaFormat):
    """A saved TopLoRA: applied by FrozenTopLoRA; no plain LoRA (exported with --format folder only)."""

    kind = "toplora"

    def load(self, path: Path, manifest: dict, atlas_for):
        return FrozenTopLoRA.load(path)


class TopLoRAMethod(WeightMethod):
    name = "toplora"
    summary = "LoRA with a token-wise gate between A and B (not mergeable), at rank round(2r / 3)"
    adapter_class = TopLoRA
    delta = TopLoRADelta()


register(TopLoRAMethod())
