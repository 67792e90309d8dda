"""Release policies, confidence bounds, gate checks and update configs: pure logic, no Prefect."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from atlas_core.typed_config import ConfigError, build
from flows.config import load_update_config
from flows.gates import passed, run_checks, select
from flows.metrics import CandidateMetrics
from flows.policy import ReleasePolicy, answered_sizes, clopper_pearson_upper, load_policy, wilson_upper
from registry import Flips
from tests.flows_fixtures import PASSING_POLICY, write_yaml

DOMAINS = ["gsm8k", "csqa"]


def policy(**changes) -> ReleasePolicy:
    return build(
        ReleasePolicy,
        PASSING_POLICY
        | {
            "min_target_gain": 1,
            "max_kl_vs_champion": {"gsm8k": 0.05, "csqa": 0.05},
            "max_kl_vs_base": {"gsm8k": 0.1, "csqa": 0.1},
        }
        | changes,
    )


def candidate(**changes) -> CandidateMetrics:
    base = dict(
        version_id=7,
        name="v7",
        method="atlas",
        seed=0,
        epoch=2,
        step=8,
        target_solved=3,
        target_total=8,
        champion_solved=2,
        kl_vs_base={"gsm8k": 0.02, "csqa": 0.03},
        kl_vs_champion={"gsm8k": 0.01, "csqa": 0.02},
        flips_vs_base={"gsm8k": Flips(20, 0, 1, 1), "csqa": Flips(40, 1, 2, 0)},
        flips_vs_champion={"gsm8k": Flips(20, 0, 0, 1), "csqa": Flips(40, 0, 1, 0)},
        csqa_choice_churn=0.025,
    )
    return CandidateMetrics(**(base | changes))


def test_shipped_policies_and_configs_validate():
    for name in ("default", "strict"):
        p = load_policy(f"configs/policy/{name}.yaml", DOMAINS)
        assert p.label.startswith(f"{name}@")
    for name in ("default", "ci"):
        assert load_update_config(f"configs/update/{name}.yaml").retained.domains == DOMAINS
    # Every shipped update config with the policy it runs under: watched domains and released skills covered.
    # Their thresholds are provable at the config's sizes: NFR at its question counts, no-regression at
    # the released skill's problems (v1's MBPP+ 32; code-ci's 4), the target gain at the target's problems.
    for config, policy_name, released, target in (
        ("default", "default", {}, 32),
        ("gsm8k-format", "gsm8k-format", {"code": ("pass-fail", 32)}, None),
        ("ci", "ci", {}, 4),
        ("ci-v2", "ci", {"code-ci": ("pass-fail", 4)}, None),
        ("gpu", "strict", {}, 224),
    ):
        cfg = load_update_config(f"configs/update/{config}.yaml")
        p = load_policy(f"configs/policy/{policy_name}.yaml", cfg.domain_names, answered_sizes(cfg))
        p.require_released(list(released))
        p.require_feasible_released(released)
        if target is not None:
            p.require_feasible_target(target, solved_counts=True)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"min_target_gain": "one"}, "min_target_gain: expected a number"),
        ({"max_kl_vs_base": {"gsm8k": -1.0, "csqa": 0.1}}, "max_kl_vs_base.gsm8k: expected a finite number >= 0"),
        ({"nfr": {"bound": "normal"}}, "nfr.bound: expected one of"),
        ({"nfr": {"max_vs_base": {"gsm8k": 1.5}}}, "nfr.max_vs_base.gsm8k: expected a rate in [0, 1]"),
        ({"candidates": {"methods": []}}, "candidates.methods: expected a non-empty list"),
        ({"max_kl_vs_champoin": {}}, "max_kl_vs_champoin: unknown field"),
    ],
)
def test_policy_errors_name_the_field(tmp_path, changes, message):
    path = write_yaml(tmp_path / "p.yaml", PASSING_POLICY | changes)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_policy(path, DOMAINS)


@pytest.mark.parametrize(
    "candidates, message",
    [
        ({"methods": ["atlas", "atlas"]}, r"candidates.methods\[1\]: 'atlas' is listed twice \(also at index 0\)"),
        ({"methods": ["atlas", ""]}, r"candidates.methods\[1\]: expected the name of a run config"),
        ({"methods": ["../atlas"]}, r"candidates.methods\[0\]: expected the name of a run config"),
        ({"seeds": [0, 1, 1]}, r"candidates.seeds\[2\]: 1 is listed twice \(also at index 1\)"),
        ({"seeds": [-1]}, r"candidates.seeds\[0\]: expected an integer in \[0, 2\*\*31\)"),
        ({"seeds": [2**31]}, r"candidates.seeds\[0\]: expected an integer in \[0, 2\*\*31\)"),
    ],
)
def test_candidates_are_named_by_element(tmp_path, candidates, message):
    path = write_yaml(tmp_path / "p.yaml", PASSING_POLICY | {"candidates": PASSING_POLICY["candidates"] | candidates})
    with pytest.raises(ConfigError, match=message):
        load_policy(path, DOMAINS)


def test_a_cycle_policy_needs_a_run_config_for_every_method(tmp_path):
    from flows.policy import load_cycle_policy
    from tests.flows_fixtures import TINY_CONFIG

    config = load_update_config(write_yaml(tmp_path / "u.yaml", TINY_CONFIG))
    path = write_yaml(tmp_path / "p.yaml", PASSING_POLICY | {"candidates": {"methods": ["atlas", "atlsa"]}})
    with pytest.raises(
        ConfigError,
        match=r"p.yaml: candidates.methods\[1\]: no run config atlsa.yaml in configs/train "
        r"\(train.configs_dir of the update config\); expected one of \[.*'atlas'",
    ):
        load_cycle_policy(path, config)
    assert load_policy(path, DOMAINS).candidates.methods == ["atlas", "atlsa"]  # without a config: not known yet


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "'inf'"])
def test_policy_numbers_must_be_finite(tmp_path, value):
    path = tmp_path / "p.yaml"
    path.write_text(
        Path(write_yaml(path, PASSING_POLICY)).read_text().replace("min_target_gain: 0", f"min_target_gain: {value}")
    )
    with pytest.raises(ConfigError, match="min_target_gain: expected a finite number"):
        load_policy(path, DOMAINS)


def test_policy_must_cover_every_watched_domain(tmp_path):
    path = write_yaml(tmp_path / "p.yaml", PASSING_POLICY | {"max_kl_vs_base": {"gsm8k": 1.0}})
    with pytest.raises(ConfigError, match=r"max_kl_vs_base: no threshold for watched domain\(s\) \['csqa'\]"):
        load_policy(path, DOMAINS)


def test_update_config_errors_name_the_field(tmp_path):
    path = write_yaml(tmp_path / "u.yaml", {"retained": {"kl_contexts": "many"}})
    with pytest.raises(ConfigError, match="retained.kl_contexts: expected an integer, got 'many'"):
        load_update_config(path)
    with pytest.raises(ConfigError, match=r"retained.domains\[1\]: unknown built-in domain 'mmlu'"):
        load_update_config(write_yaml(tmp_path / "d.yaml", {"retained": {"domains": ["gsm8k", "mmlu"]}}))


def test_confidence_bounds():
    # Wilson upper bound, one-sided 95% (z = 1.645), k = 0: z^2 / (n + z^2)
    z2 = 1.6448536269514722**2
    assert wilson_upper(0, 12) == pytest.approx(z2 / (12 + z2))
    # Clopper-Pearson, k = 0: 1 - alpha^(1/n); k = n: 1
    assert clopper_pearson_upper(0, 20) == pytest.approx(1 - 0.05 ** (1 / 20), rel=1e-9)
    assert clopper_pearson_upper(5, 5) == 1.0
    import scipy.stats as scipy_stats

    assert clopper_pearson_upper(3, 40) == pytest.approx(scipy_stats.beta.ppf(0.95, 4, 37), rel=1e-7)
    assert wilson_upper(3, 40) < clopper_pearson_upper(3, 40)
    assert math.isnan(wilson_upper(0, 0))


def test_a_good_candidate_passes_every_check():
    checks = run_checks(candidate(), policy())
    assert passed(checks), [c for c in checks if not c.passed]
    names = {c.name for c in checks}
    assert {
        "target_gain_vs_champion",
        "kl_vs_champion[gsm8k]",
        "kl_vs_base[csqa]",
        "nfr_upper_vs_champion[gsm8k]",
        "nfr_upper_vs_base[csqa]",
        "csqa_choice_churn_vs_champion",
        "all_metrics_finite",
    } <= names
    nfr = next(c for c in checks if c.name == "nfr_upper_vs_base[csqa]")
    assert nfr.measured == pytest.approx(wilson_upper(1, 40)) and "Wilson 95% upper bound; F=1/40" in nfr.detail


@pytest.mark.parametrize(
    "changes, failing",
    [
        ({"target_solved": 2}, "target_gain_vs_champion"),  # no gain over the champion
        ({"champion_solved": None}, "target_gain_vs_champion"),  # missing
        ({"target_solved": 9}, "target_gain_vs_champion"),  # more solved than problems: out of range
        ({"kl_vs_champion": {"gsm8k": 0.2, "csqa": 0.02}}, "kl_vs_champion[gsm8k]"),
        ({"kl_vs_champion": {"gsm8k": math.nan, "csqa": 0.02}}, "kl_vs_champion[gsm8k]"),
        ({"kl_vs_base": {"gsm8k": 0.02}}, "kl_vs_base[csqa]"),  # a watched domain not measured
        ({"kl_vs_base": {"gsm8k": -0.5, "csqa": 0.03}}, "kl_vs_base[gsm8k]"),  # negative KL is impossible
        (
            {"flips_vs_champion": {"gsm8k": Flips(20, 12, 0, 0), "csqa": Flips(40, 0, 1, 0)}},
            "nfr_upper_vs_champion[gsm8k]",
        ),
        ({"flips_vs_base": {"gsm8k": Flips(0, 0, 0, 0), "csqa": Flips(40, 1, 2, 0)}}, "nfr_upper_vs_base[gsm8k]"),
        ({"csqa_choice_churn": None}, "csqa_choice_churn_vs_champion"),
        ({"kl_vs_base": {"gsm8k": math.inf, "csqa": 0.03}}, "all_metrics_finite"),
    ],
)
def test_fail_closed(changes, failing):
    checks = run_checks(
        candidate(**changes),
        policy(
            nfr={"max_vs_champion": {"gsm8k": 0.3, "csqa": 0.3}, "max_vs_base": {"gsm8k": 0.3, "csqa": 0.3}},
            max_csqa_choice_churn=0.1,
        ),
    )
    bad = [c.name for c in checks if not c.passed]
    assert failing in bad and not passed(checks)


def test_selection_takes_the_lowest_kl_among_passing():
    p = policy()
    a = candidate(version_id=1, kl_vs_champion={"gsm8k": 0.03, "csqa": 0.03})
    b = candidate(version_id=2, kl_vs_champion={"gsm8k": 0.01, "csqa": 0.02}, target_solved=3)
    c = candidate(version_id=3, kl_vs_champion={"gsm8k": 0.001, "csqa": 0.001}, target_solved=2)  # fails target
    verdicts = {m.version_id: passed(run_checks(m, p)) for m in (a, b, c)}
    assert verdicts == {1: True, 2: True, 3: False}
    assert select([a, b, c], verdicts, p).version_id == 2
    assert select([c], {3: False}, p) is None


def test_every_deployment_pairs_a_policy_with_answer_sets_it_can_pass():
    """At zero negative flips the NFR bound of each deployment's answer sets is under its policy's limits
    (16 GSM8K questions give 0.17 at 0 flips: a strict policy could never promote)."""
    from flows.config import load_update_config
    from flows.policy import load_policy
    from flows.serve import deployment_spec

    for name in ("update", "update-gsm8k-format", "update-gpu"):
        params = deployment_spec(name)["parameters"]
        assert not {"backbone", "skill", "line"} & set(
            params
        )  # the config decides; a deployment overrides only if told
        config = load_update_config(params["config"])
        policy = load_policy(params["policy"], config.retained.domains)
        sizes = {"gsm8k": config.retained.gsm8k_questions, "csqa": config.retained.csqa_questions}
        for limits in (policy.nfr.max_vs_champion, policy.nfr.max_vs_base):
            for domain, limit in limits.items():
                assert policy.nfr.upper(0, sizes[domain]) <= limit, (name, domain)


def test_one_serve_process_serves_every_scheduled_line_and_overrides_only_one():
    from flows.serve import serving_plan

    plan = serving_plan()
    assert [d["name"] for d in plan] == ["update", "update-gsm8k-format"]  # update-gpu is triggered, not scheduled
    assert plan[1]["parameters"]["config"] == "configs/update/gsm8k-format.yaml" and plan[1]["cron"] == "0 5 * * 0"
    one = serving_plan(["update"], "*/10 * * * *", config="my.yaml", line=None)
    assert one[0]["cron"] == "*/10 * * * *" and one[0]["parameters"] == {
        "config": "my.yaml",
        "policy": "configs/policy/default.yaml",
    }
    with pytest.raises(ValueError, match="apply to one deployment"):
        serving_plan(None, None, config="my.yaml")
    with pytest.raises(ValueError, match="no deployment named 'nope'"):
        serving_plan(["nope"])
    with pytest.raises(ValueError, match="no cron schedule"):
        serving_plan(["update-gpu"])

    from flows.serve import runner_deployments

    served = runner_deployments(plan)
    assert [d.name for d in served] == ["update", "update-gsm8k-format"]
    assert [(d.schedules[0].schedule.cron, d.schedules[0].schedule.timezone) for d in served] == [
        ("0 3 * * *", "UTC"),
        ("0 5 * * 0", "UTC"),
    ]
    assert served[1].parameters == plan[1]["parameters"]


def test_a_shared_policy_checks_the_domains_the_cycle_watches_and_fails_closed_on_a_missing_limit():
    only_csqa = candidate(
        kl_vs_base={"csqa": 0.03},
        kl_vs_champion={"csqa": 0.02},
        flips_vs_base={"csqa": Flips(40, 1, 2, 0)},
        flips_vs_champion={"csqa": Flips(40, 0, 1, 0)},
    )
    checks = run_checks(only_csqa, policy(), ["csqa"])  # the policy also names gsm8k: not this cycle's domain
    assert passed(checks), [c for c in checks if not c.passed]
    assert not [c.name for c in checks if "gsm8k" in c.name]
    assert not passed(run_checks(only_csqa, policy()))  # without the watched set every named domain is checked
    notes = {
        c.name: c
        for c in run_checks(candidate(kl_vs_base={"notes": 0.0}, kl_vs_champion={"notes": 0.0}), policy(), ["notes"])
    }
    assert not notes["kl_vs_base[notes]"].passed and math.isnan(notes["kl_vs_base[notes]"].threshold)
    assert "csqa_choice_churn_vs_champion" not in notes  # csqa is not watched


def _reference_cp(k: int, n: int, confidence: str = "0.95") -> float:
    """Clopper-Pearson upper bound by bisection on mpmath's regularised incomplete beta (30 digits)."""
    import mpmath

    if k >= n:
        return 1.0
    with mpmath.workdps(30):
        c, lo, hi = mpmath.mpf(confidence), mpmath.mpf(0), mpmath.mpf(1)
        for _ in range(70):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mpmath.betainc(k + 1, n - k, 0, mid, regularized=True) < c else (lo, mid)
        return float(hi)


def _reference_wilson(k: int, n: int) -> float:
    import mpmath

    with mpmath.workdps(30):
        z = mpmath.sqrt(2) * mpmath.erfinv(2 * mpmath.mpf("0.95") - 1)
        p, n = mpmath.mpf(k) / n, mpmath.mpf(n)
        return float(
            min(1, (p + z * z / (2 * n) + z * mpmath.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n))
        )


def test_bounds_agree_with_a_high_precision_reference_up_to_n_100000():
    from scipy.stats import binom

    small = [(k, n) for n in range(1, 41) for k in range(n + 1)]  # every k of every n <= 40
    medium = [(k, n) for n in (1221, 5000) for k in (0, 1, 7, n // 10, 400, n - 2, n - 1, n)] + [(610, 1221)]
    for k, n in small + medium:
        assert clopper_pearson_upper(k, n) == pytest.approx(_reference_cp(k, n), rel=1e-9, abs=1e-15), (k, n)
        assert wilson_upper(k, n) == pytest.approx(_reference_wilson(k, n), rel=1e-9, abs=1e-15), (k, n)
    n = 100_000  # mpmath's series stops converging here: closed forms at the ends, the CDF in between
    assert clopper_pearson_upper(0, n) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(n - 1, n) == pytest.approx(0.95 ** (1 / n), rel=1e-12)
    ks = [*range(0, n + 1, 997), n - 1, n]
    uppers = [clopper_pearson_upper(k, n) for k in ks]
    assert all(a < b for a, b in zip(uppers, uppers[1:-1]))  # strictly increasing in k, then 1.0 at k = n
    for k, u in zip(ks[:-1], uppers[:-1]):
        assert binom.cdf(k, n, u) == pytest.approx(0.05, rel=1e-6), k  # P(X <= k | u) = alpha
        assert wilson_upper(k, n) == pytest.approx(_reference_wilson(k, n), rel=1e-9, abs=1e-15), k


@pytest.mark.parametrize(
    "k, n, confidence",
    [
        (400, 1221, 0.95),
        (0, 0, 0.95),
        (3, 2, 0.95),
        (-1, 10, 0.95),
        (1.5, 10, 0.95),
        (math.nan, 10, 0.95),
        (1, math.inf, 0.95),
        (1, 10, 1.0),
        (1, 10, math.nan),
        ("1", 10, 0.95),
        (None, 10, 0.95),
    ],
)
def test_bounds_never_raise(k, n, confidence):
    for bound in (wilson_upper, clopper_pearson_upper):
        value = bound(k, n, confidence)
        assert math.isnan(value) or 0.0 <= value <= 1.0
    assert (0.0 < clopper_pearson_upper(400, 1221) < 1.0) and math.isnan(clopper_pearson_upper(3, 2))


BAD = [None, math.nan, math.inf, -math.inf, -1, 1e308, 2.5]  # 2.5: not a count


@pytest.mark.parametrize("bound", ["wilson", "clopper-pearson"])
def test_a_gate_fed_any_value_rejects_and_never_raises(bound):
    from flows.metrics import Regression

    strict = policy(
        nfr=PASSING_POLICY["nfr"] | {"bound": bound},
        max_kl_vs_champion={"gsm8k": 0.05, "csqa": 0.05, "released": 0.05},
        no_regression={"code": {"tolerance": 0.05, "confidence": 0.95}},
    )
    # 64 problems, none lost: Clopper-Pearson 95% gives 0.046 <= 0.05 (at fewer than 59 it would be unprovable)
    good = candidate(
        released={"code": Regression(64, 30.0, 30.0, 0.0, 0.0, "pass-fail", 0, 0)},
        target_score=3.0,
        champion_score=2.0,
        kl_vs_champion={"gsm8k": 0.01, "csqa": 0.02, "code": 0.01},
    )
    assert passed(run_checks(good, strict))
    variants = []
    for value in BAD:
        legacy = {"target_score": None, "champion_score": None}  # evaluations stored before scores: solved counts
        variants += [
            legacy | {"target_solved": value},
            legacy | {"champion_solved": value},
            {"target_solved": value if value is not None else -1},
            # a score may be any finite number (a user scorer's mean); only None/NaN/inf are impossible
            {"target_score": value} if value is not None and not math.isfinite(value) else {"champion_score": None},
            {"kl_vs_base": {"gsm8k": value, "csqa": 0.0}},
            {"kl_vs_champion": {"gsm8k": 0.0, "csqa": 0.0, "code": value}},
            {"csqa_choice_churn": value},
            {"flips_vs_base": {"gsm8k": Flips(20, 0, 0, 0), "csqa": Flips(value, 1, 0, 0)}},
            {"flips_vs_champion": {"gsm8k": Flips(20, value, 0, 0), "csqa": Flips(40, 0, 0, 0)}},
            {"released": {"code": Regression(64, 30.0, 30.0, 0.0, 0.0, "pass-fail", value, 0)}},
            {"released": {"code": Regression(64, 30.0, 30.0, 0.0, 0.0, "pass-fail", 0, value)}},
            {"released": {"code": Regression(value, 30.0, 30.0, 0.0, 0.0, "pass-fail", 0, 0)}},
            {"released": {"code": Regression(64, 1.0, 1.1, value if value != -1 else 0.5, 0.1, "continuous")}},
            {"released": {"code": Regression(64, 1.0, 1.1, 0.0, value, "continuous")}},
            {"released": {"code": Regression(value, 1.0, 1.1, 0.0, 0.01, "continuous")}},
        ]
    variants += [
        {"released": {"code": Regression(64, 30.0, 30.0, 0.0, 0.0)}},  # stored by older code: no counts
        {"released": {"code": Regression(64, 30.0, 30.0, 0.0, 0.0, "no-such-kind", 0, 0)}},
    ]
    variants += [{"kl_vs_base": {}}, {"flips_vs_champion": {}}]
    for changes in variants:
        checks = run_checks(replace(good, **changes), strict)
        assert not passed(checks), changes

    # Huge samples are decided, not crashed on: 400 flips of the full CSQA validation set, or of 10^12.
    huge = replace(good, flips_vs_base={"gsm8k": Flips(10**12, 400, 0, 0), "csqa": Flips(1221, 400, 0, 0)})
    measured = {c.name: c.measured for c in run_checks(huge, strict)}
    upper = wilson_upper if bound == "wilson" else clopper_pearson_upper
    assert measured["nfr_upper_vs_base[csqa]"] == pytest.approx(upper(400, 1221)) and 0.33 < upper(400, 1221) < 0.37
    assert 0 < measured["nfr_upper_vs_base[gsm8k]"] < 1e-8


def test_the_gate_candidate_deployment_runs_the_gate_flow_with_loadable_files():
    """deploy/prefect.yaml's gate-candidate: its entrypoint is the gate flow, its parameters are the
    flow's, and its config and policy load together (the version and line come with each run)."""
    import importlib
    import inspect

    from flows.config import load_update_config
    from flows.policy import load_cycle_policy
    from flows.serve import deployment_spec

    spec = deployment_spec("gate-candidate")
    module, name = spec["entrypoint"].split(":")
    gate_flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)
    assert gate_flow.name == "gate-candidate" and not spec.get("schedules")  # triggered per candidate
    signature = inspect.signature(gate_flow.fn)
    assert set(spec["parameters"]) <= set(signature.parameters) and "version" in signature.parameters
    load_cycle_policy(spec["parameters"]["policy"], load_update_config(spec["parameters"]["config"]))
