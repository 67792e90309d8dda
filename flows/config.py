"""What one update cycle runs on: backbone, skill data, evaluation subsets, atlas, training.

`load_update_config("configs/update/default.yaml", backbone=..., skill=...)` parses and
validates a file (see configs/update/ for commented examples); the release policy (which
candidates to train and the gate thresholds) is a separate file (flows/policy.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from atlas_core.backbone import DTYPES
from atlas_core.paths import PROJECT_ROOT
from atlas_core.typed_config import ConfigError, build, field, load_yaml
from evaluation.contexts import RETAINED_DOMAINS

SCORERS = ("mbpp-plus", "response-match")
EVALUATE = ("epoch-ends", "all", "final")
MODES = ("in-process", "work-pool")  # where candidates run (flows/candidates.py)
SKILL_SOURCES = ("mbpp", "gsm8k")  # built-in skill sources (flows/skills.py); anything else is a path
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a skill or line: a key in policies, the ledger and model names


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name}: expected a positive integer (or null where allowed), got {value!r}")


def _nonempty(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")


def _existing(name: str, path: str, folder_ok: bool = False) -> None:
    """A path field names a file (or folder) that exists, as given or relative to the project."""
    found = resolve(path)
    if not (found.is_file() or (folder_ok and found.is_dir())):
        raise ConfigError(f"{name}: no such {'file or folder' if folder_ok else 'file'}: {path!r} (looked at {found})")


@dataclass
class SkillData:
    source: str = field(
        "Where the skill's (prompt, response) pairs come from: 'mbpp' (sanitized MBPP train/validation), "
        "'gsm8k' (GSM8K train problems -> worked solutions; held out: test), a JSONL skill file "
        "(evaluation/userdata.py schema) or a folder of such snapshots (the newest is taken).",
        "mbpp",
    )
    val_source: str | None = field(
        "JSONL file of validation pairs (for a JSONL source; 'mbpp' uses its validation split).", None
    )
    train_limit: int | None = field("First N training pairs (null: all).", None)
    val_limit: int | None = field("First N validation pairs (null: all; 0 is not allowed, use null for none).", 16)
    holdout: float = field(
        "A JSONL source without val_source: the share of its pairs held out as validation pairs "
        "(the skill's evaluation, and its retained contexts once released), chosen by a hash of "
        "each pair's prompt, so a pair stays on its side in every later snapshot. 0: no split "
        "(then val_source is required).",
        0.1,
    )

    def __post_init__(self) -> None:
        _positive(self, "train_limit", "val_limit")
        if not 0 <= self.holdout < 1:  # also refuses nan
            raise ConfigError(f"holdout: expected a share in [0, 1), got {self.holdout!r}")
        if not self.source.strip():
            raise ConfigError(
                f"source: expected {' or '.join(map(repr, SKILL_SOURCES))}, a JSONL skill file or a folder "
                f"of them, got {self.source!r}"
            )
        if self.source in SKILL_SOURCES:
            if self.val_source is not None:
                raise ConfigError(f"val_source: only for a JSONL source; {self.source!r} has its own validation pairs")
            return
        _existing("source", self.source, folder_ok=True)
        if self.val_source is not None:
            _nonempty(self, "val_source")
            _existing("val_source", self.val_source)
        elif self.holdout == 0:
            raise ConfigError(
                "holdout: 0 holds no pair out of a JSONL source, so there would be no validation pairs; "
                "expected a share in (0, 1) or a val_source file"
            )


@dataclass
class TargetSpec:
    scorer: str = field(
        "Target scorer: a built-in (mbpp-plus, gsm8k-accuracy, csqa-choice, exact-match, reference-nll, "
        "response-match; see evaluation/scorers.py) or a user's 'package.module:Factory'.",
        "mbpp-plus",
    )
    options: dict[str, int | float | bool | str | None] = field(
        "The scorer's options (e.g. limit, max_new_tokens, batch_size; each scorer documents its own). Unknown "
        "options are errors, checked before any training starts.",
        factory=dict,
    )

    def __post_init__(self) -> None:
        from evaluation.scorers import check_scorer

        try:  # a built-in is built (no model, no data loaded); a user's Factory is checked for its form
            check_scorer(self.scorer, self.options)
        except ConfigError as e:
            raise ConfigError(str(e).removeprefix("target.")) from e


@dataclass
class RetainedSpec:
    domains: list[str | dict[str, int | str | None]] = field(
        "Retained domains watched by the gates: built-in 'gsm8k', 'csqa', 'mbpp' (code contexts), or a user's JSONL "
        "file as {name, file, gate_rows (first N rows gate, the rest calibrate the atlas), checker} "
        "(evaluation/domains.py). Released skills of the line are added to these automatically.",
        factory=lambda: list(RETAINED_DOMAINS),
    )
    kl_contexts: int = field(
        "Teacher-forced contexts per domain for retained KL (first N of GSM8K test / CSQA validation).", 128
    )
    kl_max_tokens: int = field("Contexts are cut to this many tokens for retained KL.", 1024)
    gsm8k_questions: int = field("GSM8K test questions answered by generation (answer churn, NFR).", 16)
    csqa_questions: int = field("CSQA validation questions answered by conditional choice (choice churn, NFR).", 64)
    max_new_tokens: int = field("Generation budget per GSM8K answer.", 192)
    batch_size: int = field("Prompts per forward batch for CSQA choice.", 8)
    generation_batch_size: int = field(
        "GSM8K questions decoded together (a finished one leaves the batch, so more "
        "cost little; in bf16 the batch changes the rounding, see evaluation/generate.py).",
        16,
    )
    replay_examples: int = field("Retained training texts (GSM8K train) for the Replay and Output-KL objectives.", 128)

    def __post_init__(self) -> None:
        from evaluation.domains import validate_domains

        try:
            validate_domains(self.domains)
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("retained.")) from e
        _positive(
            self,
            "kl_contexts",
            "kl_max_tokens",
            "gsm8k_questions",
            "csqa_questions",
            "max_new_tokens",
            "batch_size",
            "generation_batch_size",
            "replay_examples",
        )


@dataclass
class AtlasSpec:
    num_vectors: int = field("N calibration vectors (spread evenly over the retained domains).", 1024)
    per_example: int = field("Positions sampled per retained example.", 2)
    charts: int = field("K charts.", 32)
    rank: int = field("m directions per chart.", 16)
    seed: int = field("Seed of position sampling and k-means++.", 0)

    def __post_init__(self) -> None:
        _positive(self, "num_vectors", "per_example", "charts", "rank")
        if self.seed < 0:
            raise ConfigError(f"seed: expected an integer >= 0, got {self.seed!r}")


@dataclass
class TrainOverrides:
    configs_dir: str = field(
        "Folder of the per-method run configs (<method>.yaml), relative to the project.", "configs/train"
    )
    epochs: int | None = field("Override train.epochs of every method (null: keep the method's).", 2)
    lr: float | None = field("Override train.lr (null: keep).", None)
    batch_size: int | None = field("Override train.batch_size (null: keep).", None)
    max_length: int | None = field("Override train.max_length (null: keep).", 768)
    on_bad_example: str | None = field(
        "Override train.on_bad_example: raise | skip | truncate (null: keep).", "truncate"
    )
    checkpoint_every_steps: int | None = field("Override train.checkpoint_every_steps (null: keep).", None)

    def __post_init__(self) -> None:
        from atlas_core.train.config import BAD_EXAMPLE_POLICIES

        _positive(self, "epochs", "batch_size", "max_length")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr: expected a positive number, got {self.lr!r}")
        if self.on_bad_example is not None and self.on_bad_example not in BAD_EXAMPLE_POLICIES:
            raise ConfigError(
                f"on_bad_example: expected one of {BAD_EXAMPLE_POLICIES} or null, got {self.on_bad_example!r}"
            )
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 0:
            raise ConfigError(
                f"checkpoint_every_steps: expected an integer >= 0 or null, got {self.checkpoint_every_steps!r}"
            )
        if not self.configs_dir.strip() or not resolve(self.configs_dir).is_dir():
            raise ConfigError(
                f"configs_dir: expected a folder of run configs, got {self.configs_dir!r} "
                f"(looked at {resolve(self.configs_dir)})"
            )


@dataclass
class ExecutionSpec:
    candidates: str = field(
        "Where the candidates (method x seed) train and are evaluated: 'in-process' (one after another in this "
        "process) or 'work-pool' (each a flow run of `deployment` on its Prefect work pool, all at once; needs "
        "PREFECT_API_URL and a ledger and artifact store the workers share).",
        "in-process",
    )
    deployment: str = field("work-pool: the candidate deployment, as 'flow/deployment'.", "candidate/candidate")
    slots: str | None = field(
        "work-pool: a Prefect global concurrency limit each candidate holds one slot of while it runs "
        "(e.g. 'gpu', created with `prefect gcl create gpu --limit 8`); null: only the pool's own limits.",
        None,
    )
    heartbeat_timeout_s: float = field(
        "work-pool: a running candidate whose newest flow-run heartbeat is older than this is marked crashed "
        "(its worker is gone). Flow runs send heartbeats when their worker sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY "
        "(at least 30 s; deploy/prefect.yaml sets 30); keep this at 2-3 times that. A run that sends none is "
        "never judged by silence.",
        90.0,
    )
    poll_seconds: float = field("work-pool: how often the cycle reads its candidates' flow run states.", 5.0)

    def __post_init__(self) -> None:
        if self.candidates not in MODES:
            raise ConfigError(f"candidates: expected one of {MODES}, got {self.candidates!r}")
        if "/" not in self.deployment:
            raise ConfigError(f"deployment: expected 'flow/deployment', got {self.deployment!r}")
        if self.slots is not None and not NAME.match(self.slots):
            raise ConfigError(f"slots: expected the name of a global concurrency limit, or null; got {self.slots!r}")
        if not self.heartbeat_timeout_s > 0:
            raise ConfigError(
                f"heartbeat_timeout_s: expected a positive number of seconds, got {self.heartbeat_timeout_s!r}"
            )
        if not 0 < self.poll_seconds <= 600:
            raise ConfigError(f"poll_seconds: expected seconds in (0, 600], got {self.poll_seconds!r}")


@dataclass
class UpdateConfig:
    name: str = field("A label for this configuration (shown in reports).", "default")
    backbone: str = field(
        "Backbone alias, local folder or cached hub id; 'tiny-llama' is a random toy model for tests.", "smollm2-135m"
    )
    dtype: str = field(
        f"Model dtype, one of {DTYPES}; auto is bfloat16 where the hardware runs it natively "
        "(a bf16 GPU, AVX512-BF16/AMX CPUs), else float32.",
        "auto",
    )
    skill: str = field("Name of the skill this release teaches.", "code")
    line: str | None = field(
        "The release line (registered model '<backbone>.<line>'); each release builds on the line's "
        "champion. null: a line named after the skill.",
        None,
    )
    layer: int = field("Decoder layer l of the residual / LoRA (-1: the middle layer).", -1)
    evaluate: str = field(
        f"Which checkpoints become candidates, one of {EVALUATE}: each epoch's last, every "
        "checkpoint, or only each run's final one.",
        "epoch-ends",
    )
    data: SkillData = field("Skill training data.", factory=SkillData)
    target: TargetSpec = field("Target (skill) scoring.", factory=TargetSpec)
    retained: RetainedSpec = field("Retained domains and their evaluation subsets.", factory=RetainedSpec)
    atlas: AtlasSpec = field(
        "Atlas fitted on retained contexts (content-addressed, reused when nothing changed).", factory=AtlasSpec
    )
    train: TrainOverrides = field("Training settings applied to every candidate method.", factory=TrainOverrides)
    execution: ExecutionSpec = field(
        "Where candidates run (in this process or on a Prefect work pool).", factory=ExecutionSpec
    )

    def __post_init__(self) -> None:
        _nonempty(self, "name", "backbone")
        for name in ("skill", "line"):
            value = getattr(self, name)
            if value is not None and not NAME.match(value):
                raise ConfigError(
                    f"{name}: expected a name of letters, digits, '_', '.', '-' (a key in policies and the "
                    f"ledger), got {value!r}"
                )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.evaluate not in EVALUATE:
            raise ConfigError(f"evaluate: expected one of {EVALUATE}, got {self.evaluate!r}")
        if self.layer == 0 or self.layer < -1:
            raise ConfigError(
                f"layer: expected -1 (middle) or a layer index >= 1 (retained KL caches layers below it), "
                f"got {self.layer!r}"
            )

    @property
    def line_name(self) -> str:
        return self.line or self.skill

    @property
    def domain_names(self) -> list[str]:
        """The configured retained domains by name (a JSONL domain's `name`)."""
        return [d if isinstance(d, str) else d["name"] for d in self.retained.domains]

    def to_dict(self) -> dict:
        return asdict(self)

    def eval_key(self) -> str:
        """Identity of what an evaluation measures: a stored evaluation is reused only if it matches."""
        return digest({"target": asdict(self.target), "retained": asdict(self.retained), "data": asdict(self.data)})


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def resolve(path: str | Path) -> Path:
    """A config path as given, else relative to the project root (deployments run elsewhere)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() or path.exists() else PROJECT_ROOT / path


def load_update_config(path: str | Path | None = None, **overrides) -> UpdateConfig:
    """Parse and validate an update config; keyword overrides (None ignored) replace top-level fields."""
    data = load_yaml(resolve(path)) if path is not None else {}
    try:
        config = build(UpdateConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
