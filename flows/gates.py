"""Gate checks of one candidate against a release policy, and the choice among passing ones.

Fail closed: a metric that is missing, NaN, infinite or outside its possible range fails
its check (the detail says which), and a candidate passes only if every check passes.
Every check carries its threshold and measured value so the ledger can show exactly why.
"""

from __future__ import annotations

import math
from dataclasses import replace
from numbers import Integral
from typing import Optional

from evaluation.stats import is_count, mcnemar_exact_p
from registry import GateCheckRecord

from .metrics import CandidateMetrics, Regression, finite
from .policy import ANSWERED, CONTINUOUS, PASS_FAIL, RELEASED, NoRegression, ReleasePolicy

KL_TOLERANCE = 1e-6  # KL is >= 0 in exact arithmetic; fp32 rounding can dip a hair below

# `Flips` (registry.Flips) is the one flip record; its rates are None when n = 0, which every check
# here reads as not measured (fail closed).


def _upper_check(
    name: str, threshold: float, measured, low: float, high: float = math.inf, detail: str = ""
) -> GateCheckRecord:
    """measured <= threshold, with missing / non-finite / impossible values failing."""
    if measured is None:
        return GateCheckRecord(
            name=name,
            threshold=threshold,
            measured=None,
            passed=False,
            detail=f"missing: not measured {detail}".strip(),
        )
    if not math.isfinite(measured):
        return GateCheckRecord(
            name=name,
            threshold=threshold,
            measured=float(measured),
            passed=False,
            detail=f"not finite {detail}".strip(),
        )
    if not low <= measured <= high:
        return GateCheckRecord(
            name=name,
            threshold=threshold,
            measured=float(measured),
            passed=False,
            detail=f"out of range [{low}, {high}] {detail}".strip(),
        )
    return GateCheckRecord(
        name=name, threshold=threshold, measured=float(measured), passed=measured <= threshold, detail=detail
    )


def target_check(c: CandidateMetrics, policy: ReleasePolicy) -> GateCheckRecord:
    """The taught skill's gain over the champion, in the scorer's units (solved problems, or nats
    for reference-nll, where a drop is a gain)."""
    name, need = "target_gain_vs_champion", float(policy.min_target_gain)
    if c.target_score is None and c.target_solved is not None:  # evaluations stored before scores were recorded
        c = replace(
            c,
            target_score=float(c.target_solved),
            champion_score=None if c.champion_solved is None else float(c.champion_solved),
        )
    if c.target_score is None or c.champion_score is None:
        return GateCheckRecord(
            name=name,
            threshold=need,
            measured=None,
            passed=False,
            detail="missing: target score of candidate or champion not measured",
        )
    if not (math.isfinite(c.target_score) and math.isfinite(c.champion_score)):
        return GateCheckRecord(
            name=name,
            threshold=need,
            measured=math.nan,
            passed=False,
            detail="not finite: target score of candidate or champion",
        )
    for who, solved in (("candidate", c.target_solved), ("champion", c.champion_solved)):
        if solved is not None and not (isinstance(solved, Integral) and 0 <= solved <= c.target_total):
            return GateCheckRecord(
                name=name,
                threshold=need,
                measured=float(c.target_score - c.champion_score),
                passed=False,
                detail=f"out of range: {who} solved {solved} of {c.target_total}",
            )
    gain = (c.target_score - c.champion_score) * (1 if c.higher_is_better else -1)
    unit = "" if c.higher_is_better else " (lower is better)"
    return GateCheckRecord(
        name=name,
        threshold=need,
        measured=float(gain),
        passed=gain >= need,
        detail=f"score {c.target_score:g} vs champion {c.champion_score:g}{unit}; "
        f"solved {c.target_solved}/{c.target_total}",
    )


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
        out.append(
            _upper_check(
                f"kl_vs_champion[{skill}]",
                limit,
                c.kl_vs_champion.get(skill),
                -KL_TOLERANCE,
                detail="nats/token (released skill)",
            )
        )
    return out


def kl_tail_checks(
    c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None
) -> list[GateCheckRecord]:
    """The policy's optional limits on the tail of per-context KL (p95, p99, max over a member's
    contexts: flows/kl_tail.py): on the watched domains it names, vs champion and vs base, and on
    every released skill vs the champion (key 'released': those not named). Unlike the mean's
    limits a domain without one is not checked; a limit whose tail was not measured fails."""
    out = []
    for against, limits in (("vs_champion", policy.max_kl_tail_vs_champion), ("vs_base", policy.max_kl_tail_vs_base)):
        members = [
            (d, stats)
            for d, stats in sorted(limits.items())
            if d != RELEASED and d not in c.released and (domains is None or d in domains)
        ]
        if against == "vs_champion":
            members += [(skill, limits.get(skill, limits.get(RELEASED, {}))) for skill in sorted(c.released)]
        for member, stats in members:
            tail = c.kl_tail.get(against, {}).get(member)
            detail = (
                f"over {tail.contexts} contexts, nats/token"
                if tail is not None
                else "(no per-context KL stored with this evaluation)"
            )
            for stat, limit in stats.items():
                out.append(
                    _upper_check(
                        f"kl_{stat}_{against}[{member}]",
                        limit,
                        None if tail is None else getattr(tail, stat),
                        -KL_TOLERANCE,
                        detail=detail,
                    )
                )
    return out


def _num(v) -> str:
    return f"{v:g}" if finite(v) else str(v)


def regression_check(name: str, r: Regression, limits: NoRegression) -> GateCheckRecord:
    """One released skill against its tolerance. Pass/fail: the exact (Clopper-Pearson) upper
    bound of lost/n; continuous: mean + t * sample sd / sqrt(n). Unknown kind, no shared problems,
    impossible counts, or a tolerance no outcome could meet at this n: rejected, saying which."""
    tol, conf = limits.tolerance, limits.confidence
    if r.kind not in (PASS_FAIL, CONTINUOUS):
        return GateCheckRecord(
            name=name,
            threshold=tol,
            measured=None,
            passed=False,
            detail="missing: stored without the exact paired counts (evaluated by an older version); evaluate it again",
        )
    if not is_count(r.n) or r.n <= 0:
        return GateCheckRecord(
            name=name,
            threshold=tol,
            measured=None,
            passed=False,
            detail=f"missing: no shared problems scored (n={r.n})",
        )
    scores = f"score {_num(r.score)} vs champion {_num(r.champion_score)}"
    if r.kind == PASS_FAIL:
        if not (is_count(r.lost) and is_count(r.gained) and r.lost >= 0 and r.gained >= 0 and r.lost + r.gained <= r.n):
            return GateCheckRecord(
                name=name,
                threshold=tol,
                measured=math.nan,
                passed=False,
                detail=f"out of range: lost={r.lost}, gained={r.gained} of n={r.n}",
            )
        detail = (
            f"Clopper-Pearson {conf:.0%} upper bound of the share lost; lost {r.lost}, gained {r.gained} "
            f"on {r.n} problems (exact McNemar p={mcnemar_exact_p(r.lost, r.gained):.3g}); {scores}"
        )
        low, high = 0.0, 1.0
    else:
        detail = (
            f"t {conf:.0%} upper bound of the mean drop per problem (mean {_num(r.mean_drop)}, sample sd "
            f"{_num(r.sd_drop)}) on {r.n} problems; {scores}"
        )
        low, high = -math.inf, math.inf
    upper = r.upper(conf)
    unprovable = limits.infeasible(r.kind, r.n)
    if unprovable:
        return GateCheckRecord(
            name=name,
            threshold=tol,
            measured=upper if math.isfinite(upper) else None,
            passed=False,
            detail=f"{unprovable}; {detail}",
        )
    return _upper_check(name, tol, upper, low, high, detail)


def no_regression_checks(c: CandidateMetrics, policy: ReleasePolicy) -> list[GateCheckRecord]:
    """Every released skill keeps its target score: the one-sided upper bound of its loss
    against the champion (regression_check) must not exceed the skill's tolerance."""
    out = []
    for skill, r in sorted(c.released.items()):
        limits = policy.no_regression.get(skill, policy.no_regression.get(RELEASED))
        name = f"no_regression[{skill}]"
        if limits is None:
            out.append(
                GateCheckRecord(
                    name=name,
                    threshold=math.nan,
                    measured=None,
                    passed=False,
                    detail="missing: the policy sets no tolerance for it",
                )
            )
            continue
        out.append(regression_check(name, r, limits))
    return out


def nfr_checks(
    c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None
) -> list[GateCheckRecord]:
    out, nfr = [], policy.nfr
    label = f"{'Wilson' if nfr.bound == 'wilson' else 'Clopper-Pearson'} {nfr.confidence:.0%} upper bound"
    answered = None if domains is None else [d for d in domains if d in ANSWERED]
    for which, limits in (("vs_champion", nfr.max_vs_champion), ("vs_base", nfr.max_vs_base)):
        for domain, limit in _watched(limits, answered):
            flips = getattr(c, f"flips_{which}").get(domain)
            name = f"nfr_upper_{which}[{domain}]"
            if flips is None or flips.nfr is None:  # n = 0: nothing compared, no rate (fail closed)
                out.append(
                    GateCheckRecord(
                        name=name, threshold=limit, measured=None, passed=False, detail="missing: no answers to compare"
                    )
                )
                continue
            if not 0 <= flips.F <= flips.n or flips.F + flips.G + flips.W > flips.n:
                out.append(
                    GateCheckRecord(
                        name=name,
                        threshold=limit,
                        measured=math.nan,
                        passed=False,
                        detail=f"out of range: F={flips.F} of n={flips.n}",
                    )
                )
                continue
            detail = f"{label}; F={flips.F}/{flips.n} (observed NFR {flips.F / flips.n:.3f})"
            counted = flips.F
            if which == "vs_champion":  # the champion's own decoding noise (flows/noise_floor.py)
                floor = c.flips_floor.get(domain)
                if floor is not None and floor.n == flips.n:
                    detail += (
                        f"; noise floor F={floor.F} G={floor.G} W={floor.W} (champion re-decoded in another batching)"
                    )
                    counted = max(flips.F - floor.F, 0) if nfr.above_floor else flips.F
                elif nfr.above_floor:
                    out.append(
                        GateCheckRecord(
                            name=name,
                            threshold=limit,
                            measured=None,
                            passed=False,
                            detail="missing: the noise floor was not measured on these questions (nfr.above_floor)",
                        )
                    )
                    continue
                if nfr.above_floor:
                    detail += f"; judged on the {counted} flip(s) above the floor"
            out.append(_upper_check(name, limit, nfr.upper(counted, flips.n), 0.0, 1.0, detail))
    return out


def churn_check(
    c: CandidateMetrics, policy: ReleasePolicy, domains: Optional[list[str]] = None
) -> list[GateCheckRecord]:
    if policy.max_csqa_choice_churn is None or (domains is not None and "csqa" not in domains):
        return []
    return [
        _upper_check(
            "csqa_choice_churn_vs_champion",
            policy.max_csqa_choice_churn,
            c.csqa_choice_churn,
            0.0,
            1.0,
            "share of questions whose chosen option changed",
        )
    ]


def finite_check(c: CandidateMetrics) -> GateCheckRecord:
    """No NaN/inf anywhere among the candidate's measured numbers."""
    values = {"target_solved": c.target_solved, "csqa_choice_churn": c.csqa_choice_churn}
    values |= {f"kl_vs_base[{d}]": v for d, v in c.kl_vs_base.items()}
    values |= {f"kl_vs_champion[{d}]": v for d, v in c.kl_vs_champion.items()}
    bad = sorted(k for k, v in values.items() if v is not None and not math.isfinite(v))
    return GateCheckRecord(
        name="all_metrics_finite",
        threshold=0.0,
        measured=float(len(bad)),
        passed=not bad,
        detail=f"non-finite: {', '.join(bad)}" if bad else "no NaN/inf",
    )


def candidates_check(failed: dict[str, str], total: int, policy: ReleasePolicy) -> GateCheckRecord:
    """The cycle's other candidates finished (`failed`: candidate -> why not, of `total`): with
    candidates.require_all a failure rejects every candidate (the cycle decides on all it was
    told to train, or on none); without it the gate decides among those that finished."""
    require = policy.candidates.require_all
    why = "; ".join(f"{name}: {reason}" for name, reason in failed.items())
    verdict = "the cycle is rejected (candidates.require_all)" if require else "the gate decides among the others"
    return GateCheckRecord(
        name="all_candidates_finished",
        threshold=0.0 if require else None,
        measured=float(len(failed)),
        passed=not (failed and require),
        detail=f"{len(failed)} of {total} candidates failed ({why}): {verdict}" if failed else f"all {total} finished",
    )


def run_checks(
    c: CandidateMetrics,
    policy: ReleasePolicy,
    domains: Optional[list[str]] = None,
    failed: Optional[dict[str, str]] = None,
    total: int = 0,
) -> list[GateCheckRecord]:
    """Every check of the policy; `domains`: the configured retained domains the cycle watches;
    `failed`: the cycle's candidates that did not finish (of `total`), checked only when there are any.
    Never raises: a family of checks that cannot be computed on these values is one failed check."""
    families = [
        ("target_gain_vs_champion", lambda: [target_check(c, policy)]),
        ("kl", lambda: kl_checks(c, policy, domains)),
        ("kl_tail", lambda: kl_tail_checks(c, policy, domains)),
        ("no_regression", lambda: no_regression_checks(c, policy)),
        ("nfr", lambda: nfr_checks(c, policy, domains)),
        ("csqa_choice_churn", lambda: churn_check(c, policy, domains)),
        ("all_metrics_finite", lambda: [finite_check(c)]),
    ]
    if failed:
        families.append(("all_candidates_finished", lambda: [candidates_check(failed, total, policy)]))
    out = []
    for name, checks in families:
        try:
            out += checks()
        except Exception as e:  # fail closed, with the reason recorded
            out.append(
                GateCheckRecord(
                    name=name,
                    threshold=None,
                    measured=None,
                    passed=False,
                    detail=f"could not be computed: {type(e).__name__}: {e}",
                )
            )
    return out


def passed(checks: list[GateCheckRecord]) -> bool:
    return bool(checks) and all(ch.passed for ch in checks)


def select(
    candidates: list[CandidateMetrics], verdicts: dict[int, bool], policy: ReleasePolicy
) -> Optional[CandidateMetrics]:
    """The passing candidate with the lowest retained KL (all passing ones reach the required
    target score); ties go to the other KL, then the higher target score, then the older version."""
    primary, secondary = (
        ("kl_vs_champion", "kl_vs_base")
        if policy.selection == "lowest-kl-vs-champion"
        else ("kl_vs_base", "kl_vs_champion")
    )
    ok = [c for c in candidates if verdicts.get(c.version_id)]
    if not ok:
        return None
    return min(ok, key=lambda c: (c.mean_kl(primary), c.mean_kl(secondary), -(c.target_solved or 0), c.version_id))
