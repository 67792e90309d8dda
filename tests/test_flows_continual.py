"""A line of releases on a tiny model: skill A, skill B on top, A's data refreshed; rollback to
the base, retired versions, idle cycles and unique names."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from tests.flows_fixtures import ledger_counts, write_yaml

RETAINED = {
    "domains": ["csqa"],
    "kl_contexts": 6,
    "kl_max_tokens": 128,
    "gsm8k_questions": 2,
    "csqa_questions": 6,
    "max_new_tokens": 4,
    "batch_size": 4,
    "replay_examples": 8,
}
BASE = {
    "backbone": "tiny-llama",
    "dtype": "float32",
    "layer": 2,
    "line": "assistant",
    "retained": RETAINED,
    "atlas": {"num_vectors": 64, "charts": 4, "rank": 4},
    "train": {"epochs": 1, "lr": 1.0e-2, "batch_size": 4, "max_length": 512, "on_bad_example": "truncate"},
}
LOOSE_KL = {"csqa": 50.0}


def policy(name: str, methods=("atlas",), **changes) -> dict:
    return {
        "name": name,
        "candidates": {"methods": list(methods), "seeds": [0]},
        "min_target_gain": 0.0,
        "max_kl_vs_champion": LOOSE_KL | {"released": 50.0},
        "max_kl_vs_base": LOOSE_KL,
        "nfr": {"max_vs_champion": {"csqa": 1.0}, "max_vs_base": {"csqa": 1.0}},
        "no_regression": {"released": {"tolerance": 1.0, "min_n": 4}},
    } | changes  # skills' reference-nll: 4 problems


def write_pairs(path: Path, pairs: list[dict]) -> str:
    path.write_text(
        "".join(json.dumps({"id": p["id"], "prompt": p["prompt"], "response": p["response"]}) + "\n" for p in pairs)
    )
    return str(path)


@pytest.fixture
def line_files(tmp_path):
    """Skill A: code pairs as JSONL snapshots in a folder (a1 now, a2 written later) with held-out
    pairs; skill B: GSM8K worked solutions, scored by reference NLL."""
    from evaluation.data import mbpp_pairs

    train, held_out = mbpp_pairs("train"), mbpp_pairs("test")[:4]
    snapshots = tmp_path / "a-snapshots"
    snapshots.mkdir()
    write_pairs(snapshots / "a1.jsonl", train[:8])
    held = write_pairs(tmp_path / "a-held-out.jsonl", held_out)
    a = BASE | {
        "name": "a",
        "skill": "a",
        "data": {"source": str(snapshots), "val_source": held, "val_limit": 4},
        "target": {"scorer": "reference-nll", "options": {"source": held, "limit": 4}},
    }
    b = BASE | {
        "name": "b",
        "skill": "b",
        "data": {"source": "gsm8k", "train_limit": 8, "val_limit": 4},
        "target": {"scorer": "reference-nll", "options": {"source": "gsm8k", "limit": 4}},
    }
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    return {
        "a": write_yaml(cfg / "a.yaml", a),
        "b": write_yaml(cfg / "b.yaml", b),
        "snapshots": snapshots,
        "train": train,
        "pass": write_yaml(cfg / "pass.yaml", policy("tiny-pass")),
        "cfg": cfg,
    }


def _open():
    from flows.platform import open_platform

    return open_platform()


def test_three_releases_build_a_chain_and_keep_released_skills(prefect_harness, state, line_files):
    from flows.history import line_history
    from flows.update import update
    from registry import (
        evaluation_extra,
        get_model,
        latest_evaluation,
        latest_gate_decision,
        list_versions,
        resolve_version,
        version_chain,
    )

    first = update(line_files["a"], line_files["pass"])
    assert first.outcome == "promoted"
    second = update(line_files["b"], line_files["pass"])
    assert second.outcome == "promoted" and second.previous_champion == first.champion

    p = _open()
    try:
        model = get_model(p.ledger, first.model)
        assert model.line == "assistant" and model.name == "tiny-llama.assistant"
        v1, v2 = (resolve_version(p.ledger, model.id, r.champion) for r in (first, second))
        assert v2.parent_id == v1.id and v1.parent_id == resolve_version(p.ledger, model.id, "base").id
        assert [v.id for v in version_chain(p.ledger, v2.id)] == [v1.id, v2.id]
        assert (v1.skill, v2.skill) == ("a", "b")
        checks = {c.name: c for c in latest_gate_decision(p.ledger, v2.id).checks}
        # A is a retained domain of B's release: KL on its held-out contexts and its score kept.
        assert "kl_vs_champion[a]" in checks and "no_regression[a]" in checks and checks["no_regression[a]"].passed
        assert "kl_vs_base[a]" not in checks and "kl_vs_champion[csqa]" in checks
    finally:
        p.close()
    assert ledger_counts(state)["atlases"] == 2  # the champion changed: the atlas was refitted on v1's activations

    # A's data refreshed: a newer snapshot in the folder retrains A on top of v2, with B retained.
    time.sleep(0.01)
    write_pairs(line_files["snapshots"] / "a2.jsonl", line_files["train"][8:16])
    os.utime(line_files["snapshots"] / "a2.jsonl", (time.time() + 5, time.time() + 5))
    third = update(line_files["a"], line_files["pass"])
    assert third.outcome == "promoted" and third.previous_champion == second.champion
    p = _open()
    try:
        v3 = resolve_version(p.ledger, model.id, third.champion)
        chain = version_chain(p.ledger, v3.id)
        assert [v.skill for v in chain] == ["a", "b", "a"] and v3.name != v1.name  # unique names
        assert resolve_version(p.ledger, model.id, v1.name).id == v1.id
        checks = {c.name for c in latest_gate_decision(p.ledger, v3.id).checks}
        assert "no_regression[b]" in checks and "no_regression[a]" not in checks  # a is the skill taught now
        assert len([v for v in list_versions(p.ledger, model.id) if not v.is_base]) == 3
        history = line_history(p.ledger, model.id, v3.id)
        v1_score = evaluation_extra(p.ledger, latest_evaluation(p.ledger, v1.id).id)["target_score"]
        v2_kl = {k.domain: k.kl_vs_release for k in latest_evaluation(p.ledger, v2.id).kl}
    finally:
        p.close()
    # The line's score matrix from stored answers: R[1][1] is v1's own target score, later rows
    # hold what B's and A's evaluations measured of the skills released before them.
    assert history.releases[0].endswith("-base") and history.releases[1:] == [v.name for v in chain]
    assert history.skills == ["a", "b", "a"] and history.parents[1:] == history.releases[:3]
    assert history.scores[1][0] == pytest.approx(v1_score)
    assert all(history.scores[t][i] is not None for t, i in ((2, 0), (2, 1), (3, 1), (3, 2)))
    # NLL, lower is better: on the line's 0-1 scale as exp(-NLL)
    assert history.bwt(2) == pytest.approx(math.exp(-history.scores[2][0]) - math.exp(-history.scores[1][0]))
    # Retention: KL vs the release that taught a released skill (here the champion each time)
    assert history.kl_vs_teacher[1] == {} and set(history.kl_vs_teacher[2]) == {"a"}
    assert history.kl_vs_teacher[2]["a"] == pytest.approx(v2_kl["a"]) and set(history.kl_vs_teacher[3]) == {"b"}
    report = Path(third.report)
    assert "## The line" in report.read_text() and (report.parent / "history.png").is_file()

    counts = ledger_counts(state)
    assert counts["atlases"] == 3
    idle = update(line_files["a"], line_files["pass"])
    assert idle.outcome == "idle" and "already released" in idle.reason
    assert ledger_counts(state) == counts


class LowNllIsWorse:
    """A user scorer (`module:Factory` from YAML) that reads reference NLL the wrong way round:
    any candidate that lowers the held-out NLL of A regresses it. Training B on top of A lowers
    A's NLL on this random tiny model, so B's candidate must fail A's no-regression check."""

    def __new__(cls, **options):
        from evaluation.scorers import build_scorer

        scorer = build_scorer("reference-nll", options)
        scorer.name, scorer.higher_is_better = "tests.test_flows_continual:LowNllIsWorse", True
        scorer.dataset = "low-nll-is-worse@" + scorer.dataset
        return scorer


def test_a_candidate_that_regresses_a_released_skill_is_rejected_for_it(prefect_harness, state, line_files):
    import yaml

    from flows.update import update
    from registry import get_model, latest_gate_decision, resolve_version

    a = yaml.safe_load(Path(line_files["a"]).read_text())
    a["target"]["scorer"] = "tests.test_flows_continual:LowNllIsWorse"
    a_user = write_yaml(line_files["cfg"] / "a-user.yaml", a)
    first = update(a_user, line_files["pass"])
    assert first.outcome == "rejected"  # A's own gain reads negative with this scorer: release it by hand
    p = _open()
    try:
        from registry import promote

        (name,) = first.candidates
        v1 = resolve_version(p.ledger, get_model(p.ledger, first.model).id, name)
        promote(p.ledger, p.bridge, v1.id, reason="released by hand", expected_current=None, require_gate=False)
    finally:
        p.close()
    strict = write_yaml(
        line_files["cfg"] / "strict.yaml", policy("tiny-strict", no_regression={"a": {"tolerance": 0.0, "min_n": 4}})
    )
    result = update(line_files["b"], strict)
    assert result.outcome == "rejected"
    p = _open()
    try:
        model = get_model(p.ledger, result.model)
        assert result.candidates
        for name in result.candidates:
            decision = latest_gate_decision(p.ledger, resolve_version(p.ledger, model.id, name).id)
            failed = [c for c in decision.checks if not c.passed]
            assert [c.name for c in failed] == ["no_regression[a]"] and failed[0].measured > 0
    finally:
        p.close()


def test_rollback_to_base_retires_the_release_and_the_next_cycle_is_idle(prefect_harness, state, line_files, tmp_path):
    import yaml

    from flows.release import rollback
    from flows.update import update
    from registry import alias_holder, get_model, latest_gate_decision, resolve_version, sha256_file

    # A user's JSONL retained domain next to CSQA: its first rows gate (KL), the rest calibrate the atlas.
    notes = tmp_path / "notes.jsonl"
    notes.write_text(
        "".join(
            json.dumps({"id": f"n{i}", "prompt": f"Note {i}: what is {i} + {i}?", "reference": f"{i} + {i} = {2 * i}."})
            + "\n"
            for i in range(40)
        )
    )
    a = yaml.safe_load(Path(line_files["a"]).read_text())
    a["retained"]["domains"] = ["csqa", {"name": "notes", "file": str(notes), "gate_rows": 8}]
    config = write_yaml(line_files["cfg"] / "a-notes.yaml", a)
    passing = write_yaml(
        line_files["cfg"] / "notes-pass.yaml",
        policy("tiny-notes", max_kl_vs_champion=LOOSE_KL | {"notes": 50.0}, max_kl_vs_base=LOOSE_KL | {"notes": 50.0}),
    )
    first = update(config, passing)
    assert first.outcome == "promoted"
    rollback(first.model, "regression reported by users")
    p = _open()
    try:
        model = get_model(p.ledger, first.model)
        assert alias_holder(p.ledger, model.id) is None  # the base serves
        v1 = resolve_version(p.ledger, model.id, first.champion)
        assert v1.status == "retired"
        checks = {c.name: c for c in latest_gate_decision(p.ledger, v1.id).checks}
        assert checks["kl_vs_champion[notes]"].measured is not None and "nfr_upper_vs_base[notes]" not in checks
        # The skill's data snapshot is a dataset input of the MLflow training run, identified by content.
        (dataset,) = [d.dataset for d in p.bridge.client.get_run(v1.mlflow_run_id).inputs.dataset_inputs]
        snapshot_sha = sha256_file(line_files["snapshots"] / "a1.jsonl")
        assert dataset.digest == snapshot_sha[:32] and json.loads(dataset.source)["sha256"] == snapshot_sha
    finally:
        p.close()
    counts = ledger_counts(state)
    again = update(config, passing)
    assert again.outcome == "idle" and again.champion.endswith("-base")
    assert ledger_counts(state) == counts  # no new versions, decisions or releases


@pytest.mark.parametrize(
    "where, value, message",
    [
        ("target", {"scorer": "reference-nl", "options": {}}, "did you mean 'reference-nll'"),
        ("target", {"scorer": "reference-nll", "options": {"limt": 4}}, "target.options.limt"),
        ("target", {"scorer": "tests.test_flows_continual:NoSuchFactory"}, "has no attribute 'NoSuchFactory'"),
        ("retained", RETAINED | {"domains": ["csqa", {"name": "notes", "fiel": "x.jsonl"}]}, "retained.domains[1]"),
    ],
)
def test_a_typo_in_a_scorer_or_domain_is_rejected_before_training(
    prefect_harness, state, line_files, where, value, message
):
    import yaml

    from flows.update import update

    a = yaml.safe_load(Path(line_files["a"]).read_text()) | {where: value}
    with pytest.raises(ValueError) as err:
        update(write_yaml(line_files["cfg"] / "typo.yaml", a), line_files["pass"])
    assert message in str(err.value)
    assert not (state / "runs").exists()  # nothing trained
