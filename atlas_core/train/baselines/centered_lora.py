"""Centered LoRA, a control rather than a published baseline (issue 32): Weight-LoRA on the
mean-subtracted input of layer l's o_proj.

    h = W x + s * B A (x - mu),      mu (d_in,) = the retained contexts' mean o_proj input

The weight adapter's counterpart of the Centered residual (B A (h - mu) on the hidden state): does
removing the retained common mode from a weight adapter's input do for it what centering does for
the residual? Same budget as Weight-LoRA (A and B train; mu is fixed, from the retained statistics,
atlas_core.train.retained_stats). B = 0 at init, so the model starts exactly at the base.

Not a plain LoRA: the update has the constant term -s B A mu, which no LoRA factor holds and (o_proj
has no bias) no merged weight either, so a saved one is applied by `FrozenCenteredLoRA` (its delta
format, kind "centered-lora", registered here) and exported with --format folder only. The trainable
form is PEFT's LoRA with mu subtracted by a pre-hook on lora_A (PEFT computes result + lora_B(lora_A(x)) * s).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ...io import expect_shape, save_verified
from ...lora_delta import FrozenLoRA, hooked_linear, read_lora_file
from ...methods import DeltaFormat, register
from ...methods.weight_lora import WeightMethod
from ..lora import WeightLoRA
from ..retained_stats import RetainedStats

CENTERED_LORA_FORMAT = 1


class CenteredLoRA(WeightLoRA):
    kind = "centered-lora"
    method = "centered-lora"

    def __init__(
        self,
        model,
        layer: int,
        rank: int,
        alpha: float,
        target: str,
        seed: int,
        stats: RetainedStats | None = None,
    ):
        if stats is None:
            raise ValueError("centered-lora needs the retained statistics (stats=): mu is their mean input")
        self.stats, self.stats_key = stats, stats.key
        super().__init__(model, layer, rank, alpha, target, seed)

    def _setup(self) -> None:
        d_in = self.lora_A.shape[1]
        self.mu = self.stats.input_mean(self.layer, self.target, d_in).float().to(self.lora_A.device)  # (d_in,)
        self._hook(self.lora.lora_A["default"], self._center, pre=True)

    def _center(self, _module, args):
        x = args[0]  # (..., d_in), already in the factors' dtype
        return (x - self.mu.to(x.dtype), *args[1:])

    def to(self, device) -> "CenteredLoRA":
        super().to(device)
        self.mu = self.mu.to(device)
        return self

    def delta_factors(self):
        raise TypeError("centered-lora: the update has the constant term -s B A mu; FrozenCenteredLoRA applies it")

    def describe(self) -> dict:
        return super().describe() | {"stats_key": self.stats_key}

    def save(self, path: str | Path, meta: dict) -> dict:
        manifest = {
            **meta,
            "kind": self.kind,
            "format": CENTERED_LORA_FORMAT,
            **self.describe(),
            "method": self.method,
            "module": self.module_name,
            "scaling": self.scaling,
        }
        return save_verified(path, {"lora_A": self.lora_A, "lora_B": self.lora_B, "mu": self.mu}, manifest)


class FrozenCenteredLoRA(FrozenLoRA):
    """A saved centered LoRA applied as a frozen hook: out = W x + s * B (A (x - mu))."""

    kind = "centered-lora"

    def __init__(self, module_name: str, lora_A, lora_B, mu: torch.Tensor, scaling: float, layer: int):
        super().__init__(module_name, lora_A, lora_B, scaling, layer)
        if tuple(mu.shape) != (lora_A.shape[1],):
            raise ValueError(f"centered-lora: expected mu ({lora_A.shape[1]},), got {tuple(mu.shape)}")
        self.mu = mu.detach()

    @classmethod
    def load(cls, path: str | Path) -> "FrozenCenteredLoRA":
        tensors, m = read_lora_file(path, cls.kind, ("lora_A", "lora_B", "mu"))
        expect_shape("mu", tensors["mu"], (tensors["lora_A"].shape[1],), str(path))
        return cls(m["module"], tensors["lora_A"], tensors["lora_B"], tensors["mu"], m["scaling"], m["layer"])

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        base = hooked_linear(model, self.module_name, (self.lora_B.shape[0], self.lora_A.shape[1]), self.kind)
        dev = base.weight.device
        A, B, mu = self.lora_A.to(dev), self.lora_B.to(dev), self.mu.to(dev)

        def hook(_module, args, out):
            x = args[0].to(A.dtype) - mu  # (..., d_in)
            return out + ((x @ A.T) @ B.T * self.scaling).to(out.dtype)  # (..., d_out)

        handle = base.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


class CenteredLoRADelta(DeltaFormat):
    """A saved centered LoRA: applied by FrozenCenteredLoRA; no plain LoRA (exported with --format folder only)."""

    kind = "centered-lora"

    def load(self, path: Path, manifest: dict, atlas_for):
        return FrozenCenteredLoRA.load(path)


class CenteredLoRAMethod(WeightMethod):
    name = "centered-lora"
    summary = "LoRA on the mean-subtracted o_proj input, s B A (x - mu) (a control: not mergeable)"
    adapter_class = CenteredLoRA
    delta = CenteredLoRADelta()
    uses_stats = True

    def adapter_kwargs(self, run_config, stats) -> dict:
        return {"stats": stats}


register(CenteredLoRAMethod())
