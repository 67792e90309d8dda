"""Training configuration: typed dataclasses, loadable from YAML with errors that name the field.

    RunConfig                  what one training run is (a file in configs/train/)
      backbone, adapter, layer, rank, atlas
      residual: ResidualOptions    options of the residual variants (scale, alpha, top_n)
      lora: LoRAOptions            options of the weight adapters (alpha, target, method: Weight-LoRA or a
                                   published baseline, each with its options block; docs/BASELINES.md)
      options                      the options of a method that keeps its own block (a plugin's)
      train: TrainConfig           optimisation, data handling, checkpoints
        objective: ObjectiveConfig   ce | replay | output-kl | stm | talr (or a registered one) and their weights

What `adapter` (and for weight adapters `lora.method`) may name, and `train.objective.kind`, is
what atlas_core.methods has registered; each method module declares its own options dataclass
(the built-in ones keep the blocks above, so their files and run keys are unchanged).

`load_run_config("configs/train/atlas.yaml")` parses and validates a file; a typo or a
wrong type is an error such as `train.lr: expected a number, got 'fast'`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import methods
from ..io import config_hash
from ..methods import WEIGHT_ADAPTER, NoOptions
from ..methods.residual import ResidualOptions, residual_config
from ..residual import ResidualConfig
from ..typed_config import ConfigError, build, load_yaml
from .baselines.clora import CLoRAOptions
from .baselines.lora_null import LoRANullOptions
from .baselines.olora import OLoRAOptions
from .baselines.oplora import OPLoRAOptions

__all__ = [
    "BAD_EXAMPLE_POLICIES",
    "SCHEDULES",
    "CLoRAOptions",
    "ConfigError",
    "LoRANullOptions",
    "LoRAOptions",
    "OLoRAOptions",
    "OPLoRAOptions",
    "ObjectiveConfig",
    "ResidualOptions",
    "RunConfig",
    "TrainConfig",
    "config_hash",
    "load_run_config",
]

DEFAULT_ADAPTER = "atlas"
SCHEDULES = ("constant", "cosine", "linear")
BAD_EXAMPLE_POLICIES = ("raise", "skip", "truncate")


def _help(text: str, default):
    return field(default=default, metadata={"help": text})


def _factory(text: str, factory):
    return field(default_factory=factory, metadata={"help": text})


@dataclass
class ObjectiveConfig:
    kind: str = _help(
        "A registered objective (atlas_core.methods): ce = target cross-entropy only; replay = + LM loss on "
        "retained examples; output-kl = + beta * KL(f0 || f) on retained contexts; stm = CE without the response "
        "tokens whose f0 perplexity exceeds stm_tau; talr = CE reweighted token-wise by the current model's NLL.",
        "ce",
    )
    ratio: float = _help("Retained examples drawn per target example in each micro-batch (Replay and Output-KL).", 0.5)
    replay_weight: float = _help("Weight of the retained LM loss (Replay).", 1.0)
    beta: float = _help("Weight of KL(f0 || f) on retained contexts (Output-KL; the spec runs 0.3 and 1.0).", 0.3)
    teacher_cache_mib: float = _help(
        "Cache f0's log-probabilities on the retained set once if they fit in this many MiB; "
        "otherwise recompute them each step without gradients.",
        512.0,
    )
    stm_tau: float = _help("STM: drop every response token whose f0 perplexity exceeds this (NLL > ln stm_tau).", 2.5)

    def __post_init__(self) -> None:
        _choice("kind", self.kind, methods.objective_kinds())
        for name in ("ratio", "replay_weight", "beta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: expected a positive number, got {getattr(self, name)!r}")
        if self.teacher_cache_mib < 0:
            raise ConfigError(f"teacher_cache_mib: expected >= 0, got {self.teacher_cache_mib!r}")
        if not self.stm_tau > 1:
            raise ConfigError(f"stm_tau: expected a perplexity > 1, got {self.stm_tau!r}")

    @property
    def uses_retained(self) -> bool:
        """Whether the objective needs retained data (TrainData.retained)."""
        return methods.objective(self.kind).uses_retained

    def to_dict(self) -> dict:
        """A field only one objective reads (its `own_fields`, e.g. STM's stm_tau) is left out of the
        others' dicts: fields added for one objective leave the other objectives' run hashes as they were."""
        d = asdict(self)
        for kind in methods.objective_kinds():
            if kind != self.kind:
                for name in methods.objective(kind).own_fields:
                    d.pop(name, None)
        return d


@dataclass
class TrainConfig:
    lr: float = _help("Peak AdamW learning rate (spec: 2e-4 for Qwen, else chosen by validation loss).", 2e-4)
    epochs: int = _help("Passes over the training set.", 5)
    batch_size: int = _help("Target examples per micro-batch.", 8)
    grad_accum: int = _help("Micro-batches per optimizer step (the loss is averaged over all their tokens).", 1)
    seed: int = _help(
        "Seed of the adapter initialisation and of the data order (a pure function of seed and epoch).", 0
    )
    weight_decay: float = _help("AdamW weight decay.", 0.0)
    betas: tuple[float, float] = _help("AdamW betas.", (0.9, 0.999))
    eps: float = _help("AdamW epsilon.", 1e-8)
    grad_clip: float | None = _help("Clip the global gradient norm to this value (null: no clipping).", 1.0)
    schedule: str = _help(f"Learning-rate schedule after warmup, one of {SCHEDULES}.", "constant")
    warmup_steps: int = _help("Linear warmup steps from 0 to lr.", 0)
    max_length: int = _help("Longest example (prompt + response tokens) accepted.", 1024)
    on_bad_example: str = _help(
        f"One of {BAD_EXAMPLE_POLICIES}: what to do with an example whose response is empty or "
        "which is longer than max_length. 'raise' lists them all and stops; 'skip' drops them; "
        "'truncate' cuts over-long ones to max_length (empty ones are skipped). "
        "Dropped or cut examples are listed in the summary.",
        "raise",
    )
    bucket_batches: int = _help(
        "Shuffle, then sort by length within windows of this many batches: less padding, still random. 1: no sorting.",
        8,
    )
    prefix_cache: bool = _help(
        "Cache the frozen lower layers' output once and run only the upper layers each step.", True
    )
    checkpoint_every_steps: int = _help("Also checkpoint every this many optimizer steps (0: only at epoch ends).", 0)
    validate_every_checkpoint: bool = _help(
        "Compute the validation loss at every checkpoint (else only at epoch ends).", True
    )
    cache_batch_size: int = _help(
        "Examples per forward pass when filling the prefix cache and computing validation loss.", 16
    )
    progress: bool = _help("Show a progress bar.", True)
    objective: ObjectiveConfig = _factory("Training objective (target CE, Replay, Output-KL).", ObjectiveConfig)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"lr: expected a positive number, got {self.lr!r}")
        for name in ("epochs", "batch_size", "grad_accum", "max_length", "bucket_batches", "cache_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "checkpoint_every_steps", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay: expected a number >= 0, got {self.weight_decay!r}")
        if not self.eps > 0:
            raise ConfigError(f"eps: expected a positive number, got {self.eps!r}")
        if len(self.betas) != 2:
            raise ConfigError(f"betas: expected two numbers in [0, 1), got {self.betas!r}")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ConfigError(f"betas[{i}]: expected a number in [0, 1), got {beta!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"grad_clip: expected a positive number or null, got {self.grad_clip!r}")
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("on_bad_example", self.on_bad_example, BAD_EXAMPLE_POLICIES)

    def to_dict(self) -> dict:
        return asdict(self) | {"objective": self.objective.to_dict()}

    def fingerprint(self) -> dict:
        """The fields that change what a run computes (cadence and display excluded): resume checks it."""
        d = self.to_dict()
        for name in ("progress", "checkpoint_every_steps", "validate_every_checkpoint", "cache_batch_size"):
            d.pop(name)
        return d


@dataclass
class LoRAOptions:
    alpha: float = _help(
        "LoRA scaling numerator: the update is (alpha / rank) * B A x. alpha = rank gives scale 1.", 16.0
    )
    target: str = _help(
        "Name of the projection inside decoder layer l to adapt (the attention output projection).", "self_attn.o_proj"
    )
    method: str = _help(
        "A registered weight-adapter method (atlas_core.methods): weight-lora (plain LoRA), or a published "
        "weight-adapter baseline: lora-null, oplora, o-lora, corda-kpm, clora, toplora (docs/BASELINES.md), or the "
        "control centered-lora. "
        "rank is the budget rank r; lora-null v2 runs at 2r, toplora at round(2r/3).",
        WEIGHT_ADAPTER,
    )
    stats: str | None = _help(
        "Retained statistics file (atlas_core.train.retained_stats) for lora-null, corda-kpm, centered-lora "
        "and o-lora with past 'pca' or 'pca-centered'; null: the caller passes them to build_adapter.",
        None,
    )
    # The built-in baselines' options blocks (each declared by its method's module).
    lora_null: LoRANullOptions = _factory("LoRA-Null options.", LoRANullOptions)
    oplora: OPLoRAOptions = _factory("OPLoRA options.", OPLoRAOptions)
    o_lora: OLoRAOptions = _factory("O-LoRA options.", OLoRAOptions)
    clora: CLoRAOptions = _factory("CLoRA options.", CLoRAOptions)

    def __post_init__(self) -> None:
        _choice("method", self.method, methods.weight_method_names())
        if not self.alpha > 0:
            raise ConfigError(f"alpha: expected a positive number, got {self.alpha!r}")
        _nonempty(self, "target", "stats")

    @property
    def needs_stats(self) -> bool:
        """Whether the method needs the retained statistics with these options."""
        return methods.get(self.method).stats_needed(self)

    def to_dict(self) -> dict:
        """As the method puts it into run keys: plain Weight-LoRA keeps the dict it always had; a
        baseline adds its method, the stats file and its own options block."""
        return methods.get(self.method).lora_dict(self)


@dataclass
class RunConfig:
    backbone: str = _help("Backbone alias, hub id or folder (see atlas_core.backbone.load_backbone).", "smollm2-135m")
    adapter: str = _help(
        "What trains: a registered method (atlas_core.methods): a residual variant (plain, centered, "
        "centered-distance, input-filter, atlas, global-pca, random-local, shuffled-patch), weight-lora (a weight "
        "adapter on layer l's o_proj; lora.method: Weight-LoRA or a published baseline), or a plugin's.",
        DEFAULT_ADAPTER,
    )
    layer: int = _help("Decoder layer l (-1: the middle layer L // 2).", -1)
    rank: int = _help("r: rank of the residual factors or of the LoRA factors (same parameter budget 2*d*r).", 16)
    atlas: str | None = _help("Path of the atlas (.safetensors) for variants that need one.", None)
    residual: ResidualOptions = _factory("Options of the residual variants.", ResidualOptions)
    lora: LoRAOptions = _factory("Options of the weight adapters (adapter: weight-lora).", LoRAOptions)
    options: NoOptions = _factory(
        "Options of a method that keeps them in a block of its own (a plugin's): its options dataclass "
        "(atlas_core.methods.Method.options_cls); empty for the built-in methods.",
        NoOptions,
    )
    train: TrainConfig = _factory("Optimisation, data handling and checkpoints.", TrainConfig)

    def __post_init__(self) -> None:
        _choice("adapter", self.adapter, methods.adapter_names())
        _nonempty(self, "backbone", "atlas")
        if self.rank < 1:
            raise ConfigError(f"rank: expected a positive integer, got {self.rank!r}")
        if self.layer < -1:
            raise ConfigError(f"layer: expected -1 (middle) or a layer index >= 0, got {self.layer!r}")
        method = methods.method_for(self)
        if method.atlas_variant is not None and self.atlas is None:
            raise ConfigError(f"atlas: adapter {self.adapter!r} needs an atlas file, got none")
        method.check(self)
        if not method.weight_adapter and self.lora.method != WEIGHT_ADAPTER:
            raise ConfigError(f"lora.method: {self.lora.method!r} is a weight adapter; set adapter: weight-lora")
        self.options = method.parse_options(self.options)

    @classmethod
    def field_types(cls, data: dict) -> dict:
        """typed_config: `options` is the options dataclass of the method the document names."""
        lora = data.get("lora")
        adapter = data.get("adapter", DEFAULT_ADAPTER)
        lora_method = lora.get("method", WEIGHT_ADAPTER) if isinstance(lora, dict) else WEIGHT_ADAPTER
        if not isinstance(adapter, str) or not isinstance(lora_method, str):
            return {}  # the field's own check names it
        _choice("adapter", adapter, methods.adapter_names())  # before the options it decides
        name = methods.method_name(adapter, lora_method)
        method = methods.get(name) if name in methods.names() else None
        if method is None or method.options_at != "options" or method.options_cls is None:
            return {}
        return {"options": method.options_cls}

    @property
    def method(self) -> str:
        """The name of the method that trains (atlas_core.methods): `adapter`, or `lora.method` for weight-lora."""
        return methods.method_name(self.adapter, self.lora.method)

    def residual_config(self) -> ResidualConfig:
        return residual_config(self)

    def to_dict(self) -> dict:
        d = asdict(self) | {"lora": self.lora.to_dict(), "train": self.train.to_dict()}
        if not d["options"]:  # the built-in methods' dicts (and run keys) stay as they were
            d.pop("options")
        return d


# ------------------------------------------------------------------------------ loading
def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: expected one of {tuple(allowed)}, got {value!r}")


def _nonempty(obj, *names: str) -> None:
    """Each named string field (a name or a path) is not empty, where it is set."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")


def load_run_config(path: str | Path) -> RunConfig:
    """Parse and validate a run config YAML file (see configs/train/)."""
    data = load_yaml(path)
    try:
        return build(RunConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
