"""Training configuration: typed dataclasses, loadable from YAML with errors that name the field.

    RunConfig                  what one training run is (a file in configs/train/)
      backbone, adapter, layer, rank, atlas
      residual: ResidualOptions    options of the residual variants (scale, alpha, top_n)
      lora: LoRAOptions            options of the weight adapters (alpha, target, method: Weight-LoRA or a
                                   published baseline, each with its options block; docs/BASELINES.md)
      train: TrainConfig           optimisation, data handling, checkpoints
        objective: ObjectiveConfig   ce | replay | output-kl | stm | talr and their weights

`load_run_config("configs/train/atlas.yaml")` parses and validates a file; a typo or a
wrong type is an error such as `train.lr: expected a number, got 'fast'`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..residual import RESIDUAL_VARIANTS, ResidualConfig
from ..typed_config import ConfigError, build, load_yaml

ADAPTERS = tuple(RESIDUAL_VARIANTS) + ("weight-lora",)
OBJECTIVES = ("ce", "replay", "output-kl", "stm", "talr")
WEIGHT_METHODS = ("weight-lora", "lora-null", "oplora", "o-lora", "corda-kpm", "clora", "toplora")
NEEDS_STATS = ("lora-null", "corda-kpm")  # and o-lora with past: pca
SCHEDULES = ("constant", "cosine", "linear")
BAD_EXAMPLE_POLICIES = ("raise", "skip", "truncate")


def _help(text: str, default):
    return field(default=default, metadata={"help": text})


def _factory(text: str, factory):
    return field(default_factory=factory, metadata={"help": text})


@dataclass
class ObjectiveConfig:
    kind: str = _help(
        f"One of {OBJECTIVES}: target cross-entropy only; + LM loss on retained examples (Replay); "
        "+ beta * KL(f0 || f) on retained contexts (Output-KL); CE without the response tokens whose "
        "f0 perplexity exceeds stm_tau (STM); CE reweighted token-wise by the current model's NLL (TALR).",
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
        _choice("kind", self.kind, OBJECTIVES)
        for name in ("ratio", "replay_weight", "beta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: expected a positive number, got {getattr(self, name)!r}")
        if self.teacher_cache_mib < 0:
            raise ConfigError(f"teacher_cache_mib: expected >= 0, got {self.teacher_cache_mib!r}")
        if not self.stm_tau > 1:
            raise ConfigError(f"stm_tau: expected a perplexity > 1, got {self.stm_tau!r}")

    @property
    def uses_retained(self) -> bool:
        return self.kind in ("replay", "output-kl")

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.kind != "stm":  # a field added for STM leaves the other objectives' run hashes as they were
            d.pop("stm_tau")
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
class ResidualOptions:
    scale: float | str = _help("s in rho = ||z|| / (||z|| + s): a number or 'calibrated'.", 64.0)
    alpha: float = _help("Filter strength in [0, 1].", 1.0)
    top_n: int = _help("Charts each token is routed to.", 4)

    def __post_init__(self) -> None:  # the same rules as ResidualConfig, checked whatever the adapter
        if self.scale != "calibrated" if isinstance(self.scale, str) else not self.scale > 0:
            raise ConfigError(f"scale: expected a positive number or 'calibrated', got {self.scale!r}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"alpha: expected a value in [0, 1], got {self.alpha!r}")
        if self.top_n < 1:
            raise ConfigError(f"top_n: expected a positive integer, got {self.top_n!r}")


@dataclass
class LoRANullOptions:
    mode: str = _help(
        "v1: train A and B; v2: freeze A (its null-space init) and train B only, at rank 2r to match the budget.", "v1"
    )

    def __post_init__(self) -> None:
        _choice("mode", self.mode, ("v1", "v2"))


@dataclass
class OPLoRAOptions:
    k: int = _help("Top-k singular triples of W kept exactly (the paper runs 16 and 128).", 16)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"k: expected a positive integer, got {self.k!r}")


@dataclass
class OLoRAOptions:
    lambda1: float = _help("Weight of sum |A_past A^T| (the paper: 0.5).", 0.5)
    past: str = _help(
        "The frozen past subspace: 'pca' = top-r eigenvectors of the retained input covariance "
        "(choice, one update); 'files' = the lora_A of earlier adapters (past_files).",
        "pca",
    )
    past_files: list[str] = _factory("Weight-adapter files whose lora_A rows form A_past (past: files).", list)

    def __post_init__(self) -> None:
        _choice("past", self.past, ("pca", "files"))
        if self.lambda1 < 0:
            raise ConfigError(f"lambda1: expected >= 0, got {self.lambda1!r}")
        if self.past == "files" and not self.past_files:
            raise ConfigError("past_files: past 'files' needs at least one adapter file")
        for i, path in enumerate(self.past_files):
            if not path.strip():
                raise ConfigError(f"past_files[{i}]: expected the path of a weight-adapter file, got {path!r}")


@dataclass
class CLoRAOptions:
    lam: float = _help("Weight lambda of R = 1/2 ||A P_A||^2 + 1/2 ||B^T P_B||^2 (the paper: 1).", 1.0)
    k: int | None = _help(
        "Columns of the random orthonormal P_A, P_B (null: min(512, d // 2), d = min(d_in, d_out)).", None
    )

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ConfigError(f"lam: expected a number >= 0, got {self.lam!r}")
        if self.k is not None and self.k < 1:
            raise ConfigError(f"k: expected a positive integer or null, got {self.k!r}")


@dataclass
class LoRAOptions:
    alpha: float = _help(
        "LoRA scaling numerator: the update is (alpha / rank) * B A x. alpha = rank gives scale 1.", 16.0
    )
    target: str = _help(
        "Name of the projection inside decoder layer l to adapt (the attention output projection).", "self_attn.o_proj"
    )
    method: str = _help(
        f"One of {WEIGHT_METHODS}: plain LoRA, or a published weight-adapter baseline "
        "(docs/BASELINES.md). rank is the budget rank r; lora-null v2 runs at 2r, toplora at round(2r/3).",
        "weight-lora",
    )
    stats: str | None = _help(
        "Retained statistics file (atlas_core.train.retained_stats) for lora-null, corda-kpm and "
        "o-lora with past 'pca'; null: the caller passes them to build_adapter.",
        None,
    )
    lora_null: LoRANullOptions = _factory("LoRA-Null options.", LoRANullOptions)
    oplora: OPLoRAOptions = _factory("OPLoRA options.", OPLoRAOptions)
    o_lora: OLoRAOptions = _factory("O-LoRA options.", OLoRAOptions)
    clora: CLoRAOptions = _factory("CLoRA options.", CLoRAOptions)

    def __post_init__(self) -> None:
        _choice("method", self.method, WEIGHT_METHODS)
        if not self.alpha > 0:
            raise ConfigError(f"alpha: expected a positive number, got {self.alpha!r}")
        _nonempty(self, "target", "stats")

    @property
    def needs_stats(self) -> bool:
        return self.method in NEEDS_STATS or (self.method == "o-lora" and self.o_lora.past == "pca")

    def to_dict(self) -> dict:
        """Plain Weight-LoRA keeps the dict (and run keys) it always had; a baseline adds its method,
        the stats file and its own options block."""
        d = {"alpha": self.alpha, "target": self.target}
        if self.method == "weight-lora":
            return d
        block = {"lora-null": "lora_null", "oplora": "oplora", "o-lora": "o_lora", "clora": "clora"}.get(self.method)
        return (
            d | {"method": self.method, "stats": self.stats} | ({block: asdict(getattr(self, block))} if block else {})
        )


@dataclass
class RunConfig:
    backbone: str = _help("Backbone alias, hub id or folder (see atlas_core.backbone.load_backbone).", "smollm2-135m")
    adapter: str = _help(
        f"What trains, one of {ADAPTERS}: a residual variant, or a weight adapter on layer l's o_proj "
        "(lora.method: Weight-LoRA or a published baseline).",
        "atlas",
    )
    layer: int = _help("Decoder layer l (-1: the middle layer L // 2).", -1)
    rank: int = _help("r: rank of the residual factors or of the LoRA factors (same parameter budget 2*d*r).", 16)
    atlas: str | None = _help("Path of the atlas (.safetensors) for variants that need one.", None)
    residual: ResidualOptions = _factory("Options of the residual variants.", ResidualOptions)
    lora: LoRAOptions = _factory("Options of the weight adapters (adapter: weight-lora).", LoRAOptions)
    train: TrainConfig = _factory("Optimisation, data handling and checkpoints.", TrainConfig)

    def __post_init__(self) -> None:
        _choice("adapter", self.adapter, ADAPTERS)
        _nonempty(self, "backbone", "atlas")
        if self.rank < 1:
            raise ConfigError(f"rank: expected a positive integer, got {self.rank!r}")
        if self.layer < -1:
            raise ConfigError(f"layer: expected -1 (middle) or a layer index >= 0, got {self.layer!r}")
        if self.adapter != "weight-lora" and RESIDUAL_VARIANTS[self.adapter] is not None and self.atlas is None:
            raise ConfigError(f"atlas: adapter {self.adapter!r} needs an atlas file, got none")
        if self.adapter != "weight-lora":
            self.residual_config()  # validates the residual options now, not at build time
            if self.lora.method != "weight-lora":
                raise ConfigError(f"lora.method: {self.lora.method!r} is a weight adapter; set adapter: weight-lora")

    def residual_config(self) -> ResidualConfig:
        if self.adapter == "weight-lora":
            raise ConfigError("adapter: 'weight-lora' has no residual config")
        try:
            return ResidualConfig(
                variant=self.adapter, layer=self.layer, rank=self.rank, seed=self.train.seed, **asdict(self.residual)
            )
        except ValueError as e:
            raise ConfigError(f"residual.{e}") from e

    def to_dict(self) -> dict:
        return asdict(self) | {"lora": self.lora.to_dict(), "train": self.train.to_dict()}


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


def config_hash(*parts) -> str:
    """sha256 of the canonical JSON of `parts` (dicts, lists, strings)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
