"""Gate checks of one candidate against a release policy, and the choice among passing ones.

Fail closed: a metric that is missing, NaN, infinite or outside its possible range fails
its check (the detail says which), and a candidate passes only if every check passes.
Every check carries its threshold and measured value so the ledger can show exactly why.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from registry import GateCheckRecord

from .policy import ReleasePolicy

KL_TOLERANCE = 1e-6  # KL is >= 0 in exact arithmetic; fp32 rounding can dip a hair below


@dataclass(frozen=True)
class Flips:
    """Answer flips on one domain against a reference model (see evaluation.churn)."""

    n: int
    F: int
    G: int
    W: int

    @property
    def churn(self) -> float:
        return (self.F + self.G + self.W) / self.n if self.n else math.nan


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
    evaluation_id: Optional[int] = None

    def mean_kl(self, which: str) -> float:
        values = list(getattr(self, which).values())
        if not values or any(not _finite(v) for v in values):
            return math.inf
        return sum(values) / len(values)


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def _upper_check(name: str, threshold: float, measured, low: float, high: float = math.inf,
                 detail: str = "") -> GateCheckRecord:
    """measured <= threshold, with missing / non-finite / impossible values failing."""
    if measured is None:
        return GateCheckRecord(name, threshold, None, False, f"missing: not measured {detail}".strip())
    if not math.isfinite(measured):
        return GateCheckRecord(name, threshold, float(measured), False, f"not finite {detail}".strip())
    if not low <= measured <= high:
        return GateCheckRecord(name, threshold, float(measured), False, f"out of range [{low}, {high}] {detail}".strip())
    return GateCheckRecord(name, threshold, float(measured), measured <= threshold, detail)


def target_check(c: CandidateMetrics, policy: ReleasePolicy) -> GateCheckRecord:
    name, need = "target_gain_vs_champion", float(policy.min_target_gain)
    if c.target_solved is None or c.champion_solved is None:
        return GateCheckRecord(name, need, None, False, "missing: target score of candidate or champion not measured")
    if not (0 <= c.target_solved <= c.target_total and 0 <= c.champion_solved <= c.target_total):
        return GateCheckRecord(name, need, float(c.target_solved - c.champion_solved), False,
                               f"out of range: solved {c.target_solved} / champion {c.champion_solved} of {c.target_total}")
    gain = c.target_solved - c.champion_solved
    return GateCheckRecord(name, need, float(gain), gain >= need,
                           f"solved {c.target_solved}/{c.target_total} vs champion {c.champion_solved}/{c.target_total}")


def kl_checks(c: CandidateMetrics, policy: ReleasePolicy) -> list[GateCheckRecord]:
    out = []
    for which, limits in (("kl_vs_champion", policy.max_kl_vs_champion), ("kl_vs_base", policy.max_kl_vs_base)):
        for domain, limit in sorted(limits.items()):
            value = getattr(c, which).get(domain)
            check = _upper_check(f"{which}[{domain}]", limit, value, -KL_TOLERANCE, detail="nats/token")
            out.append(check)
    return out


def nfr_checks(c: CandidateMetrics, policy: ReleasePolicy) -> list[GateCheckRecord]:
    out, nfr = [], policy.nfr
    label = f"{'Wilson' if nfr.bound == 'wilson' else 'Clopper-Pearson'} {nfr.confidence:.0%} upper bound"
    for which, limits in (("vs_champion", nfr.max_vs_champion), ("vs_base", nfr.max_vs_base)):
        for domain, limit in sorted(limits.items()):
            flips = getattr(c, f"flips_{which}").get(domain)
            name = f"nfr_upper_{which}[{domain}]"
            if flips is None or flips.n <= 0:
                out.append(GateCheckRecord(name, limit, None, False, "missing: no answers to compare"))
                continue
            if not 0 <= flips.F <= flips.n or flips.F + flips.G + flips.W > flips.n:
                out.append(GateCheckRecord(name, limit, math.nan, False, f"out of range: F={flips.F} of n={flips.n}"))
                continue
            upper = nfr.upper(flips.F, flips.n)
            out.append(_upper_check(name, limit, upper, 0.0, 1.0,
                                    f"{label}; F={flips.F}/{flips.n} (observed NFR {flips.F / flips.n:.3f})"))
    return out


def churn_check(c: CandidateMetrics, policy: ReleasePolicy) -> list[GateCheckRecord]:
    if policy.max_csqa_choice_churn is None:
        return []
    return [_upper_check("csqa_choice_churn_vs_champion", policy.max_csqa_choice_churn, c.csqa_choice_churn, 0.0, 1.0,
                         "share of questions whose chosen option changed")]


def finite_check(c: CandidateMetrics) -> GateCheckRecord:
    """No NaN/inf anywhere among the candidate's measured numbers."""
    values = {"target_solved": c.target_solved, "csqa_choice_churn": c.csqa_choice_churn}
    values |= {f"kl_vs_base[{d}]": v for d, v in c.kl_vs_base.items()}
    values |= {f"kl_vs_champion[{d}]": v for d, v in c.kl_vs_champion.items()}
    bad = sorted(k for k, v in values.items() if v is not None and not math.isfinite(v))
    return GateCheckRecord("all_metrics_finite", 0.0, float(len(bad)), not bad,
                           f"non-finite: {', '.join(bad)}" if bad else "no NaN/inf")


def run_checks(c: CandidateMetrics, policy: ReleasePolicy) -> list[GateCheckRecord]:
    return [target_check(c, policy), *kl_checks(c, policy), *nfr_checks(c, policy), *churn_check(c, policy),
            finite_check(c)]


def passed(checks: list[GateCheckRecord]) -> bool:
    return bool(checks) and all(ch.passed for ch in checks)


def select(candidates: list[CandidateMetrics], verdicts: dict[int, bool], policy: ReleasePolicy) -> Optional[CandidateMetrics]:
    """The passing candidate with the lowest retained KL (all passing ones reach the required
    target score); ties go to the other KL, then the higher target score, then the older version."""
    primary, secondary = (("kl_vs_champion", "kl_vs_base") if policy.selection == "lowest-kl-vs-champion"
                          else ("kl_vs_base", "kl_vs_champion"))
    ok = [c for c in candidates if verdicts.get(c.version_id)]
    if not ok:
        return None
    return min(ok, key=lambda c: (c.mean_kl(primary), c.mean_kl(secondary), -(c.target_solved or 0), c.version_id))
