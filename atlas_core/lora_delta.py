"""A LoRA update of one Linear, frozen: what a Weight-LoRA file (any weight baseline but TopLoRA) and
each module of a submitted PEFT LoRA (atlas_core.peft_lora) apply in a chain (atlas_core.chain).

A frozen forward hook on the Linear adds  scaling * B A x,  the same arithmetic as PEFT's LoRA
layer (x cast to the factors' dtype, the sum cast back). A hook rather than PEFT injection,
because PEFT keeps one adapter named 'default' per module and a chain may hold several LoRAs on
one module (and a new one may be trained there on top).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .errors import InputError
from .io import IntegrityError, expect_shape, load_verified


def read_lora_file(path: str | Path, kind: str, names: tuple[str, ...]) -> tuple[dict, dict]:
    """A saved LoRA-family delta, verified: (tensors, manifest) with the manifest's module, scaling,
    rank and layer present, every tensor of `names` present and A (rank, d_in), B (d_out, rank)."""
    tensors, manifest = load_verified(path, kind=kind)
    missing = [k for k in ("module", "scaling", "rank", "layer") if k not in manifest]
    if missing:
        raise IntegrityError(f"{path}: manifest lacks field {missing[0]!r}")
    rank = manifest["rank"]
    for name in names:
        if name not in tensors:
            raise IntegrityError(f"{path}: tensor {name!r} missing")
    expect_shape("lora_A", tensors["lora_A"], (rank, tensors["lora_A"].shape[1]), str(path))
    expect_shape("lora_B", tensors["lora_B"], (tensors["lora_B"].shape[0], rank), str(path))
    return tensors, manifest


def hooked_linear(model: nn.Module, module_name: str, shape: tuple[int, int], kind: str) -> nn.Linear:
    """The Linear a frozen LoRA-family delta hooks: `module_name`, or the base layer of a PEFT
    wrapper installed there since; refused unless its weight is (d_out, d_in) = `shape`."""
    try:
        target = model.get_submodule(module_name)
    except AttributeError as e:
        raise InputError(f"{kind}: the model has no module {module_name!r} ({e})") from e
    base = getattr(target, "base_layer", target)
    if not isinstance(base, nn.Linear) or tuple(base.weight.shape) != tuple(shape):
        raise InputError(f"{kind}: {module_name} is not a Linear of shape {tuple(shape)}")
    return base


class FrozenLoRA:
    """A saved Weight-LoRA applied as a frozen hook: out = W x + scaling * B (A x)."""

    kind = "weight-lora"

    def __init__(self, module_name: str, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, layer: int):
        if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[0] != lora_B.shape[1]:
            raise ValueError(
                f"lora: expected A (r, d_in) and B (d_out, r), got {tuple(lora_A.shape)} and {tuple(lora_B.shape)}"
            )
        self.module_name, self.scaling, self.layer = module_name, float(scaling), int(layer)
        self.lora_A, self.lora_B = lora_A.detach(), lora_B.detach()  # (r, d_in), (d_out, r)

    @classmethod
    def load(cls, path: str | Path) -> "FrozenLoRA":
        tensors, m = read_lora_file(path, cls.kind, ("lora_A", "lora_B"))
        return cls(m["module"], tensors["lora_A"], tensors["lora_B"], m["scaling"], m["layer"])

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        base = hooked_linear(model, self.module_name, (self.lora_B.shape[0], self.lora_A.shape[1]), "lora")
        dev = base.weight.device
        A, B = self.lora_A.to(dev), self.lora_B.to(dev)

        def hook(_module, args, out):
            x = args[0].to(A.dtype)  # (..., d_in)
            return out + ((x @ A.T) @ B.T * self.scaling).to(out.dtype)  # (..., d_out)

        handle = base.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()
