"""Release policies: which candidates a cycle trains and the thresholds a release must meet.

A policy is a YAML file (configs/policy/); `load_policy(path, domains)` validates it and
checks that it sets a threshold for every retained domain the cycle watches, so a domain
cannot go unguarded by omission. The checks themselves are in flows/gates.py.

Negative-flip rates are judged by a one-sided upper confidence bound on the rate, not by
the observed rate: with 16 questions and 0 flips the Wilson 95% upper bound is 0.145, so
a small evaluation cannot pass a strict NFR limit by luck. A released skill's no-regression
is judged exactly (flows/gates.py; the statistics are in evaluation/stats.py).

A threshold that no outcome could meet at the cycle's sample sizes (an NFR limit of 0.03 on
16 questions: even 0 flips gives 0.171) is refused before anything trains, in one line that
names the field and the n it would need: `load_policy(..., sizes=answered_sizes(config))`
for NFR, `require_feasible_released` / `require_feasible_target` once the scorers are known.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from atlas_core.typed_config import ConfigError, build, field, load_yaml
from evaluation.stats import RATE_BOUNDS, clopper_pearson_upper, min_n_for_zero, rate_upper, wilson_upper  # noqa: F401 (wilson_upper: still importable from here)

from .config import digest, resolve
from .kl_tail import STATISTICS

if TYPE_CHECKING:
    from .config import UpdateConfig

BOUNDS = RATE_BOUNDS
PASS_FAIL, CONTINUOUS = "pass-fail", "continuous"  # kinds of released-skill scorers (flows/metrics.py: Regression)
RELEASED = "released"  # key of the thresholds that apply to every released skill not named itself
# Retained domains whose questions are answered (churn, NFR); others are KL-only.
ANSWERED = ("gsm8k", "csqa")
SELECTION = ("lowest-kl-vs-champion", "lowest-kl-vs-base")
METHOD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a run config's file name without .yaml


@dataclass
class Candidates:
    methods: list[str] = field(
        "Methods to train: names of run configs in the update config's train.configs_dir "
        "(e.g. atlas, weight-lora, replay, output-kl-0.3).",
        factory=lambda: ["atlas"],
    )
    seeds: list[int] = field("Seeds; every method is trained once per seed.", factory=lambda: [0])
    require_all: bool = field(
        "When a candidate fails (its training or evaluation raised, its flow run crashed or was cancelled): "
        "true rejects the whole cycle (a rerun resumes the failed one and reuses the rest); false lets the gate "
        "decide among the candidates that finished.",
        True,
    )

    def __post_init__(self) -> None:
        for name, items in (("methods", self.methods), ("seeds", self.seeds)):
            if not items:
                raise ConfigError(
                    f"{name}: expected a non-empty list of distinct {'names' if name == 'methods' else 'seeds'}, "
                    f"got {items!r}"
                )
            for i, item in enumerate(items):
                if items.index(item) != i:
                    raise ConfigError(f"{name}[{i}]: {item!r} is listed twice (also at index {items.index(item)})")
        for i, method in enumerate(self.methods):
            if not METHOD.match(method):
                raise ConfigError(
                    f"methods[{i}]: expected the name of a run config (<name>.yaml in train.configs_dir), "
                    f"got {method!r}"
                )
        for i, seed in enumerate(self.seeds):
            if not 0 <= seed < 2**31:  # the ledger stores it in a 32-bit column
                raise ConfigError(f"seeds[{i}]: expected an integer in [0, 2**31), got {seed!r}")

    def require_run_configs(self, configs_dir: str) -> None:
        """Every method names a run config <configs_dir>/<method>.yaml (the update config's train.configs_dir)."""
        folder = resolve(configs_dir)
        for i, method in enumerate(self.methods):
            if not (folder / f"{method}.yaml").is_file():
                known = sorted(p.stem for p in folder.glob("*.yaml"))
                raise ConfigError(
                    f"candidates.methods[{i}]: no run config {method}.yaml in {configs_dir} "
                    f"(train.configs_dir of the update config); expected one of {known}"
                )


@dataclass
class NfrLimits:
    bound: str = field(f"One-sided upper confidence bound on the negative-flip rate, one of {BOUNDS}.", "wilson")
    confidence: float = field("Confidence level of the one-sided bound.", 0.95)
    max_vs_champion: dict[str, float] = field(
        "Per domain: largest allowed upper bound of NFR against the champion.", factory=dict
    )
    max_vs_base: dict[str, float] = field(
        "Per domain: largest allowed upper bound of NFR against the base model.", factory=dict
    )
    above_floor: bool = field(
        "Judge flips against the champion above its own noise floor: the bound is computed on "
        "max(F - F_floor, 0), F_floor the champion's negative flips when its answers are decoded "
        "again in another batching (flows/noise_floor.py). A correction, not an exact statistic: off "
        "by default; the floor is reported beside F either way.",
        False,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.above_floor, bool):
            raise ConfigError(f"above_floor: expected true or false, got {self.above_floor!r}")
        if self.bound not in BOUNDS:
            raise ConfigError(f"bound: expected one of {BOUNDS}, got {self.bound!r}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence: expected a value in [0.5, 1), got {self.confidence!r}")
        for name in ("max_vs_champion", "max_vs_base"):
            for domain, value in getattr(self, name).items():
                if not 0 <= value <= 1:
                    raise ConfigError(f"{name}.{domain}: expected a rate in [0, 1], got {value!r}")

    def upper(self, flips: int, n: int) -> float:
        return rate_upper(flips, n, self.confidence, self.bound)


@dataclass
class NoRegression:
    tolerance: float = field(
        "Largest allowed one-sided upper bound of the skill's loss against the champion. Pass/fail "
        "scorers (solved or not, e.g. MBPP+): the exact Clopper-Pearson bound of the share of "
        "problems the champion solved and the candidate does not (32 problems: 0 lost gives 0.089, "
        "1 lost 0.140). Continuous scorers (e.g. reference-nll, nats/token): the Student-t bound of "
        "the mean per-problem drop.",
        0.1,
    )
    confidence: float = field("Confidence level of the one-sided bound.", 0.95)
    min_n: int = field(
        "Continuous scorers: fewest shared problems the t bound is computed on (fewer: rejected, and "
        "refused at load when the skill has fewer problems).",
        8,
    )

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ConfigError(f"tolerance: expected a finite number >= 0, got {self.tolerance!r}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence: expected a value in [0.5, 1), got {self.confidence!r}")
        if self.min_n < 2:  # one value has no sample spread
            raise ConfigError(f"min_n: expected an integer >= 2, got {self.min_n!r}")

    def infeasible(self, kind: str, n: int) -> Optional[str]:
        """Why this tolerance cannot be met on n problems whatever the answers (None: it can).
        Pass/fail: even 0 lost gives a Clopper-Pearson bound above the tolerance; continuous:
        fewer than min_n problems. The gate and the load-time check share this one rule."""
        if kind == CONTINUOUS:
            return None if n >= self.min_n else f"{n} problem(s), fewer than min_n={self.min_n} for a t bound"
        if n < 1:
            return "no problems to compare"
        need = min_n_for_zero(self.tolerance, self.confidence, "clopper-pearson")
        if need is not None and n >= need:
            return None
        zero = clopper_pearson_upper(0, n, self.confidence)
        needs = "no n can prove a tolerance of 0" if need is None else f"needs n >= {need}"
        return (
            f"tolerance {self.tolerance:g} is unprovable at n={n}: even 0 lost gives a Clopper-Pearson "
            f"{self.confidence:.0%} upper bound of {zero:.3f}; {needs}"
        )


@dataclass
class ReleasePolicy:
    name: str = field("Policy name, recorded with every gate decision (with a hash of the whole policy).", "default")
    candidates: Candidates = field("What the cycle trains (method x seed).", factory=Candidates)
    min_target_gain: float = field(
        "Gain over the champion a candidate must reach on the taught skill, in its scorer's "
        "units: solved problems (0: no regression), or nats/token of reference-nll; negative: a "
        "tolerance, the candidate may score up to that much below the champion (a squash, which "
        "teaches nothing new and moves scores by rounding: configs/policy/squash.yaml).",
        1,
    )
    max_kl_vs_champion: dict[str, float] = field(
        "Per domain: largest retained KL (nats/token) against the champion; "
        f"key {RELEASED!r}: for every released skill not listed by name.",
        factory=dict,
    )
    max_kl_vs_base: dict[str, float] = field(
        "Per domain: largest retained KL (nats/token) against the base model.", factory=dict
    )
    max_kl_tail_vs_champion: dict[str, dict[str, float]] = field(
        f"Optional: per domain (or {RELEASED!r} for every released skill not named), the largest allowed "
        f"{'/'.join(STATISTICS)} of the per-context retained KL against the champion (nats/token; p95/p99: quantiles "
        "over the member's contexts by linear interpolation, numpy's default; max: the largest context; prompt / "
        "response: the mean over the prompt positions / over the reference answer's positions only, "
        "flows/kl_tail.py). E.g. {csqa: {p95: 0.1, max: 0.5}, gsm8k: {response: 0.01}}. Empty: not checked; a "
        "limit on a statistic not measured fails.",
        factory=dict,
    )
    max_kl_tail_vs_base: dict[str, dict[str, float]] = field(
        "Optional: the same limits against the base model, on configured domains only (released skills moved away "
        "from the base by design).",
        factory=dict,
    )
    nfr: NfrLimits = field("Negative-flip-rate limits (upper confidence bounds).", factory=NfrLimits)
    no_regression: dict[str, NoRegression] = field(
        f"Per released skill (or {RELEASED!r} for all not named): how far its "
        "target score may drop against the champion.",
        factory=lambda: {RELEASED: NoRegression()},
    )
    max_csqa_choice_churn: float | None = field(
        "Largest share of CSQA questions whose chosen option changed against the "
        "champion (null: not checked; only when csqa is watched).",
        None,
    )
    selection: str = field(
        f"Among passing checkpoints, pick by {SELECTION} (mean over domains).", "lowest-kl-vs-champion"
    )

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ConfigError(f"name: expected a non-empty policy name, got {self.name!r}")
        for name in ("max_kl_vs_champion", "max_kl_vs_base"):
            for domain, value in getattr(self, name).items():
                if not (math.isfinite(value) and value >= 0):
                    raise ConfigError(f"{name}.{domain}: expected a finite number >= 0, got {value!r}")
        for name in ("max_kl_tail_vs_champion", "max_kl_tail_vs_base"):
            for member, limits in getattr(self, name).items():
                if not limits:
                    raise ConfigError(f"{name}.{member}: expected a limit on at least one of {list(STATISTICS)}")
                for stat, value in limits.items():
                    if stat not in STATISTICS:
                        raise ConfigError(
                            f"{name}.{member}.{stat}: unknown statistic; expected one of {list(STATISTICS)}"
                        )
                    if not (math.isfinite(value) and value >= 0):
                        raise ConfigError(f"{name}.{member}.{stat}: expected a finite number >= 0, got {value!r}")
        if RELEASED in self.max_kl_tail_vs_base:
            raise ConfigError(
                f"max_kl_tail_vs_base.{RELEASED}: released skills are checked against the champion only "
                "(max_kl_tail_vs_champion)"
            )
        if self.max_csqa_choice_churn is not None and not 0 <= self.max_csqa_choice_churn <= 1:
            raise ConfigError(f"max_csqa_choice_churn: expected a share in [0, 1], got {self.max_csqa_choice_churn!r}")
        if self.selection not in SELECTION:
            raise ConfigError(f"selection: expected one of {SELECTION}, got {self.selection!r}")

    def require_domains(self, domains: list[str]) -> None:
        """Every watched domain needs every per-domain threshold (fail closed on omissions)."""
        answered = [d for d in domains if d in ANSWERED]  # only these have answers to flip
        for name, limits, watched in (
            ("max_kl_vs_champion", self.max_kl_vs_champion, domains),
            ("max_kl_vs_base", self.max_kl_vs_base, domains),
            ("nfr.max_vs_champion", self.nfr.max_vs_champion, answered),
            ("nfr.max_vs_base", self.nfr.max_vs_base, answered),
        ):
            missing = [d for d in watched if d not in limits]
            if missing:
                raise ConfigError(
                    f"{name}: no threshold for watched domain(s) {missing}; set one for each of {domains}"
                )

    def require_released(self, skills: list[str]) -> None:
        """Every released skill needs a KL limit against the champion and a no-regression tolerance."""
        for name, limits in (("max_kl_vs_champion", self.max_kl_vs_champion), ("no_regression", self.no_regression)):
            missing = [s for s in skills if s not in limits and RELEASED not in limits]
            if missing:
                raise ConfigError(
                    f"{name}: no threshold for released skill(s) {missing}; name them or set {RELEASED!r}"
                )

    def require_feasible_answers(self, sizes: dict[str, int]) -> None:
        """Every NFR limit on a domain answered by `sizes[domain]` questions can be met with 0 flips."""
        label = f"{'Wilson' if self.nfr.bound == 'wilson' else 'Clopper-Pearson'} {self.nfr.confidence:.0%}"
        for which in ("max_vs_champion", "max_vs_base"):
            for domain, limit in sorted(getattr(self.nfr, which).items()):
                n = sizes.get(domain)
                need = min_n_for_zero(limit, self.nfr.confidence, self.nfr.bound)
                if n is None or (need is not None and n >= need):
                    continue
                needs = "no n can prove a limit of 0" if need is None else f"needs >= {need} questions"
                raise ConfigError(
                    f"nfr.{which}.{domain}: limit {limit:g} is unprovable with {n} questions (even 0 flips "
                    f"gives a {label} upper bound of {self.nfr.upper(0, n):.3f}); {needs} "
                    f"(retained.{domain}_questions) or a looser limit"
                )

    def require_feasible_released(self, skills: dict[str, tuple[str, int]]) -> None:
        """skills: released skill -> (scorer kind, number of problems); each tolerance must be provable."""
        for skill, (kind, n) in sorted(skills.items()):
            key = skill if skill in self.no_regression else RELEASED
            limits = self.no_regression.get(key)
            problem = None if limits is None else limits.infeasible(kind, n)  # missing: require_released says so
            if problem:
                raise ConfigError(f"no_regression.{key}: released skill {skill!r} ({kind}): {problem}")

    def require_feasible_target(self, problems: int, solved_counts: bool) -> None:
        """A solved-count target of `problems` problems cannot gain more than that over the champion."""
        if solved_counts and self.min_target_gain > problems:
            raise ConfigError(
                f"min_target_gain: {self.min_target_gain:g} solved problems cannot be gained on a target "
                f"of {problems} problems; expected at most {problems}"
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.candidates.require_all:  # the default: labels of policies written before it stay as they were
            del d["candidates"]["require_all"]
        return d

    @property
    def hash(self) -> str:
        return digest(self.to_dict())

    @property
    def label(self) -> str:
        """What the ledger records as the policy name: readable, and different when any threshold changed."""
        return f"{self.name}@{self.hash[:10]}"


def answered_sizes(config: "UpdateConfig") -> dict[str, int]:
    """Questions per watched answered domain: what the NFR bounds are computed on."""
    r = config.retained
    sizes = {"gsm8k": r.gsm8k_questions, "csqa": r.csqa_questions}
    return {d: sizes[d] for d in config.domain_names if d in sizes}


def load_policy(
    path: str | Path, domains: list[str] | None = None, sizes: dict[str, int] | None = None
) -> ReleasePolicy:
    """Parse and validate a policy file; with `domains`, require thresholds for each of them;
    with `sizes` (domain -> questions answered, `answered_sizes(config)`), require every NFR
    limit to be provable at those sizes."""
    data = load_yaml(resolve(path))  # its errors name the file already (as in load_update_config)
    try:
        policy = build(ReleasePolicy, data)
        if domains is not None:
            policy.require_domains(domains)
        if sizes is not None:
            policy.require_feasible_answers(sizes)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return policy


def load_cycle_policy(path: str | Path, config: "UpdateConfig") -> ReleasePolicy:
    """The policy of a cycle on `config`: thresholds for every watched domain, every NFR limit
    provable at the config's question counts, every candidate method a run config in the config's
    train.configs_dir (what `atlas update` and `atlas gate check` load)."""
    policy = load_policy(path, config.domain_names, answered_sizes(config))
    try:
        policy.candidates.require_run_configs(config.train.configs_dir)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return policy
