"""The update cycle on a tiny model under one Prefect test harness: promote, reject, NaN,
retry, and a crashed cycle resumed without duplicates."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows_fixtures import (
    IMPOSSIBLE_POLICY,
    PASSING_POLICY,
    ledger_counts,
    tiny_files,
)

REPO = Path(__file__).resolve().parent.parent


def _platform():
    from flows.platform import open_platform

    return open_platform()


def _champion(p, model_name: str):
    from registry import alias_holder, get_model

    return alias_holder(p.ledger, get_model(p.ledger, model_name).id)


def test_an_unmeetable_policy_rejects_then_a_passing_one_promotes_then_the_cycle_is_idle(
    prefect_harness, state, tmp_path
):
    from prefect.client.orchestration import get_client

    from flows.update import update
    from registry import get_model, latest_gate_decision, list_versions

    config, impossible = tiny_files(tmp_path / "cfg", IMPOSSIBLE_POLICY)
    # A policy no outcome could meet at the cycle's sizes is refused before anything trains, in one line.
    from atlas_core.typed_config import ConfigError

    for changes, says in (
        ({"min_target_gain": 5}, "min_target_gain: 5 solved problems cannot be gained on a target of 4"),
        (
            {"nfr": PASSING_POLICY["nfr"] | {"max_vs_base": {"gsm8k": 0.3, "csqa": 1.0}}},
            r"nfr.max_vs_base.gsm8k: limit 0.3 is unprovable with 4 questions .* needs >= 7",
        ),
    ):
        _, infeasible = tiny_files(tmp_path / "infeasible", PASSING_POLICY | {"name": "tiny-infeasible"} | changes)
        with pytest.raises(ConfigError, match=says):
            update(config, infeasible)
    first = update(config, impossible)
    assert first.outcome == "rejected" and not first.promoted and first.champion.endswith("-base")
    assert "REJECTED" in Path(first.report).read_text()
    seconds = first.seconds  # wall time per phase, in the order they ran: 2 candidates trained and evaluated
    assert list(seconds)[:3] == ["lineage (backbone, ledger, champion chain)", "atlas local", "candidate atlas s0"]
    assert [k for k in seconds if k.startswith("candidate ")] == ["candidate atlas s0", "candidate weight-lora s0"]
    assert "gate" in seconds and all(v >= 0 for v in seconds.values()) and seconds["candidate atlas s0"] > 0
    timing = Path(first.report).read_text().split("## Where the time went")[1]
    assert "| candidate atlas s0 |" in timing and f"| **total** | **{sum(seconds.values()):.1f}** |" in timing
    steps = first.steps  # the steps inside the stages: each answer set, KL per domain, training per candidate
    assert {
        "backbone load",
        "train atlas s0",
        "train weight-lora s0",
        "answers target",
        "answers gsm8k",
        "answers csqa (choice)",
        "answers csqa (choice prefix states)",
        "KL gsm8k",
        "KL csqa",
        "KL gsm8k (prefix states)",
        "publish (MLflow model versions)",
    } <= set(steps), steps
    assert all(v >= 0 for v in steps.values()) and steps["train atlas s0"] <= seconds["candidate atlas s0"]
    assert "| answers gsm8k |" in timing and "| KL csqa |" in timing
    p = _platform()
    try:
        model = get_model(p.ledger, first.model)
        candidates = [v for v in list_versions(p.ledger, model.id) if not v.is_base]
        assert len(candidates) == 4 and {v.name for v in candidates} == set(first.candidates)
        for version in candidates:
            decision = latest_gate_decision(p.ledger, version.id)
            failed = [c for c in decision.checks if not c.passed]
            assert not decision.passed and [c.name for c in failed] == ["target_gain_vs_champion"], failed
            assert failed[0].threshold == 4 and decision.release_version_id is None
    finally:
        p.close()
    counts = ledger_counts(state)

    _, passing = tiny_files(tmp_path / "cfg", PASSING_POLICY)
    second = update(config, passing)
    assert second.outcome == "promoted" and second.champion == second.selected
    assert all(second.candidates.values()) and second.previous_champion == first.champion
    report = Path(second.report)
    assert report.is_file() and {"tradeoff.png", "churn.png", "gate.json"} <= {p.name for p in report.parent.iterdir()}
    text = report.read_text()
    assert "PROMOTED" in text and "nfr_upper_vs_champion[gsm8k]" in text and "Comparison with the champion" in text
    with get_client(sync_client=True) as client:  # the harness is shared: other tests' artifacts are there too
        reports = [a for a in client.read_artifacts() if a.key == "update-report"]
        assert any(second.model in (a.description or "") and "PROMOTED" in (a.description or "") for a in reports)
    p = _platform()
    try:
        champion = _champion(p, second.model)
        assert champion.name == second.selected
        assert p.bridge.aliases(second.model)["champion"] == champion.mlflow_version  # MLflow agrees with the ledger
        client = p.bridge.client
        cycle_runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()], "tags.kind = 'update-cycle'"
        )
        logged = {k for r in cycle_runs for k in r.data.metrics}  # the cycle runs carry their phase timings
        assert {"seconds/candidate_atlas_s0", "seconds/gate", "seconds/promote", "seconds/step/KL_csqa"} <= logged
        _kl_per_context_is_recorded_reported_and_logged(p, model, candidates, text, tmp_path)
    finally:
        p.close()
    after = ledger_counts(state)
    # The second cycle reused the atlas, the training runs, their checkpoints and every evaluation
    # (same champion: the base); it added one gate decision per candidate and the release.
    for table in ("atlases", "training_runs", "checkpoints", "versions", "evaluations"):
        assert after[table] == counts[table], table
    assert after["gate_decisions"] == counts["gate_decisions"] + 4 and after["releases"] == counts["releases"] + 1

    third = update(config, passing)  # the snapshot is now in the champion's chain: nothing new to teach
    assert third.outcome == "idle" and third.champion == second.champion
    assert ledger_counts(state) == after


def _kl_per_context_is_recorded_reported_and_logged(p, model, candidates, report_text: str, tmp_path) -> None:
    """Every evaluation keeps, per reference and member, the p95/p99/max of the per-context KL, its
    means over prompt and over response positions, and the 5 contexts that moved most (of the tiny
    config's 8); the report (whose cycle reused the stored
    evaluations) lists them per candidate; each training run's MLflow run holds them as one table,
    once per evaluation (the second cycle appended nothing)."""
    import json

    from registry import evaluation_extra, latest_evaluation

    for version in candidates:
        ev = latest_evaluation(p.ledger, version.id)
        extra, means = evaluation_extra(p.ledger, ev.id), {k.domain: k for k in ev.kl}
        assert set(extra["kl_tail"]) == set(extra["kl_top_contexts"]) == {"vs_champion", "vs_base"}
        for against, members in extra["kl_tail"].items():
            assert set(members) == {"gsm8k", "csqa"}
            for member, t in members.items():
                mean = means[member].kl_vs_base if against == "vs_base" else means[member].kl_vs_release
                # the mean over tokens is a weighted mean of the contexts' own: never above the largest
                assert t["contexts"] == 8 and -1e-6 <= t["p95"] <= t["p99"] <= t["max"] and mean <= t["max"] + 1e-9
                # the mean over all positions weighs its prompt and response positions' means: between them
                # (the tiny config's kl_max_tokens cuts GSM8K contexts inside the prompt: no response there)
                kinds = [t[k] for k in ("prompt", "response") if t[k] is not None]
                assert kinds and min(kinds) - 1e-9 <= mean <= max(kinds) + 1e-9, t
                top = extra["kl_top_contexts"][against][member]
                assert len(top) == 5 and top[0]["kl"] == t["max"] and all(c["text"] for c in top)
                assert [c["kl"] for c in top] == sorted((c["kl"] for c in top), reverse=True)
    section = report_text.split("## Retained KL per context")[1].split("\n## ")[0]
    assert all(f"#### {v.name}" in section for v in candidates)
    assert section.count("| vs_champion | csqa | 1 |") == len(candidates) and "| vs_base | gsm8k | 5 |" in section
    client = p.bridge.client
    runs = client.search_runs(
        [p.bridge.experiment_id(model.backbone, model.line)], "tags.`ledger.training_run_id` != ''"
    )
    assert len(runs) == 2  # ATLAS and Weight-LoRA, two epoch versions each
    for run in runs:
        path = client.download_artifacts(run.info.run_id, "kl_top_contexts.json", str(tmp_path))
        table = json.loads(Path(path).read_text())
        assert {"version", "evaluation_id", "against", "member", "rank", "context", "kl", "text"} <= set(
            table["columns"]
        )
        assert len(table["data"]) == 2 * 2 * 2 * 5  # versions x references x members x contexts listed


def test_nan_metric_rejects_and_a_failing_task_is_retried(prefect_harness, state, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client

    import flows.answers as answers
    from flows.resources import Resources
    from flows.update import update
    from registry import get_version, latest_evaluation, latest_gate_decision

    real_kl, real_generate, calls = Resources.retained_kl, answers._generate, []

    def nan_for_candidates(res, ctx, applied, refs, member):
        from evaluation.kl import KLResult

        if applied.version.is_base:
            return real_kl(res, ctx, applied, refs, member)
        return [KLResult(math.nan, [math.nan] * len(res.gate_texts(ctx, member)), 1) for _ in refs]

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("injected: the scorer's worker went away")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(Resources, "retained_kl", nan_for_candidates)
    monkeypatch.setattr(answers, "_generate", fail_once)
    config, policy = tiny_files(tmp_path / "cfg", PASSING_POLICY | {"candidates": {"methods": ["atlas"], "seeds": [0]}})
    result = update(config, policy)
    assert not result.promoted and result.champion.endswith("-base")
    assert set(result.candidates.values()) == {False}

    p = _platform()
    try:
        assert _champion(p, result.model) is None
        for vid in (2, 3):  # the two epoch-end versions (1 is the base)
            decision = latest_gate_decision(p.ledger, vid)
            failed = {c.name: c for c in decision.checks if not c.passed}
            assert {"all_metrics_finite", "kl_vs_champion[gsm8k]", "kl_vs_base[csqa]"} <= set(failed)
            assert "not finite" in failed["kl_vs_champion[gsm8k]"].detail
            assert failed["kl_vs_champion[gsm8k]"].measured is None  # stored as NULL, the NaN kept in the detail
            ev = latest_evaluation(p.ledger, vid)
            assert ev.kl[0].kl_vs_base is None and get_version(p.ledger, vid).mlflow_version is not None
    finally:
        p.close()
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_task_runs() if r.name.startswith("answers-") and r.run_count > 1]
    assert runs and runs[0].state.is_completed()  # failed once, retried, then completed


def test_crashed_cycle_resumes_without_duplicates(prefect_harness, state, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from flows.update import update
    from registry import get_model, list_versions

    config, policy = tiny_files(tmp_path / "cfg", PASSING_POLICY)
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "ATLAS_STATE_DIR": str(state),
        "PYTHONPATH": str(REPO),
    }
    # 3 recorded checkpoints: ATLAS finished (2), Weight-LoRA killed after its first.
    crashed = subprocess.run(
        [sys.executable, "-m", "tests.flows_fixtures", config, policy, "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    partial = ledger_counts(state)
    # A candidate is trained, then evaluated: ATLAS's two versions were evaluated before Weight-LoRA trained.
    assert partial["checkpoints"] == 3 and partial["training_runs"] == 2 and partial["evaluations"] == 2

    result = update(config, policy)
    assert result.promoted
    counts = ledger_counts(state)
    assert counts["training_runs"] == 2 and counts["checkpoints"] == 4 and counts["versions"] == 5  # 4 + base
    assert counts["releases"] == 1 and counts["gate_decisions"] == 4

    p = _platform()
    try:
        model = get_model(p.ledger, result.model)
        published = [v.mlflow_version for v in list_versions(p.ledger, model.id) if not v.is_base]
        mlflow_versions = p.bridge.client.search_model_versions(f"name = '{model.name}'")
        assert sorted(published, key=int) == sorted((str(v.version) for v in mlflow_versions), key=int)  # one each
        runs = p.bridge.client.search_runs(
            [p.bridge.experiment_id(model.backbone, model.line)], "tags.`ledger.training_run_id` != ''"
        )
        assert sorted(r.data.tags["ledger.training_run_id"] for r in runs) == [
            "1",
            "2",
        ]  # one MLflow run per training run
    finally:
        p.close()
