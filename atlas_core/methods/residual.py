"""The residual methods: one shared residual Delta(h) added to decoder layer l's output, in each
of its structural variants (spec section 3; atlas_core.residual):

    plain  centered  centered-distance  input-filter  atlas  global-pca  random-local  shuffled-patch

A run config selects one by `adapter: <variant>`; their options are the `residual:` block
(ResidualOptions). The trainable delta is the AtlasResidual itself (the trainer wraps it in
atlas_core.train.adapters.ResidualAdapter); its file (kind "adapter", save_adapter) names the
atlas it routes with by sha256, and exports as the ATLAS PEFT method (atlas_core.residual.peft).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import InputError
from ..residual import RESIDUAL_VARIANTS, ResidualConfig, attach, build_residual, load_adapter
from ..typed_config import ConfigError, field
from . import DeltaFormat, Method, register


@dataclass
class ResidualOptions:
    scale: float | str = field("s in rho = ||z|| / (||z|| + s): a number or 'calibrated'.", 64.0)
    alpha: float = field("Filter strength in [0, 1].", 1.0)
    top_n: int = field("Charts each token is routed to.", 4)

    def __post_init__(self) -> None:  # the same rules as ResidualConfig, checked whatever the adapter
        if self.scale != "calibrated" if isinstance(self.scale, str) else not self.scale > 0:
            raise ConfigError(f"scale: expected a positive number or 'calibrated', got {self.scale!r}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"alpha: expected a value in [0, 1], got {self.alpha!r}")
        if self.top_n < 1:
            raise ConfigError(f"top_n: expected a positive integer, got {self.top_n!r}")


def residual_config(run_config) -> ResidualConfig:
    """The ResidualConfig of a run config whose adapter is a residual variant."""
    if run_config.adapter not in RESIDUAL_VARIANTS:
        raise ConfigError(f"adapter: {run_config.adapter!r} has no residual config")
    try:
        return ResidualConfig(
            variant=run_config.adapter,
            layer=run_config.layer,
            rank=run_config.rank,
            seed=run_config.train.seed,
            **asdict(run_config.residual),
        )
    except ValueError as e:
        raise ConfigError(f"residual.{e}") from e


class ResidualDelta(DeltaFormat):
    """A saved residual (atlas_core.residual.save_adapter): an AtlasResidual attached at its layer's output."""

    kind = "adapter"
    peft_method = "atlas"

    def load(self, path: Path, manifest: dict, atlas_for):
        atlas_sha = manifest.get("atlas_sha256")
        return load_adapter(path, atlas_for(atlas_sha) if atlas_sha else None)

    def layer(self, delta) -> int:
        return delta.config.layer

    def attached(self, model, delta):
        return attach(model, delta)

    def loras(self, delta, where: str) -> list:
        raise InputError(
            f"{where} is an ATLAS residual: it is input-conditioned (routed by h), "
            "so it is no LoRA and folds into no weight; export it with --format peft (the ATLAS "
            "PEFT method) or --format folder"
        )


RESIDUAL_DELTA = ResidualDelta()


class ResidualMethod(Method):
    options_cls = ResidualOptions
    options_at = "residual"
    delta = RESIDUAL_DELTA

    def __init__(self, variant: str, summary: str):
        self.name, self.summary, self.atlas_variant = variant, summary, RESIDUAL_VARIANTS[variant]

    def check(self, run_config) -> None:
        residual_config(run_config)  # validates the residual options now, not at build time

    def build(self, run_config, model, atlas=None, stats=None):
        return build_residual(residual_config(run_config), model, atlas)


for _variant, _summary in (
    ("plain", "Delta(h) = B A h (no atlas)"),
    ("centered", "B A (h - mu(h))"),
    ("centered-distance", "rho_d(h) B A (h - mu(h))"),
    ("input-filter", "B A P(h)(h - mu(h))"),
    ("atlas", "full ATLAS: rho(h) P(h) B A P(h)(h - mu(h))"),
    ("global-pca", "the full form with one global PCA chart (K = 1)"),
    ("random-local", "the full form with random orthonormal local bases"),
    ("shuffled-patch", "the full form with local bases permuted between charts"),
):
    register(ResidualMethod(_variant, _summary))
