"""A candidate that fails is recorded with its reason, and the policy decides what the cycle does:
`candidates.require_all` rejects the cycle, otherwise the gate decides among the others; a rerun
resumes the failed one and does not retrain or re-evaluate the one that finished."""

from __future__ import annotations

import pytest

from flows.gates import candidates_check, run_checks
from flows.policy import ReleasePolicy
from registry import GateCheckRecord
from tests.flows_fixtures import write_yaml
from tests.test_flows_continual import BASE, policy, write_pairs


class Boom(RuntimeError):
    pass


def test_candidates_check_fails_closed_only_when_the_policy_requires_all():
    from atlas_core.typed_config import build

    strict = build(ReleasePolicy, {"candidates": {"methods": ["atlas"], "seeds": [0, 1]}})
    lenient = build(ReleasePolicy, {"candidates": {"methods": ["atlas"], "seeds": [0, 1], "require_all": False}})
    failed = {"atlas s1": "Boom: out of memory"}
    check = candidates_check(failed, 2, strict)
    assert not check.passed and check.measured == 1.0 and "atlas s1: Boom: out of memory" in check.detail
    assert "rejected" in check.detail
    check = candidates_check(failed, 2, lenient)
    assert check.passed and "decides among the others" in check.detail
    assert candidates_check({}, 2, strict).passed
    # The default keeps the labels of policies written before the setting existed; a change shows.
    assert "require_all" not in strict.to_dict()["candidates"] and strict.label != lenient.label


def test_run_checks_adds_the_check_only_when_a_candidate_failed(monkeypatch):
    import flows.gates as gates

    ok = GateCheckRecord(name="x", threshold=None, measured=None, passed=True, detail="")
    for name in ("target_check", "finite_check"):
        monkeypatch.setattr(gates, name, lambda *a, **k: ok)
    for name in ("kl_checks", "kl_tail_checks", "no_regression_checks", "nfr_checks"):
        monkeypatch.setattr(gates, name, lambda *a, **k: [])
    monkeypatch.setattr(gates, "churn_check", lambda *a, **k: [])
    pol = ReleasePolicy()
    assert [c.name for c in run_checks(None, pol)] == ["x", "x"]
    names = [c.name for c in run_checks(None, pol, failed={"atlas s1": "why"}, total=2)]
    assert names == ["x", "x", "all_candidates_finished"]


@pytest.fixture
def two_seeds(tmp_path):
    from evaluation.data import mbpp_pairs

    train, held = mbpp_pairs("train")[:8], mbpp_pairs("test")[:4]
    held_file = write_pairs(tmp_path / "held.jsonl", held)
    cfg = BASE | {
        "name": "a",
        "skill": "a",
        "data": {"source": write_pairs(tmp_path / "a.jsonl", train), "val_source": held_file, "val_limit": 4},
        "target": {"scorer": "reference-nll", "options": {"source": held_file, "limit": 4}},
        "train": BASE["train"] | {"epochs": 2},
    }
    seeds = {"methods": ["atlas"], "seeds": [0, 1]}
    return {
        "config": write_yaml(tmp_path / "a.yaml", cfg),
        "strict": write_yaml(tmp_path / "strict.yaml", policy("strict", candidates=seeds)),
        "lenient": write_yaml(tmp_path / "lenient.yaml", policy("lenient", candidates=seeds | {"require_all": False})),
    }


def _crash_seed(monkeypatch, seed: int, calls: list, after_steps: int | None = None):
    """train_run raises for `seed` (after its first checkpoint when `after_steps`); records every call."""
    import flows.training as training

    real = training.train_run.fn

    def train_run(ctx, training_run_id, run_config, variant, skill, run_dir):
        calls.append(run_config.train.seed)
        if run_config.train.seed == seed:
            raise Boom(f"injected failure of seed {seed}")
        return real(ctx, training_run_id, run_config, variant, skill, run_dir)

    monkeypatch.setattr(training.train_run, "fn", train_run)


def _runs(state):
    from flows.platform import open_platform
    from registry import models as m

    p = open_platform()
    try:
        with p.ledger.transaction() as s:
            return {r.seed: (r.id, r.status, r.failure) for r in s.query(m.TrainingRun)}
    finally:
        p.close()


def test_a_failed_candidate_rejects_the_cycle_and_a_rerun_resumes_only_it(prefect_harness, state, two_seeds):
    from flows.update import update

    calls: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        _crash_seed(mp, 1, calls)
        result = update(two_seeds["config"], two_seeds["strict"])
    assert result.outcome == "rejected" and result.champion == result.previous_champion
    assert list(result.failed) == ["atlas s1"] and "Boom: injected failure of seed 1" in result.failed["atlas s1"]
    assert result.candidates and not any(result.candidates.values())  # seed 0 finished; the rule rejected it
    runs = _runs(state)
    assert runs[1][1] == "failed" and "Boom: injected failure of seed 1" in runs[1][2]
    assert runs[0][1] == "finished" and runs[0][2] is None
    from flows.platform import open_platform
    from registry.publish import FAILURE_TAG

    p = open_platform()
    try:
        mlflow_runs = p.bridge.client.search_runs(
            [e.experiment_id for e in p.bridge.client.search_experiments()], f"tags.`{FAILURE_TAG}` != ''"
        )
        assert [r.data.tags[FAILURE_TAG] for r in mlflow_runs] == [runs[1][2]]
        assert mlflow_runs[0].info.status == "FAILED"
    finally:
        p.close()
    report = open(result.report).read()
    assert "failed candidates" in report and "atlas s1 (Boom: injected failure of seed 1)" in report

    calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        _crash_seed(mp, 99, calls)  # nothing fails now; count what trains
        rerun = update(two_seeds["config"], two_seeds["strict"])
    assert calls == [1]  # seed 0 was reused by its content key, seed 1 trained again from its folder
    assert rerun.outcome == "promoted" and not rerun.failed
    assert _runs(state) == {0: runs[0], 1: (runs[1][0], "finished", None)}  # the same rows; the reason cleared


def test_without_require_all_the_gate_decides_among_the_others(prefect_harness, state, two_seeds):
    from flows.update import update

    with pytest.MonkeyPatch.context() as mp:
        _crash_seed(mp, 0, [])
        result = update(two_seeds["config"], two_seeds["lenient"])
    assert result.outcome == "promoted" and list(result.failed) == ["atlas s0"]
    assert result.selected is not None and "-s1-" in result.selected
