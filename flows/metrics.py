"""What the gate judges: one candidate's measured metrics (CandidateMetrics) and a released skill's
paired regression (Regression), with their ledger form (to_record / from_record).

`Flips` (registry.Flips) is the one flip record: answer flips on one domain against a reference
model; its rates are None when n = 0, which flows/gates.py reads as not measured (fail closed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from evaluation.stats import clopper_pearson_upper, t_upper
from registry import ChurnCounts, DomainKL, EvaluationInfo, EvaluationRecord, Flips

from .kl_tail import KLTail, MovedContext
from .kl_tail import from_extra as kl_tail_from_extra
from .kl_tail import to_extra as kl_tail_to_extra
from .policy import CONTINUOUS, PASS_FAIL


def regression_kind(scorer) -> str:
    """PASS_FAIL for a 'sum' scorer (its per-problem values are 1 solved / 0 not: evaluation/
    scorer_base.py), CONTINUOUS for a 'mean' one (e.g. reference-nll's nats/token)."""
    return PASS_FAIL if scorer.aggregate == "sum" else CONTINUOUS


@dataclass(frozen=True)
class Regression:
    """A released skill's score, candidate against champion, problem by problem (spec: no-regression).

    Over the n shared problems, drop = champion's value - candidate's value, signed so that > 0
    is worse. `mean_drop` / `sd_drop`: its mean and SAMPLE standard deviation (None below 2).
    Pass/fail skills also carry the exact paired counts: `lost` (champion solved, candidate not)
    and `gained` (the reverse); the gate judges them by the Clopper-Pearson bound of lost/n.

    Evaluations stored by older code hold only the first five fields: they still load, with
    `kind` None, and are re-judged fail closed (the gate rejects them; `stored_metrics` treats
    them as not stored, so a cycle measures them again from the stored answers)."""

    n: int
    champion_score: Optional[float]
    score: Optional[float]
    mean_drop: Optional[float]
    sd_drop: Optional[float]
    kind: Optional[str] = None  # PASS_FAIL | CONTINUOUS; None: stored before the exact counts were
    lost: Optional[int] = None
    gained: Optional[int] = None

    def upper(self, confidence: float) -> float:
        """One-sided upper bound of the loss: pass/fail: Clopper-Pearson of lost/n; continuous:
        Student t of the mean drop. NaN when it cannot be computed (fail closed)."""
        if self.kind == PASS_FAIL:
            return clopper_pearson_upper(self.lost, self.n, confidence)
        if self.kind == CONTINUOUS and self.mean_drop is not None and self.sd_drop is not None:
            return t_upper(self.mean_drop, self.sd_drop, self.n, confidence)
        return math.nan


def version_fields(version) -> dict:
    """A registry.VersionInfo's identity, as CandidateMetrics names its first fields."""
    return {
        "version_id": version.id,
        "name": version.name,
        "method": version.method,
        "seed": version.seed,
        "epoch": version.epoch,
        "step": version.step,
    }


@dataclass
class CandidateMetrics:
    """What the gate reads about one candidate; any value may be None (not measured) or NaN."""

    version_id: int
    name: str
    method: str
    seed: int
    epoch: int
    step: int
    target_solved: Optional[int]
    target_total: int
    champion_solved: Optional[int]
    kl_vs_base: dict[str, Optional[float]] = field(default_factory=dict)
    kl_vs_champion: dict[str, Optional[float]] = field(default_factory=dict)
    flips_vs_base: dict[str, Flips] = field(default_factory=dict)
    flips_vs_champion: dict[str, Flips] = field(default_factory=dict)
    csqa_choice_churn: Optional[float] = None
    released: dict[str, Regression] = field(default_factory=dict)  # released skill -> its score vs the champion
    evaluation_id: Optional[int] = None
    # The scorer's own aggregate (solved count, or e.g. reference-nll's mean NLL) and direction.
    target_score: Optional[float] = None
    champion_score: Optional[float] = None
    higher_is_better: bool = True
    # Per-context retained KL beyond the mean (flows/kl_tail.py), "vs_champion" / "vs_base" -> member -> its
    # tail, and the contexts that moved most. Empty when stored by older code: a tail limit then fails closed.
    kl_tail: dict[str, dict[str, KLTail]] = field(default_factory=dict)
    kl_top_contexts: dict[str, dict[str, list[MovedContext]]] = field(default_factory=dict)
    # The champion's flips against itself re-decoded in another batching, per answered domain (flows/noise_floor.py).
    flips_floor: dict[str, Flips] = field(default_factory=dict)

    def mean_kl(self, which: str) -> float:
        values = list(getattr(self, which).values())
        if not values or any(not finite(v) for v in values):
            return math.inf
        return sum(values) / len(values)

    def to_record(
        self,
        *,
        release_version_id: int,
        eval_key: str,
        flow_run_id: Optional[str] = None,
        kl_vs_teacher: Optional[dict[str, float]] = None,
    ) -> EvaluationRecord:
        """The evaluation as the ledger stores it, measured against the champion `release_version_id`
        with the settings `eval_key` (flows/evaluate.py). The ledger stores finite numbers only: a
        NaN/inf KL is None in the record and kept readable in `extra["nonfinite"]`; what the record
        has no column for goes into `extra` (`from_record` reads both back)."""
        nonfinite = {
            f"{k}[{d}]": str(v)
            for k in ("kl_vs_base", "kl_vs_champion")
            for d, v in getattr(self, k).items()
            if v is not None and not math.isfinite(v)
        }
        extra: dict[str, Any] = {
            "eval_key": eval_key,
            "nonfinite": nonfinite,
            "champion_solved": self.champion_solved,
            "released": {k: asdict(r) for k, r in self.released.items()},
            "target_score": _finite_or_none(self.target_score),
            "champion_score": _finite_or_none(self.champion_score),
            "higher_is_better": self.higher_is_better,
            "kl_vs_teacher": {k: _finite_or_none(v) for k, v in (kl_vs_teacher or {}).items()},
            "flips_floor": {d: asdict(f) for d, f in self.flips_floor.items()},
        }
        return EvaluationRecord(
            version_id=self.version_id,
            target_solved=self.target_solved,
            target_total=self.target_total,
            kl=[
                DomainKL(
                    domain=d,
                    kl_vs_base=_finite_or_none(self.kl_vs_base.get(d)),
                    kl_vs_release=_finite_or_none(self.kl_vs_champion.get(d)),
                )
                for d in self.kl_vs_base
            ],
            churn=[
                ChurnCounts.of(against, d, f)
                for against, flips in (("base", self.flips_vs_base), ("release", self.flips_vs_champion))
                for d, f in sorted(flips.items())
            ],
            csqa_choice_churn=_finite_or_none(self.csqa_choice_churn),
            release_version_id=release_version_id,
            extra=extra | kl_tail_to_extra(self.kl_tail, self.kl_top_contexts),
            flow_run_id=flow_run_id,
        )

    @classmethod
    def from_record(cls, version, ev: EvaluationInfo, extra: dict[str, Any]) -> CandidateMetrics:
        """A stored evaluation (`ev` and its `extra`, as `to_record` wrote them) of `version` (a
        registry.VersionInfo) back as the gate reads it. Regressions stored by older code come
        back with `kind` None and tails stored before they were kept come back empty: both fail
        closed at the gate."""
        nan = {k: float(v) for k, v in extra.get("nonfinite", {}).items()}
        kl = lambda which, attr: {k.domain: nan.get(f"{which}[{k.domain}]", getattr(k, attr)) for k in ev.kl}
        flips = lambda against: {c.domain: c.flips for c in ev.churn if c.against == against}
        tails, moved = kl_tail_from_extra(extra)
        return cls(
            **version_fields(version),
            target_solved=ev.target_solved,
            target_total=ev.target_total,
            champion_solved=extra.get("champion_solved"),
            kl_vs_base=kl("kl_vs_base", "kl_vs_base"),
            kl_vs_champion=kl("kl_vs_champion", "kl_vs_release"),
            flips_vs_base=flips("base"),
            flips_vs_champion=flips("release"),
            csqa_choice_churn=ev.csqa_choice_churn,
            released={k: Regression(**r) for k, r in extra.get("released", {}).items()},
            evaluation_id=ev.id,
            target_score=extra.get("target_score"),
            champion_score=extra.get("champion_score"),
            higher_is_better=extra.get("higher_is_better", True),
            kl_tail=tails,
            kl_top_contexts=moved,
            flips_floor={d: Flips(**f) for d, f in extra.get("flips_floor", {}).items()},
        )


def _finite_or_none(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def finite(value) -> bool:
    """A real, finite number (not None, NaN or inf)."""
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)
