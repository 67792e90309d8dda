"""Gate checks of one candidate against a release policy, and the choice among passing ones.

Fail closed: a metric that is missing, NaN, infinite or outside its possible range fails
its check (the detail says which), and a candidate passes only if every check passes.
Every check carries its threshold and measured value so the ledger can show exactly why.
"""
from __future__ import annotations

import math
from numbers import Integral
from dataclasses import dataclass, field, replace
from typing import Optional

from registry import GateCheckRecord

from .policy import ANSWERED, RELEASED, ReleasePolicy

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


@dataclass(frozen=True)
class Regression:
    """A released skill's score, candidate against champion, problem by problem (spec: no-regression).

    `mean_drop` / `sd_drop` are the mean and standard deviation over the n shared problems of
    (champion's value - candidate's value), value = 1 for a solved problem: > 0 means worse."""

    n: int
    champion_score: Optional[float]
    score: Optional[float]
    mean_drop: Optional[float]
    sd_drop: Optional[float]

    def upper(self, confidence: float) -> float:
        """One-sided upper confidence bound of the mean drop (normal approximation)."""
        from statistics import NormalDist

        return self.mean_drop + NormalDist().inv_cdf(confidence) * self.sd_drop / math.sqrt(self.n)


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
    """The taught skill's gain over the champion, in the scorer's units (solved problems, or nats
    for reference-nll, where a drop is a gain)."""
    name, need = "target_gain_vs_champion", float(policy.min_target_gain)
    if c.target_score is None and c.target_solved is not None:  # evaluations stored before scores were recorded
        c = replace(c, target_score=float(c.target_solved),
                    champion_score=None if c.champion_solved is None else float(c.champion_solved))
    if c.target_score is None or c.champion_score is None:
        return GateCheckRecord(name, need, None, False, "missing: target score of candidate or champion not measured")
    if not (math.isfinite(c.target_score) and math.isfinite(c.champion_score)):
        return GateCheckRecord(name, need, math.nan, False, "not finite: target score of candidate or champion")
    for who, solved in (("candidate", c.target_solved), ("champion", c.champion_solved)):
        if solved is not None and not (isinstance(solved, Integral) and 0 <= solved <= c.target_total):
            return GateCheckRecord(name, need, float(c.target_score - c.champion_score), False,
                                   f"out of range: {who} solved {solved} of {c.target_total}")
    gain = (c.target_score - c.champion_score) * (1 if c.higher_is_better else -1)
    unit = "" if c.higher_is_better else " (lower is better)"
    return GateCheckRecord(name, need, float(gain), gain >= need,
                           f"score {c.target_score:g} vs champion {c.champion_score:g}{unit}; "
                           f"solved {c.target_solved}/{c.target_total}")


def _watched(limits: dict, domains: Optional[list[str]]) -> list[tuple[str, float]]:
    """(domain, limit) to check: the cycle's watched domains (a limit the policy lacks is NaN and
    fails closed), or every domain the policy names when the watched set is not given. A shared
    policy may name domains another cycle does not watch; those are not this cycle's checks."""
    if domains is None:
        return sorted((d, v) for d, v in limits.items() if d != RELEASED)
    return [(d, limits.get(d, math.nan)) for d in sorted(domains)]


def kl_checks(c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None) -> list[GateCheckRecord]:
    """Retained KL on every configured domain (vs champion and vs base) and on every released
    skill (vs champion only: a released skill moved away from the base by design)."""
    out = []
    for which, limits in (("kl_vs_champion", policy.max_kl_vs_champion), ("kl_vs_base", policy.max_kl_vs_base)):
        for domain, limit in _watched(limits, domains):
            value = getattr(c, which).get(domain)
            check = _upper_check(f"{which}[{domain}]", limit, value, -KL_TOLERANCE, detail="nats/token")
            out.append(check)
    for skill in sorted(c.released):
        limit = policy.max_kl_vs_champion.get(skill, policy.max_kl_vs_champion.get(RELEASED, math.nan))
        out.append(_upper_check(f"kl_vs_champion[{skill}]", limit, c.kl_vs_champion.get(skill), -KL_TOLERANCE,
                                detail="nats/token (released skill)"))
    return out


def no_regression_checks(c: CandidateMetrics, policy: ReleasePolicy) -> list[GateCheckRecord]:
    """Every released skill keeps its target score: the one-sided upper bound of the mean
    per-problem drop against the champion must not exceed the skill's tolerance."""
    out = []
    for skill, r in sorted(c.released.items()):
        limits = policy.no_regression.get(skill, policy.no_regression.get(RELEASED))
        name = f"no_regression[{skill}]"
        if limits is None:
            out.append(GateCheckRecord(name, math.nan, None, False, "missing: the policy sets no tolerance for it"))
            continue
        if r.n <= 0 or r.mean_drop is None or r.sd_drop is None:
            out.append(GateCheckRecord(name, limits.tolerance, None, False, "missing: no shared problems scored"))
            continue
        upper = r.upper(limits.confidence)
        out.append(_upper_check(name, limits.tolerance, upper, -math.inf, math.inf,
                                f"{limits.confidence:.0%} upper bound of the mean drop per problem; score "
                                f"{r.score:g} vs champion {r.champion_score:g} on {r.n} problems"))
    return out


def nfr_checks(c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None) -> list[GateCheckRecord]:
    out, nfr = [], policy.nfr
    label = f"{'Wilson' if nfr.bound == 'wilson' else 'Clopper-Pearson'} {nfr.confidence:.0%} upper bound"
    answered = None if domains is None else [d for d in domains if d in ANSWERED]
    for which, limits in (("vs_champion", nfr.max_vs_champion), ("vs_base", nfr.max_vs_base)):
        for domain, limit in _watched(limits, answered):
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


def churn_check(c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None) -> list[GateCheckRecord]:
    if policy.max_csqa_choice_churn is None or (domains is not None and "csqa" not in domains):
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


def run_checks(c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None) -> list[GateCheckRecord]:
    """Every check of the policy; `domains`: the configured retained domains the cycle watches.
    Never raises: a family of checks that cannot be computed on these values is one failed check."""
    families = [("target_gain_vs_champion", lambda: [target_check(c, policy)]),
                ("kl", lambda: kl_checks(c, policy, domains)), ("no_regression", lambda: no_regression_checks(c, policy)),
                ("nfr", lambda: nfr_checks(c, policy, domains)), ("csqa_choice_churn", lambda: churn_check(c, policy, domains)),
                ("all_metrics_finite", lambda: [finite_check(c)])]
    out = []
    for name, checks in families:
        try:
            out += checks()
        except Exception as e:  # fail closed, with the reason recorded
            out.append(GateCheckRecord(name, None, None, False, f"could not be computed: {type(e).__name__}: {e}"))
    return out


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
