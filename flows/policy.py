"""Release policies: which candidates a cycle trains and the thresholds a release must meet.

A policy is a YAML file (configs/policy/); `load_policy(path, domains)` validates it and
checks that it sets a threshold for every retained domain the cycle watches, so a domain
cannot go unguarded by omission. The checks themselves are in flows/gates.py.

Negative-flip rates are judged by a one-sided upper confidence bound on the rate, not by
the observed rate: with 16 questions and 0 flips the Wilson 95% upper bound is 0.145, so
a small evaluation cannot pass a strict NFR limit by luck.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

from .config import digest, resolve
from atlas_core.typed_config import ConfigError, build, field, load_yaml

BOUNDS = ("wilson", "clopper-pearson")
RELEASED = "released"
ANSWERED = ("gsm8k", "csqa")  # retained domains whose questions are answered (churn, NFR); others are KL-only  # key of the thresholds that apply to every released skill not named itself
SELECTION = ("lowest-kl-vs-champion", "lowest-kl-vs-base")


@dataclass
class Candidates:
    methods: list[str] = field("Methods to train: names of run configs in the update config's train.configs_dir "
                               "(e.g. atlas, weight-lora, replay, output-kl-0.3).", factory=lambda: ["atlas"])
    seeds: list[int] = field("Seeds; every method is trained once per seed.", factory=lambda: [0])

    def __post_init__(self) -> None:
        if not self.methods or len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"methods: expected a non-empty list of distinct names, got {self.methods!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds: expected a non-empty list of distinct integers, got {self.seeds!r}")


@dataclass
class NfrLimits:
    bound: str = field(f"One-sided upper confidence bound on the negative-flip rate, one of {BOUNDS}.", "wilson")
    confidence: float = field("Confidence level of the one-sided bound.", 0.95)
    max_vs_champion: dict[str, float] = field("Per domain: largest allowed upper bound of NFR against the champion.",
                                              factory=dict)
    max_vs_base: dict[str, float] = field("Per domain: largest allowed upper bound of NFR against the base model.",
                                          factory=dict)

    def __post_init__(self) -> None:
        if self.bound not in BOUNDS:
            raise ConfigError(f"bound: expected one of {BOUNDS}, got {self.bound!r}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence: expected a value in [0.5, 1), got {self.confidence!r}")
        for name in ("max_vs_champion", "max_vs_base"):
            for domain, value in getattr(self, name).items():
                if not 0 <= value <= 1:
                    raise ConfigError(f"{name}.{domain}: expected a rate in [0, 1], got {value!r}")

    def upper(self, flips: int, n: int) -> float:
        return nfr_upper_bound(flips, n, self.confidence, self.bound)


@dataclass
class NoRegression:
    tolerance: float = field("Largest allowed one-sided upper bound of the mean per-problem drop of the skill's score "
                             "against the champion, in the scorer's per-problem units (solved-problem scorers: a share "
                             "of problems; reference-nll: nats/token).", 0.1)
    confidence: float = field("Confidence level of the one-sided bound.", 0.95)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ConfigError(f"tolerance: expected a finite number >= 0, got {self.tolerance!r}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"confidence: expected a value in [0.5, 1), got {self.confidence!r}")


@dataclass
class ReleasePolicy:
    name: str = field("Policy name, recorded with every gate decision (with a hash of the whole policy).", "default")
    candidates: Candidates = field("What the cycle trains (method x seed).", factory=Candidates)
    min_target_gain: float = field("Gain over the champion a candidate must reach on the taught skill, in its scorer's "
                                   "units: solved problems (0: no regression), or nats/token of reference-nll.", 1)
    max_kl_vs_champion: dict[str, float] = field("Per domain: largest retained KL (nats/token) against the champion; "
                                                 f"key {RELEASED!r}: for every released skill not listed by name.",
                                                 factory=dict)
    max_kl_vs_base: dict[str, float] = field("Per domain: largest retained KL (nats/token) against the base model.",
                                             factory=dict)
    nfr: NfrLimits = field("Negative-flip-rate limits (upper confidence bounds).", factory=NfrLimits)
    no_regression: dict[str, NoRegression] = field(f"Per released skill (or {RELEASED!r} for all not named): how far its "
                                                   "target score may drop against the champion.",
                                                   factory=lambda: {RELEASED: NoRegression()})
    max_csqa_choice_churn: float | None = field("Largest share of CSQA questions whose chosen option changed against the "
                                                "champion (null: not checked; only when csqa is watched).", None)
    selection: str = field(f"Among passing checkpoints, pick by {SELECTION} (mean over domains).", "lowest-kl-vs-champion")

    def __post_init__(self) -> None:
        if self.min_target_gain < 0:
            raise ConfigError(f"min_target_gain: expected an integer >= 0, got {self.min_target_gain!r}")
        for name in ("max_kl_vs_champion", "max_kl_vs_base"):
            for domain, value in getattr(self, name).items():
                if not (math.isfinite(value) and value >= 0):
                    raise ConfigError(f"{name}.{domain}: expected a finite number >= 0, got {value!r}")
        if self.max_csqa_choice_churn is not None and not 0 <= self.max_csqa_choice_churn <= 1:
            raise ConfigError(f"max_csqa_choice_churn: expected a share in [0, 1], got {self.max_csqa_choice_churn!r}")
        if self.selection not in SELECTION:
            raise ConfigError(f"selection: expected one of {SELECTION}, got {self.selection!r}")

    def require_domains(self, domains: list[str]) -> None:
        """Every watched domain needs every per-domain threshold (fail closed on omissions)."""
        answered = [d for d in domains if d in ANSWERED]  # only these have answers to flip
        for name, limits, watched in (("max_kl_vs_champion", self.max_kl_vs_champion, domains),
                                      ("max_kl_vs_base", self.max_kl_vs_base, domains),
                                      ("nfr.max_vs_champion", self.nfr.max_vs_champion, answered),
                                      ("nfr.max_vs_base", self.nfr.max_vs_base, answered)):
            missing = [d for d in watched if d not in limits]
            if missing:
                raise ConfigError(f"{name}: no threshold for watched domain(s) {missing}; set one for each of {domains}")

    def require_released(self, skills: list[str]) -> None:
        """Every released skill needs a KL limit against the champion and a no-regression tolerance."""
        for name, limits in (("max_kl_vs_champion", self.max_kl_vs_champion), ("no_regression", self.no_regression)):
            missing = [s for s in skills if s not in limits and RELEASED not in limits]
            if missing:
                raise ConfigError(f"{name}: no threshold for released skill(s) {missing}; name them or set {RELEASED!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def hash(self) -> str:
        return digest(self.to_dict())

    @property
    def label(self) -> str:
        """What the ledger records as the policy name: readable, and different when any threshold changed."""
        return f"{self.name}@{self.hash[:10]}"


def load_policy(path: str | Path, domains: list[str] | None = None) -> ReleasePolicy:
    """Parse and validate a policy file; with `domains`, require thresholds for each of them."""
    data = load_yaml(resolve(path))  # its errors name the file already (as in load_update_config)
    try:
        policy = build(ReleasePolicy, data)
        if domains is not None:
            policy.require_domains(domains)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return policy


# ------------------------------------------------------------------------ confidence bounds
def _counts_ok(k, n, confidence: float) -> bool:
    """Integer counts 0 <= k <= n, n >= 1 (of any size), and a confidence strictly inside (0, 1)."""
    counts = all(isinstance(v, Integral) and not isinstance(v, bool) for v in (k, n))
    return counts and 0 <= k <= n and n >= 1 and isinstance(confidence, Real) and 0.0 < confidence < 1.0


def wilson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Wilson score upper bound of a binomial rate k/n (NaN for impossible counts)."""
    if not _counts_ok(k, n, confidence):
        return math.nan
    z, n = NormalDist().inv_cdf(confidence), float(n)
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) upper bound: the p with P(X <= k | n, p) = 1 - confidence,
    i.e. the `confidence` quantile of Beta(k + 1, n - k) (regularised incomplete beta: no binomial
    sums, so no overflow at any n). NaN for impossible counts."""
    if not _counts_ok(k, n, confidence):
        return math.nan
    if k >= n:
        return 1.0
    from scipy.special import betaincinv

    return float(betaincinv(k + 1, n - k, confidence))


def nfr_upper_bound(flips: int, n: int, confidence: float = 0.95, bound: str = "wilson") -> float:
    if bound not in BOUNDS:
        raise ValueError(f"bound: expected one of {BOUNDS}, got {bound!r}")
    return (wilson_upper if bound == "wilson" else clopper_pearson_upper)(flips, n, confidence)
