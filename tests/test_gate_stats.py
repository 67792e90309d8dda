"""The gate's statistics (evaluation/stats.py) against scipy references, the no-regression check
on hand-made paired answers, infeasible policies refused at load, and old stored evaluations."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest
from scipy import stats as sps

from atlas_core.typed_config import ConfigError, build
from evaluation.scorer_base import TargetScorer
from evaluation.stats import clopper_pearson_upper, mcnemar_exact_p, min_n_for_zero, t_upper, wilson_upper
from flows.gates import no_regression_checks, passed, run_checks
from flows.metrics import CandidateMetrics, Regression
from flows.policy import NoRegression, ReleasePolicy, load_policy
from registry import AnswerRecord, Flips
from tests.flows_fixtures import PASSING_POLICY, stored_metrics_from, write_yaml

CONFIDENCES = (0.8, 0.9, 0.95, 0.99)


# ------------------------------------------------------------------------ the bounds vs references
def test_rate_bounds_match_scipy_binomtest_on_a_grid():
    """A one-sided bound at c is the upper end of the two-sided interval at level 2c - 1."""
    for n in (*range(1, 41), 64, 100, 224, 1319):
        for k in sorted({*range(0, min(n, 40) + 1), n // 2, n - 1, n}):
            for c in CONFIDENCES:
                ci = sps.binomtest(k, n).proportion_ci
                assert clopper_pearson_upper(k, n, c) == pytest.approx(
                    ci(confidence_level=2 * c - 1, method="exact").high, rel=1e-9, abs=1e-12
                ), (k, n, c)
                assert clopper_pearson_upper(k, n, c) == pytest.approx(
                    1.0 if k == n else sps.beta.ppf(c, k + 1, n - k), rel=1e-9, abs=1e-12
                ), (k, n, c)
                assert wilson_upper(k, n, c) == pytest.approx(
                    ci(confidence_level=2 * c - 1, method="wilson").high, rel=1e-9, abs=1e-12
                ), (k, n, c)


def test_mcnemar_exact_p_matches_scipy_binomtest():
    for lost in range(0, 31):
        for gained in range(0, 31):
            expected = 1.0 if lost + gained == 0 else sps.binomtest(lost, lost + gained, 0.5).pvalue
            assert mcnemar_exact_p(lost, gained) == pytest.approx(expected, rel=1e-9, abs=1e-300), (lost, gained)
    assert mcnemar_exact_p(3, 0) == 0.25 and mcnemar_exact_p(0, 0) == 1.0


def test_t_upper_matches_the_student_t_quantile_and_a_one_sided_t_test():
    import numpy as np

    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 8, 13, 32, 64, 200):
        for c in CONFIDENCES:
            x = rng.normal(0.1, 0.3, n)
            mean, sd = float(x.mean()), float(x.std(ddof=1))  # SAMPLE sd
            upper = t_upper(mean, sd, n, c)
            assert upper == pytest.approx(mean + sps.t.ppf(c, n - 1) * sd / math.sqrt(n), rel=1e-9), (n, c)
            # The bound is where a one-sided t-test of "mean >= upper" has p-value exactly 1 - c.
            assert sps.ttest_1samp(x, upper, alternative="less").pvalue == pytest.approx(1 - c, rel=1e-6), (n, c)
    assert t_upper(0.0, 0.0, 8) == 0.0


def test_min_n_for_zero_is_the_first_n_whose_zero_event_bound_meets_the_limit():
    for bound, upper in (("clopper-pearson", clopper_pearson_upper), ("wilson", wilson_upper)):
        for limit in (0.001, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.25, 0.45, 0.6, 0.95, 0.99):
            for c in CONFIDENCES:
                n = min_n_for_zero(limit, c, bound)
                assert upper(0, n, c) <= limit, (bound, limit, c)
                assert n == 1 or upper(0, n - 1, c) > limit, (bound, limit, c)
        assert min_n_for_zero(0.0, 0.95, bound) is None  # a bound is > 0 at every n: a zero limit is unprovable
        assert min_n_for_zero(1.0, 0.95, bound) == 1
    # The issue's example: NFR <= 0.03 at 95%.
    assert (min_n_for_zero(0.03, 0.95, "clopper-pearson"), min_n_for_zero(0.03, 0.95, "wilson")) == (99, 88)
    assert clopper_pearson_upper(0, 16) == pytest.approx(0.1707, abs=1e-4)
    with pytest.raises(ValueError, match="bound: expected one of"):
        min_n_for_zero(0.1, 0.95, "normal")


@pytest.mark.parametrize(
    "k, n",
    [(-1, 10), (11, 10), (0, 0), (True, 10), (1, True), (1.0, 10), (1, 10.0), (None, 10), ("1", 10), (math.nan, 10)],
)
def test_impossible_counts_give_nan(k, n):
    assert math.isnan(clopper_pearson_upper(k, n)) and math.isnan(wilson_upper(k, n))


def test_mcnemar_and_t_refuse_impossible_inputs():
    for lost, gained in ((-1, 0), (0, -2), (True, 0), (1.0, 2), (None, 1)):
        assert math.isnan(mcnemar_exact_p(lost, gained)), (lost, gained)
    for mean, sd, n, c in (
        (0.1, 0.2, 1, 0.95),
        (0.1, 0.2, 0, 0.95),
        (0.1, 0.2, True, 0.95),
        (0.1, 0.2, 8.0, 0.95),
        (0.1, -0.2, 8, 0.95),
        (math.nan, 0.2, 8, 0.95),
        (0.1, math.inf, 8, 0.95),
        (None, 0.2, 8, 0.95),
        (0.1, 0.2, 8, 1.0),
        (0.1, 0.2, 8, 0.0),
    ):
        assert math.isnan(t_upper(mean, sd, n, c)), (mean, sd, n, c)


# ------------------------------------------------------------------------ no-regression on paired answers
class PassFail(TargetScorer):
    name, dataset, aggregate = "test-pass-fail", "test-pass-fail", "sum"


class MeanNll(TargetScorer):
    name, dataset, aggregate, higher_is_better = "test-nll", "test-nll", "mean", False


def answers(solved: list[bool]) -> dict:
    return {f"q{i}": AnswerRecord("d", f"q{i}", "pass" if s else "fail", s) for i, s in enumerate(solved)}


def nll_answers(values: list[float]) -> dict:
    return {f"q{i}": AnswerRecord("d", f"q{i}", f"{v:.6f}", True) for i, v in enumerate(values)}


def paired(n: int, lost: int, gained: int, solved_by_both: int = 5) -> Regression:
    """A released pass/fail skill on n problems: the champion solves `lost` + `solved_by_both`, the
    candidate `gained` + `solved_by_both`, on disjoint problems."""
    from flows.evaluate import regression

    champion = [i < lost + solved_by_both for i in range(n)]
    candidate = [
        lost <= i < lost + solved_by_both or lost + solved_by_both <= i < lost + solved_by_both + gained
        for i in range(n)
    ]
    return regression(PassFail(), answers(champion), answers(candidate))


def check(r: Regression, **limits):
    policy = build(ReleasePolicy, PASSING_POLICY | {"no_regression": {"released": limits}})
    metrics = CandidateMetrics(
        version_id=1,
        name="v1",
        method="atlas",
        seed=0,
        epoch=1,
        step=1,
        target_solved=None,
        target_total=0,
        champion_solved=None,
        released={"skill": r},
    )
    (result,) = no_regression_checks(metrics, policy)
    return result


def test_paired_answers_give_exact_counts():
    r = paired(32, lost=3, gained=1)
    assert (r.kind, r.n, r.lost, r.gained) == ("pass-fail", 32, 3, 1)
    assert (r.champion_score, r.score) == (8.0, 6.0) and r.mean_drop == pytest.approx(2 / 32)
    assert r.sd_drop == pytest.approx(sps.tstd([1, 1, 1, -1] + [0] * 28))  # the SAMPLE sd


def test_losing_3_of_32_problems_is_rejected():
    # 0.05 cannot be proved on 32 problems at all (0 lost gives 0.089): unprovable, with the n needed.
    strict = check(paired(32, lost=3, gained=0), tolerance=0.05)
    assert not strict.passed and "unprovable at n=32" in strict.detail and "needs n >= 59" in strict.detail
    # At a provable tolerance the exact bound rejects: CP(3 of 32) = 0.229 > 0.15. Three lost and three
    # gained leave the mean drop at 0: the normal approximation gave 0.126 and passed this.
    r = paired(32, lost=3, gained=3)
    result = check(r, tolerance=0.15)
    assert not result.passed and result.measured == pytest.approx(sps.beta.ppf(0.95, 4, 29), rel=1e-9)
    for text in (
        "lost 3",
        "gained 3",
        "on 32 problems",
        f"McNemar p={sps.binomtest(3, 6).pvalue:.3g}",
        "Clopper-Pearson 95%",
    ):
        assert text in result.detail, (text, result.detail)


def test_losing_none_of_32_passes_at_tolerance_0_1_and_one_lost_needs_0_15():
    none_lost = check(paired(32, lost=0, gained=2), tolerance=0.1)
    assert none_lost.passed and none_lost.measured == pytest.approx(1 - 0.05 ** (1 / 32), rel=1e-9)  # 0.089
    assert not check(paired(32, lost=1, gained=0), tolerance=0.1).passed  # 0.140
    assert check(paired(32, lost=1, gained=0), tolerance=0.15).passed  # the shipped v2 tolerance
    assert not check(paired(32, lost=2, gained=0), tolerance=0.15).passed  # 0.184


def test_one_problem_or_a_zero_tolerance_is_unprovable():
    one = check(paired(1, lost=0, gained=0, solved_by_both=1), tolerance=0.0)
    assert not one.passed and "unprovable at n=1" in one.detail and "no n can prove a tolerance of 0" in one.detail
    nothing_changed = check(paired(224, lost=0, gained=0), tolerance=0.0)
    assert not nothing_changed.passed and "unprovable at n=224" in nothing_changed.detail
    small = check(paired(1, lost=0, gained=0, solved_by_both=1), tolerance=0.5)
    assert not small.passed and "needs n >= 5" in small.detail  # CP(0 of 1) = 0.95


@pytest.mark.parametrize(
    "r, says",
    [
        (Regression(32, 5.0, 5.0, -2.0, 0.0, "pass-fail", -1, 31), "out of range"),  # a mean drop below -1
        (Regression(32, 5.0, 5.0, 0.0, 0.0, "pass-fail", 20, 20), "out of range"),  # lost + gained > n
        (Regression(32, 5.0, 5.0, 0.0, 0.0, "pass-fail", 1.0, 0), "out of range"),  # not a count
        (Regression(32, 5.0, 5.0, 0.0, 0.0, "pass-fail", True, 0), "out of range"),
        (Regression(32, 5.0, 5.0, 0.0, 0.0, "pass-fail", None, None), "out of range"),
        (Regression(0, None, None, None, None, "pass-fail"), "no shared problems"),
        (Regression(32, 5.0, 5.0, 0.0, 0.0, "binary", 0, 0), "older version"),
    ],
)
def test_impossible_paired_counts_fail_closed(r, says):
    result = check(r, tolerance=1.0)
    assert not result.passed and says in result.detail


def test_a_continuous_skill_is_judged_by_the_t_bound_on_at_least_min_n_problems():
    from flows.evaluate import regression

    champion = [1.40, 1.35, 1.52, 1.47, 1.38, 1.44, 1.50, 1.41, 1.39, 1.46]  # NLL: lower is better
    candidate = [v + d for v, d in zip(champion, (0.02, -0.01, 0.03, 0.00, 0.01, 0.02, -0.02, 0.01, 0.00, 0.03))]
    r = regression(MeanNll(), nll_answers(champion), nll_answers(candidate))
    drops = [-(a - b) for a, b in zip(champion, candidate)]  # > 0: the candidate's NLL went up (worse)
    assert (r.kind, r.n, r.lost, r.gained) == ("continuous", 10, None, None)
    expected = sps.tmean(drops) + sps.t.ppf(0.95, 9) * sps.tstd(drops) / math.sqrt(10)
    result = check(r, tolerance=0.05)
    assert result.passed and result.measured == pytest.approx(expected, rel=1e-6) and "sample sd" in result.detail
    assert not check(r, tolerance=0.01).passed
    few = regression(MeanNll(), nll_answers(champion[:4]), nll_answers(candidate[:4]))
    below = check(few, tolerance=1.0)  # 4 problems, min_n 8 by default
    assert not below.passed and "fewer than min_n=8" in below.detail
    assert check(few, tolerance=1.0, min_n=4).passed
    single = regression(MeanNll(), nll_answers(champion[:1]), nll_answers(candidate[:1]))
    assert single.sd_drop is None and not check(single, tolerance=1.0, min_n=2).passed


# ------------------------------------------------------------------------ infeasible policies
def test_an_nfr_limit_no_outcome_can_meet_is_refused_at_load_in_one_line(tmp_path):
    for bound, need in (("clopper-pearson", 99), ("wilson", 88)):
        nfr = PASSING_POLICY["nfr"] | {"bound": bound, "max_vs_champion": {"gsm8k": 0.03, "csqa": 1.0}}
        path = write_yaml(tmp_path / f"{bound}.yaml", PASSING_POLICY | {"nfr": nfr})
        with pytest.raises(
            ConfigError,
            match=rf"nfr.max_vs_champion.gsm8k: limit 0.03 is unprovable with 16 "
            rf"questions .* needs >= {need} questions",
        ) as e:
            load_policy(path, ["gsm8k", "csqa"], {"gsm8k": 16, "csqa": 128})
        assert "\n" not in str(e.value) and path in str(e.value)
        load_policy(path, ["gsm8k", "csqa"], {"gsm8k": need, "csqa": 128})  # enough questions: accepted
        load_policy(path, ["gsm8k", "csqa"])  # sizes unknown: not judged here


def test_the_update_configs_sizes_are_the_ones_checked(tmp_path):
    from flows.config import load_update_config
    from flows.policy import answered_sizes

    cfg = load_update_config("configs/update/default.yaml")
    assert answered_sizes(cfg) == {"gsm8k": 16, "csqa": 128}
    strict = load_policy("configs/policy/strict.yaml", cfg.domain_names)  # fine at the full test sets ...
    with pytest.raises(ConfigError, match=r"nfr.max_vs_champion.csqa: limit 0.03 is unprovable with 32 .*needs >= 99"):
        strict.require_feasible_answers({"gsm8k": 1319, "csqa": 32})  # ... not on 32 CSQA questions


def test_infeasible_released_tolerances_and_target_gains_are_refused():
    p = build(
        ReleasePolicy,
        PASSING_POLICY
        | {
            "min_target_gain": 5,
            "no_regression": {"code": {"tolerance": 0.1}, "nll": {"tolerance": 1.0}, "released": {"tolerance": 0.0}},
        },
    )
    p.require_feasible_released({"code": ("pass-fail", 29), "nll": ("continuous", 8)})
    with pytest.raises(
        ConfigError,
        match=r"no_regression.code: released skill 'code' \(pass-fail\): tolerance 0.1 "
        r"is unprovable at n=16: .* 0.171; needs n >= 29",
    ):
        p.require_feasible_released({"code": ("pass-fail", 16)})
    with pytest.raises(ConfigError, match=r"no_regression.nll: .*7 problem\(s\), fewer than min_n=8"):
        p.require_feasible_released({"nll": ("continuous", 7)})
    with pytest.raises(ConfigError, match=r"no_regression.released: released skill 'other' .*no n can prove"):
        p.require_feasible_released({"other": ("pass-fail", 10_000)})
    with pytest.raises(ConfigError, match="min_target_gain: 5 solved problems cannot be gained on a target of 4"):
        p.require_feasible_target(4, solved_counts=True)
    p.require_feasible_target(5, solved_counts=True)
    p.require_feasible_target(4, solved_counts=False)  # nats of reference-nll: not a count of problems


def test_min_n_below_two_is_refused(tmp_path):
    path = write_yaml(tmp_path / "p.yaml", PASSING_POLICY | {"no_regression": {"released": {"min_n": 1}}})
    with pytest.raises(ConfigError, match=r"no_regression.released.min_n: expected an integer >= 2, got 1"):
        load_policy(path, ["gsm8k", "csqa"])
    assert NoRegression().min_n == 8


# ------------------------------------------------------------------------ stored evaluations
OLD = {"n": 20, "champion_score": 12.0, "score": 11.0, "mean_drop": 0.05, "sd_drop": 0.2}  # before exact counts


def test_old_stored_regressions_load_and_are_rejected_fail_closed():
    old = Regression(**OLD)
    assert (old.kind, old.lost, old.gained) == (None, None, None) and math.isnan(old.upper(0.95))
    result = check(old, tolerance=1.0)
    assert not result.passed and "older version" in result.detail
    new = paired(32, lost=1, gained=2)
    assert Regression(**asdict(new)) == new  # the ledger round trip (record_candidate -> stored_metrics)


def test_stored_metrics_measures_an_old_evaluation_again(monkeypatch):
    """An evaluation stored before the exact counts is treated as not stored (its answers are, so
    measuring it again is cheap); a new one is read back with its counts."""
    extra = {"eval_key": "k", "released": {"code": OLD}}
    assert stored_metrics_from(monkeypatch, extra) is None
    extra["released"] = {"code": asdict(paired(32, lost=1, gained=2))}
    found = stored_metrics_from(monkeypatch, extra)
    assert found is not None and found.released["code"] == paired(32, lost=1, gained=2)


# ------------------------------------------------------------------------ n = 0 fails closed
def test_a_gate_given_no_answered_questions_never_passes():
    """Flips with n = 0 (nothing compared) have no rates (registry.Flips: None), and the gate reads
    that as not measured: the NFR checks of those domains fail, and so does the choice churn taken
    from them, whatever else passes."""
    watched = ["gsm8k", "csqa"]
    policy = build(ReleasePolicy, PASSING_POLICY)
    good = CandidateMetrics(
        version_id=1,
        name="v1",
        method="atlas",
        seed=0,
        epoch=1,
        step=1,
        target_solved=3,
        target_total=8,
        champion_solved=2,
        kl_vs_base={"gsm8k": 0.01, "csqa": 0.01},
        kl_vs_champion={"gsm8k": 0.01, "csqa": 0.01},
        flips_vs_base={"gsm8k": Flips(20, 0, 1, 1), "csqa": Flips(40, 1, 2, 0)},
        flips_vs_champion={"gsm8k": Flips(20, 0, 0, 1), "csqa": Flips(40, 0, 1, 0)},
        csqa_choice_churn=Flips(40, 0, 1, 0).churn,
        target_score=3.0,
        champion_score=2.0,
    )
    assert passed(run_checks(good, policy, watched))  # the same candidate with answers passes

    none = Flips(n=0, F=0, G=0, W=0)
    assert none.churn is None and none.nfr is None
    nothing = replace(
        good,
        flips_vs_base={d: none for d in watched},
        flips_vs_champion={d: none for d in watched},
        csqa_choice_churn=none.churn,
    )
    checks = run_checks(nothing, policy, watched)
    assert not passed(checks)
    failed = {c.name: c for c in checks if not c.passed}
    for against in ("vs_champion", "vs_base"):
        for d in watched:
            check = failed[f"nfr_upper_{against}[{d}]"]
            assert check.measured is None and check.detail.startswith("missing"), check
    assert failed["csqa_choice_churn_vs_champion"].measured is None
    # One domain without answers is enough to fail.
    one = replace(good, flips_vs_champion=good.flips_vs_champion | {"gsm8k": none})
    assert not passed(run_checks(one, policy, watched))
