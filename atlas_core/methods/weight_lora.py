"""The weight-adapter methods: a LoRA on one Linear inside decoder layer l (its attention output
projection by default), Weight-LoRA itself and the published weight baselines
(atlas_core/train/baselines/), each a `WeightMethod` registered by its own module.

A run config selects one by `adapter: weight-lora` and `lora.method: <name>`; the `lora:` block
holds what they share (alpha, target, stats) and a baseline's own options block
(`lora.<options_block>`). The trainable delta is a WeightLoRA subclass installed into the model
in place; its file (kind "weight-lora") holds the update to the ORIGINAL weight as LoRA factors,
applied frozen by atlas_core.lora_delta.FrozenLoRA and exported as one PEFT LoRA or merged weights.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..io import IntegrityError
from ..lora_delta import FrozenLoRA
from ..train.lora import WeightLoRA
from ..train.retained_stats import RetainedStats
from . import WEIGHT_ADAPTER, DeltaFormat, Method, register


class LoRADelta(DeltaFormat):
    """A saved LoRA update of one Linear: FrozenLoRA."""

    kind = "weight-lora"
    peft_method = "lora"

    def load(self, path: Path, manifest: dict, atlas_for):
        return FrozenLoRA.load(path)

    def loras(self, delta, where: str) -> list:
        return [delta]


LORA_DELTA = LoRADelta()


class WeightMethod(Method):
    """A weight adapter: `adapter_class(model, layer, rank, alpha, target, seed, **adapter_kwargs(...))`."""

    weight_adapter = True
    options_at = "lora"
    delta = LORA_DELTA
    adapter_class: type  # a WeightLoRA subclass (atlas_core.train.lora)
    options_block: str | None = None  # the `lora:` sub-block of its own options (its options_cls)
    uses_stats = False  # needs the retained statistics (see `stats_needed`)

    def __init__(self) -> None:
        if self.options_block is not None:
            self.options_at = f"lora.{self.options_block}"

    def stats_needed(self, lora) -> bool:
        """Whether it needs the retained statistics with these `lora:` options."""
        return self.uses_stats

    def needs_stats(self, run_config) -> bool:
        return self.stats_needed(run_config.lora)

    def adapter_kwargs(self, run_config, stats) -> dict:
        """Its own constructor arguments (from its options block; `stats` where it needs them)."""
        return {}

    def lora_dict(self, lora) -> dict:
        """The `lora:` block as it enters a run's content key: the shared fields, the method, the
        stats file and its own options block."""
        d = {"alpha": lora.alpha, "target": lora.target, "method": lora.method, "stats": lora.stats}
        if self.options_block is not None:
            d[self.options_block] = asdict(getattr(lora, self.options_block))
        return d

    def build(self, run_config, model, atlas=None, stats=None):
        """Installed into `model` in place (`remove()` takes it out). Methods that need the retained
        statistics take `stats`, or load the file `lora.stats` names."""
        o = run_config.lora
        if self.needs_stats(run_config) and stats is None:
            if o.stats is None:
                raise ValueError(
                    f"lora.method: {o.method!r} needs the retained statistics: pass stats= "
                    "(atlas_core.train.retained_stats) or set lora.stats to a stats file"
                )
            try:
                stats = RetainedStats.load(o.stats)
            except IntegrityError as e:
                raise ValueError(f"lora.stats: {e}") from e
        rc = run_config
        common = dict(model=model, layer=rc.layer, rank=rc.rank, alpha=o.alpha, target=o.target, seed=rc.train.seed)
        return self.adapter_class(**common, **self.adapter_kwargs(run_config, stats))


class WeightLoRAMethod(WeightMethod):
    name = WEIGHT_ADAPTER
    summary = "PEFT LoRA on layer l's o_proj: (alpha / r) B A x"
    adapter_class = WeightLoRA

    def lora_dict(self, lora) -> dict:
        return {"alpha": lora.alpha, "target": lora.target}  # the dict (and run keys) it had before the baselines


register(WeightLoRAMethod())
