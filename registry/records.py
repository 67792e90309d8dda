"""Plain records that go into and come out of the ledger.

Callers (the flows) build the input records from their own results; the ledger returns
output records instead of ORM objects so that nothing depends on an open session.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from numbers import Integral
from typing import Any, Optional

# -- inputs --------------------------------------------------------------------------


@dataclass(frozen=True)
class DomainKL:
    """Retained KL in nats/token on one retained domain."""

    domain: str
    kl_vs_base: Optional[float]
    kl_vs_release: Optional[float] = None


def flip_kind(
    ref_correct: bool, ref_answer: Optional[str], new_correct: bool, new_answer: Optional[str]
) -> Optional[str]:
    """The one F/G/W classifier: how one question's answer moved from a reference to a new model.

    'F' correct -> wrong (a negative flip), 'G' wrong -> correct, 'W' wrong -> a different wrong
    answer; None: unchanged. A question has one correct answer, so a change of answer is always
    one of the three; two unextractable answers (None, None) count as unchanged.
    """
    if ref_correct and not new_correct:
        return "F"
    if not ref_correct and new_correct:
        return "G"
    if not ref_correct and not new_correct and ref_answer != new_answer:
        return "W"
    return None


@dataclass(frozen=True)
class Flips:
    """The one flip record: answer flips (`flip_kind`) of a new model against a reference on the
    n questions both answered; churn = (F + G + W) / n and NFR = F / n.

    n = 0 (or any n that is not a positive count) means nothing was compared: both rates are None,
    never 0 or NaN, so every consumer fails closed on it (a gate check reads None as not measured).
    The counts are not validated here: the gates judge impossible counts (out of range) themselves,
    and the ledger refuses them when stored (registry.results).
    """

    n: int
    F: int
    G: int
    W: int

    @classmethod
    def tally(cls, kinds: Iterable[Optional[str]]) -> Flips:
        """Count one `flip_kind` result per compared question (None: unchanged)."""
        kinds = list(kinds)
        return cls(n=len(kinds), F=kinds.count("F"), G=kinds.count("G"), W=kinds.count("W"))

    @classmethod
    def total(cls, parts: Iterable[Flips]) -> Flips:
        """The flips of several question sets together (e.g. over domains)."""
        parts = list(parts)
        return cls(**{k: sum(getattr(p, k) for p in parts) for k in ("n", "F", "G", "W")})

    @property
    def measured(self) -> bool:
        """Whether any question was compared (n is a positive count)."""
        return isinstance(self.n, Integral) and self.n > 0

    @property
    def churn(self) -> Optional[float]:
        return (self.F + self.G + self.W) / self.n if self.measured else None

    @property
    def nfr(self) -> Optional[float]:
        return self.F / self.n if self.measured else None


@dataclass(frozen=True)
class ChurnCounts:
    """The ledger row of one evaluation's `Flips` on one domain against the base or the release
    (`against`), under the ledger's column names; `flips` is the record, and its rates are the
    record's (`churn`, `nfr`: None when n = 0)."""

    against: str  # "base" | "release"
    domain: str
    flips_f: int
    flips_g: int
    flips_w: int
    n: int

    @classmethod
    def of(cls, against: str, domain: str, flips: Flips) -> ChurnCounts:
        return cls(against=against, domain=domain, flips_f=flips.F, flips_g=flips.G, flips_w=flips.W, n=flips.n)

    @property
    def flips(self) -> Flips:
        return Flips(n=self.n, F=self.flips_f, G=self.flips_g, W=self.flips_w)

    @property
    def churn(self) -> Optional[float]:
        return self.flips.churn

    @property
    def nfr(self) -> Optional[float]:
        return self.flips.nfr


@dataclass(frozen=True)
class EvaluationRecord:
    version_id: int
    target_solved: int
    target_total: int
    kl: list[DomainKL] = field(default_factory=list)
    churn: list[ChurnCounts] = field(default_factory=list)
    csqa_choice_churn: Optional[float] = None
    release_version_id: Optional[int] = None  # the champion this was measured against
    extra: dict[str, Any] = field(default_factory=dict)
    flow_run_id: Optional[str] = None


@dataclass(frozen=True)
class AnswerRecord:
    """A version's extracted answer to one question (`answer` None: nothing extracted)."""

    dataset: str
    question_id: str
    answer: Optional[str]
    correct: bool


@dataclass(frozen=True)
class GateCheckRecord:
    """One policy threshold; `measured` may be NaN/None (the check then must have failed)."""

    name: str
    threshold: Optional[float]
    measured: Optional[float]
    passed: bool
    detail: str = ""


# -- outputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class AtlasInfo:
    id: int
    content_hash: str
    backbone_id: int
    layer: int
    config: dict[str, Any]
    artifact_sha256: str
    artifact_uri: str


@dataclass(frozen=True)
class CheckpointInfo:
    id: int
    training_run_id: int
    epoch: int
    step: int
    adapter_sha256: str
    adapter_uri: str
    metrics: dict[str, Any]


@dataclass(frozen=True)
class ModelInfo:
    """A line: one registered model of one backbone at one revision."""

    id: int
    name: str
    backbone: str
    revision: str
    line: str


@dataclass(frozen=True)
class VersionInfo:
    """A model version with what a person (or an MLflow tag) needs to know about it."""

    id: int
    model_id: int
    model_name: str
    name: str
    backbone: str
    line: str  # the line (registered model) the version belongs to
    skill: Optional[str]  # the skill its delta taught; None for the base version
    mlflow_version: Optional[str]
    parent_id: Optional[int] = None  # the version its delta sits on; None only for the base
    status: str = "active"  # "retired" once rolled back, until re-nominated
    checkpoint_id: Optional[int] = None  # None: the base backbone itself
    training_run_id: Optional[int] = None
    mlflow_run_id: Optional[str] = None
    method: Optional[str] = None
    seed: Optional[int] = None
    epoch: Optional[int] = None
    step: Optional[int] = None
    adapter_sha256: Optional[str] = None
    atlas_id: Optional[int] = None
    atlas_sha256: Optional[str] = None

    @property
    def is_base(self) -> bool:
        return self.checkpoint_id is None


@dataclass(frozen=True)
class EvaluationInfo:
    id: int
    version_id: int
    release_version_id: Optional[int]
    target_solved: int
    target_total: int
    kl: list[DomainKL]
    churn: list[ChurnCounts]
    csqa_choice_churn: Optional[float]
    created_at: datetime

    def churn_total(self, against: str) -> Optional[ChurnCounts]:
        """F/G/W summed over domains against 'base' or 'release' (None if not measured)."""
        rows = [c for c in self.churn if c.against == against]
        if not rows:
            return None
        return ChurnCounts.of(against, "all", Flips.total(c.flips for c in rows))

    def max_kl(self, which: str = "kl_vs_base") -> Optional[float]:
        values = [getattr(k, which) for k in self.kl if getattr(k, which) is not None]
        return max(values) if values else None


@dataclass(frozen=True)
class GateDecisionInfo:
    id: int
    version_id: int
    evaluation_id: Optional[int]
    release_version_id: Optional[int]
    policy_name: str
    passed: bool
    checks: list[GateCheckRecord]
    created_at: datetime


@dataclass(frozen=True)
class ReleaseInfo:
    id: int
    model_id: int
    alias: str
    version_id: int
    previous_version_id: Optional[int]
    action: str
    reason: str
    flow_run_id: Optional[str]
    created_at: datetime
    mlflow_synced: bool


def finite_or_none(value: Optional[float], field_name: str) -> Optional[float]:
    """Reject NaN/inf before it reaches the database (SQLite would silently store NULL)."""
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{field_name}: expected a finite number or None, got {value}")
    return value
