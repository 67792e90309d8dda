"""What a training method and a frozen-delta format are: the two kinds of plugin of atlas_core.methods.

A `Method` is what trains (a run config's `adapter`): its options, how it builds its trainable
delta on a model, which atlas it routes with, and the `DeltaFormat` its saved deltas have. A
`DeltaFormat` is how a frozen delta of one file kind (its manifest's "kind") loads, applies in a
chain and exports. The loss a run minimises is an `Objective` (atlas_core.train.objectives),
named by the run config's `train.objective.kind`; a method adds its own term to it through its
trainable delta's `penalty()`.

This module imports nothing of the methods, the trainer or the chain: every one of them may
import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError
from ..typed_config import ConfigError


@dataclasses.dataclass
class NoOptions:
    """The `options:` block of a run config whose method keeps its options elsewhere (or has none)."""


class DeltaFormat:
    """How a frozen delta of one kind lives on after training (atlas_core.chain, atlas_core.export).

    A frozen delta (what `load` returns) has `kind` (this format's), and, unless the format
    overrides `layer` / `attached`, `layer` (the lowest decoder layer it changes) and
    `attached(model)` (a context manager that applies it and takes it off again).
    """

    kind: str = ""
    peft_method: str | None = None  # the PEFT adapter it exports as: "lora", "atlas"; None: --format folder only

    def load(self, path: Path, manifest: dict, atlas_for: Callable[[str], object]):
        """The frozen delta saved at `path` (its manifest already read: `manifest`), verified;
        `atlas_for(sha256)` supplies the atlas a delta routes with."""
        raise NotImplementedError

    def layer(self, delta) -> int:
        return delta.layer

    def attached(self, model, delta):
        return delta.attached(model)

    def loras(self, delta, where: str) -> list:
        """The plain LoRAs (atlas_core.lora_delta.FrozenLoRA) the delta is made of, for a PEFT LoRA or
        merged-weights export; `where` names the delta in the message of a delta that is none."""
        raise InputError(
            f"{where} is a {self.kind} delta, which is no plain LoRA (e.g. TopLoRA's token-wise gate) "
            "and folds into no weight; export it with --format folder"
        )


class Method:
    """One training method, registered under `name` (atlas_core.methods.register).

    A run config selects it by `adapter: <name>`; the weight adapters on layer l's Linear
    (`weight_adapter`) by `adapter: weight-lora` and `lora.method: <name>` (the built-in baselines'
    YAML). Its options are the dataclass `options_cls` (typed_config: validated, each field with its
    help text) found at `options_at` in the run config: "options" (a plugin's own block), or the
    block a built-in method has always used ("residual", "lora", "lora.clora", ...).
    """

    name: str = ""
    summary: str = ""  # one line: what trains
    options_cls: type | None = None
    options_at: str = "options"
    atlas_variant: str | None = None  # the atlas variant it routes with (flows fit it first); None: no atlas
    weight_adapter: bool = False
    delta: DeltaFormat  # the format of the deltas it saves

    def options(self, run_config):
        """Its options object in `run_config`."""
        node = run_config
        for part in self.options_at.split("."):
            node = getattr(node, part)
        return node

    def parse_options(self, value) -> object:
        """The run config's `options:` block as this method's options (a `NoOptions` left by the
        YAML loader or a constructor becomes the defaults); refused when it keeps them elsewhere."""
        if self.options_at != "options" or self.options_cls is None:
            if dataclasses.asdict(value):
                where = f" (its options are under {self.options_at}:)" if self.options_at != "options" else ""
                raise ConfigError(f"options: method {self.name!r} takes no options here{where}")
            return value
        if isinstance(value, self.options_cls):
            return value
        if isinstance(value, NoOptions):
            return self.options_cls()
        raise ConfigError(f"options: expected {self.options_cls.__name__} for method {self.name!r}, got {value!r}")

    def check(self, run_config) -> None:
        """Refuse a run config this method cannot train, naming the field (ConfigError)."""

    def needs_stats(self, run_config) -> bool:
        """Whether `build` needs the retained statistics (atlas_core.train.retained_stats)."""
        return False

    def build(self, run_config, model, atlas=None, stats=None):
        """A fresh trainable delta for `model` (the trainer's adapter interface, atlas_core.train.adapters):
        `atlas` for a method that routes with one, `stats` for one that needs the retained statistics."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<method {self.name!r}: {self.summary}>"
