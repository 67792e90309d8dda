"""A version chain: the frozen deltas of a release line applied in order to one backbone.

A version is its parent plus one delta (spec CONTINUAL.md), so the model a version stands
for is the backbone with every delta of its chain applied, oldest first:

    f_t = f_0 + D_1 + D_2 + ... + D_t      (each D_i trained with D_1..D_{i-1} attached, frozen)

Deltas are adapter files (safetensors + manifest with sha256, atlas_core.io), loaded and
verified here. The kinds (besides TopLoRA's frozen form, and `atlas_core.peft_lora.LoraSet`,
a PEFT LoRA adapter trained elsewhere: one FrozenLoRA per adapted Linear):
- a residual at a decoder layer's output (any ATLAS variant): attached by a forward hook;
  residuals at the same layer apply in chain order (atlas_core.residual.Attachment);
- a Weight-LoRA (rank-r update of one Linear inside a layer): a frozen forward hook on that
  Linear adds  scaling * B A x,  the same arithmetic as PEFT's LoRA layer (x cast to the
  factors' dtype, the sum cast back). A hook rather than PEFT injection, because PEFT keeps
  one adapter named 'default' per module and a chain may hold several LoRAs on one module
  (and a new one may be trained there on top).

Nothing is copied: `with chain.attached(model): ...` installs every delta and removes them
all on exit, leaving the backbone bit-identical.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Union

import torch
from torch import nn

from .atlas import Atlas
from .errors import InputError
from .io import IntegrityError, expect_shape, load_verified
from .residual import AtlasResidual, attach, load_adapter


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
        tensors, m = read_lora_file(path, "weight-lora", ("lora_A", "lora_B"))
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


Delta = Union[AtlasResidual, FrozenLoRA]


def load_delta(path: str | Path, atlas_for: Callable[[str], Atlas | None]) -> Delta:
    """One adapter file of a chain; `atlas_for(sha256)` supplies the atlas a residual was trained with."""
    manifest_file = Path(path).with_suffix(".json")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{manifest_file}: unreadable manifest ({e})") from e
    if manifest.get("kind") == "weight-lora":
        return FrozenLoRA.load(path)
    if manifest.get("kind") == "toplora":  # not mergeable: applied by its own frozen form
        from .train.baselines.toplora import FrozenTopLoRA

        return FrozenTopLoRA.load(path)
    if manifest.get("kind") == "peft-lora":  # a PEFT LoRA adapter trained elsewhere (atlas_core.peft_lora)
        from .peft_lora import LoraSet

        return LoraSet.load(path)
    atlas_sha = manifest.get("atlas_sha256")
    return load_adapter(path, atlas_for(atlas_sha) if atlas_sha else None)


def delta_layer(delta: Delta) -> int:
    return delta.config.layer if isinstance(delta, AtlasResidual) else delta.layer


@dataclass
class Chain:
    """The deltas of a version, oldest first (empty: the base model)."""

    deltas: list

    def __len__(self) -> int:
        return len(self.deltas)

    @property
    def lowest_layer(self) -> int | None:
        """The lowest decoder layer any delta changes (None: no delta); caches must end below it."""
        return min((delta_layer(d) for d in self.deltas), default=None)

    def then(self, delta: Delta) -> "Chain":
        return Chain([*self.deltas, delta])

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        """The backbone behaving as this version (training, generation, KL); restored on exit."""
        with ExitStack() as stack:
            for delta in self.deltas:
                if isinstance(delta, AtlasResidual):
                    stack.enter_context(attach(model, delta))
                else:
                    stack.enter_context(delta.attached(model))
            yield
