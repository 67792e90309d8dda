"""A version chain: the frozen deltas of a release line applied in order to one backbone.

A version is its parent plus one delta (spec CONTINUAL.md), so the model a version stands
for is the backbone with every delta of its chain applied, oldest first:

    f_t = f_0 + D_1 + D_2 + ... + D_t      (each D_i trained with D_1..D_{i-1} attached, frozen)

Deltas are adapter files (safetensors + manifest with sha256, atlas_core.io), loaded and
verified here by the delta format their manifest's "kind" names (atlas_core.methods): among the
built-in ones
- a residual at a decoder layer's output (any ATLAS variant, kind "adapter"): attached by a
  forward hook; residuals at the same layer apply in chain order (atlas_core.residual.Attachment);
- a Weight-LoRA or weight baseline (kind "weight-lora"): a rank-r update of one Linear inside a
  layer, applied by a frozen hook (atlas_core.lora_delta.FrozenLoRA);
- TopLoRA's frozen form (kind "toplora"), and a PEFT LoRA adapter trained elsewhere (kind
  "peft-lora", atlas_core.peft_lora.LoraSet: one FrozenLoRA per adapted Linear).

Nothing is copied: `with chain.attached(model): ...` installs every delta and removes them
all on exit, leaving the backbone bit-identical.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Union

from torch import nn

from . import methods
from .atlas import Atlas
from .errors import InputError
from .io import IntegrityError
from .lora_delta import FrozenLoRA, hooked_linear, read_lora_file
from .residual import AtlasResidual

__all__ = ["Chain", "Delta", "FrozenLoRA", "delta_layer", "hooked_linear", "load_delta", "read_lora_file"]

Delta = Union[AtlasResidual, FrozenLoRA]  # and any registered format's frozen delta


def load_delta(path: str | Path, atlas_for: Callable[[str], Atlas | None]) -> Delta:
    """One adapter file of a chain; `atlas_for(sha256)` supplies the atlas a residual was trained with."""
    manifest_file = Path(path).with_suffix(".json")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{manifest_file}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict):
        raise IntegrityError(f"{manifest_file}: expected a JSON object")
    try:
        fmt = methods.delta_format(manifest.get("kind"), str(manifest_file))
    except InputError as e:
        raise IntegrityError(str(e)) from e
    return fmt.load(Path(path), manifest, atlas_for)


def delta_layer(delta: Delta) -> int:
    return methods.format_of(delta).layer(delta)


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
                stack.enter_context(methods.format_of(delta).attached(model, delta))
            yield
