"""Version comparison from stored answers (flows.compare, above the registry), and the release
history view. (That the registry imports nothing of the project: tests/test_architecture.py.)"""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

import registry as r
from flows.compare import compare_answers, compare_versions, format_history
from tests.conftest_registry import (
    gate_pass,
    make_candidates,
    unique_backbone,
)

A = r.AnswerRecord
BASE = [
    A("gsm8k", "q1", "4", True),
    A("gsm8k", "q2", "7", False),
    A("gsm8k", "q3", "9", False),
    A("gsm8k", "q4", "1", True),
    A("gsm8k", "q5", None, False),
    A("csqa", "c1", "A", True),
    A("csqa", "c2", "B", False),
    A("csqa", "c3", "D", True),
]
V1 = [
    A("gsm8k", "q1", "5", False),  # F: correct -> wrong
    A("gsm8k", "q2", "8", True),  # G: wrong -> correct
    A("gsm8k", "q3", "10", False),  # W: wrong -> different wrong
    A("gsm8k", "q4", "1", True),  # unchanged
    A("gsm8k", "q5", None, False),  # still nothing extracted: not a flip
    A("gsm8k", "q6", "3", True),  # the base never answered it: unpaired
    A("csqa", "c1", "A", True),
    A("csqa", "c2", "C", False),
]  # c2: W; c3 unanswered
V2 = [
    A("gsm8k", "q1", "4", True),
    A("gsm8k", "q2", "8", True),
    A("gsm8k", "q3", "10", False),
    A("gsm8k", "q4", "2", False),
    A("gsm8k", "q5", "6", False),
    A("gsm8k", "q6", "3", True),
    A("csqa", "c1", "A", True),
    A("csqa", "c2", "C", False),
]


def hand_made(ledger, store):
    model_id, (v1, v2) = make_candidates(ledger, store, unique_backbone(), seeds=(1, 2))
    base = r.base_version(ledger, model_id)
    for version, answers in ((base, BASE), (v1, V1), (v2, V2)):
        r.record_answers(ledger, version.id, answers)
    r.record_evaluation(ledger, r.EvaluationRecord(base.id, 10, 20, [r.DomainKL("gsm8k", None)]))
    r.record_evaluation(
        ledger,
        r.EvaluationRecord(
            v1.id,
            12,
            20,
            [r.DomainKL("gsm8k", 0.02), r.DomainKL("csqa", 0.01)],
            [r.ChurnCounts("base", "gsm8k", 1, 1, 1, 5)],
            csqa_choice_churn=0.5,
        ),
    )
    r.record_evaluation(
        ledger,
        r.EvaluationRecord(
            v2.id,
            15,
            20,
            [r.DomainKL("gsm8k", 0.05), r.DomainKL("csqa", 0.01)],
            [r.ChurnCounts("base", "gsm8k", 1, 1, 2, 5)],
            release_version_id=v1.id,
        ),
    )
    return model_id, base, v1, v2


def flips(comparison):
    return {(f.dataset, f.question_id, f.kind, f.answer_a, f.answer_b) for f in comparison.flips}


def test_comparison_with_the_base_reports_exactly_the_written_flips(ledger, store):
    _, base, v1, _ = hand_made(ledger, store)
    c = compare_versions(ledger, base.id, v1.id)
    assert (c.version_a, c.version_b) == (base.name, v1.name)
    assert flips(c) == {
        ("gsm8k", "q1", "F", "4", "5"),
        ("gsm8k", "q2", "G", "7", "8"),
        ("gsm8k", "q3", "W", "9", "10"),
        ("csqa", "c2", "W", "B", "C"),
    }
    rows = {row.dataset: row for row in c.churn}
    gsm8k, csqa = rows["gsm8k"].flips, rows["csqa"].flips
    assert (gsm8k.F, gsm8k.G, gsm8k.W, gsm8k.n) == (1, 1, 1, 5)
    assert (rows["gsm8k"].only_in_a, rows["gsm8k"].only_in_b) == (0, 1)
    assert (csqa.W, csqa.n, rows["csqa"].only_in_a) == (1, 2, 1)
    assert rows["all"].flips.churn == pytest.approx(4 / 7) and rows["all"].flips.nfr == pytest.approx(1 / 7)
    metrics = {m.name: m for m in c.metrics}
    assert (
        metrics["target_solved[gsm8k]"].a,
        metrics["target_solved[gsm8k]"].b,
        metrics["target_solved[gsm8k]"].delta,
    ) == (10, 12, 2)
    assert metrics["kl_vs_base[gsm8k]"].a == 0.0 and metrics["kl_vs_base[gsm8k]"].delta == pytest.approx(0.02)
    assert metrics["kl_vs_base[csqa]"].a == 0.0  # the base's KL to itself, even where not measured
    assert metrics["csqa_choice_churn"].a is None and metrics["csqa_choice_churn"].delta is None


def test_comparison_between_two_versions_has_a_direction(ledger, store):
    _, _, v1, v2 = hand_made(ledger, store)
    forward = compare_versions(ledger, v1.id, v2.id)
    assert flips(forward) == {
        ("gsm8k", "q1", "G", "5", "4"),
        ("gsm8k", "q4", "F", "1", "2"),
        ("gsm8k", "q5", "W", None, "6"),
    }
    backward = compare_versions(ledger, v2.id, v1.id)
    assert flips(backward) == {
        ("gsm8k", "q1", "F", "4", "5"),
        ("gsm8k", "q4", "G", "2", "1"),
        ("gsm8k", "q5", "W", "6", None),
    }
    total = {row.dataset: row for row in forward.churn}["all"].flips
    assert (total.F, total.G, total.W, total.n) == (1, 1, 1, 8)
    delta = {m.name: m.delta for m in forward.metrics}
    assert delta["target_solved[gsm8k]"] == 3 and delta["kl_vs_base[gsm8k]"] == pytest.approx(0.03)
    assert delta["nfr_vs_base"] == pytest.approx(0.0)
    assert compare_versions(ledger, v1.id, v1.id).flips == []


def test_comparison_outputs(ledger, store, bridge, mlflow_config, tmp_path):
    _, base, v1, _ = hand_made(ledger, store)
    c = compare_versions(ledger, base.id, v1.id)
    as_json = json.loads(c.to_json())
    assert {(f["dataset"], f["question_id"], f["kind"]) for f in as_json["flips"]} == {
        ("gsm8k", "q1", "F"),
        ("gsm8k", "q2", "G"),
        ("gsm8k", "q3", "W"),
        ("csqa", "c2", "W"),
    }
    assert next(row for row in as_json["churn"] if row["dataset"] == "all")["nfr"] == pytest.approx(1 / 7)
    markdown = c.to_markdown()
    assert f"# {v1.name} vs {base.name}" in markdown
    assert "| gsm8k | q1 | F | '4' | '5' |" in markdown
    assert "| target_solved[gsm8k] | 10 | 12 | +2 |" in markdown
    table = c.to_table()
    assert "Flipped questions" in table and "q3" in table and "0.5714" in table
    md_path, json_path = c.write(tmp_path / "report")
    assert md_path.read_text() == markdown and json.loads(json_path.read_text()) == as_json

    run_id = r.ensure_mlflow_run(ledger, bridge, v1.training_run_id)
    c.log_to_mlflow(bridge, run_id)
    logged = {a.path for a in MlflowClient(mlflow_config.tracking_uri).list_artifacts(run_id, "comparisons")}
    stem = f"comparisons/{v1.name}_vs_{base.name}"
    assert logged == {f"{stem}.md", f"{stem}.json"}


def test_release_history_lists_every_release_with_key_metrics(ledger, store):
    model_id, _, v1, v2 = hand_made(ledger, store)
    gate_pass(ledger, v1.id, None)
    r.promote(ledger, None, v1.id, reason="first", flow_run_id="flow-a")
    gate_pass(ledger, v2.id, v1.id)
    r.promote(ledger, None, v2.id, reason="more solved", flow_run_id="flow-b")
    r.rollback(ledger, None, model_id, "KL too high on gsm8k")
    rows = r.release_history(ledger, model_id)
    assert [(h.action, h.version, h.previous, h.target) for h in rows] == [
        ("promote", v1.name, "-", "12/20"),
        ("promote", v2.name, v1.name, "15/20"),
        ("rollback", v1.name, v2.name, "12/20"),
    ]
    assert rows[1].max_kl_vs_base == pytest.approx(0.05) and rows[1].nfr_vs_base == pytest.approx(0.2)
    assert rows[2].reason == "KL too high on gsm8k" and rows[0].flow_run_id == "flow-a"
    text = format_history(rows)
    assert "rollback" in text and "KL too high on gsm8k" in text
    markdown = format_history(rows, markdown=True)
    assert markdown.count("\n") == 4 and f"| promote | champion | {v2.name} |" in markdown


def test_compare_answers_counts_only_paired_questions():
    rows, found = compare_answers({("d", "1"): A("d", "1", "x", True)}, {("d", "2"): A("d", "2", "y", True)})
    # No paired question: n = 0, and its rates are None (not measured), shown as '-'.
    row = rows[0]
    assert found == [] and (row.flips.n, row.only_in_a, row.only_in_b, row.flips.churn) == (0, 1, 1, None)
    assert rows[0].to_dict()["nfr"] is None
    assert compare_answers({}, {}) == ([], [])


def test_versions_are_found_by_the_names_people_use(ledger, store):
    model_id, base, v1, v2 = hand_made(ledger, store)
    name = r.get_model(ledger, model_id).name
    assert r.resolve_version(ledger, name, "base").id == base.id
    assert r.resolve_version(ledger, model_id, v2.name).id == v2.id
    assert r.resolve_version(ledger, model_id, f"#{v1.id}").id == v1.id
    assert r.resolve_version(ledger, model_id, "champion").id == base.id  # before any release the base serves
    with pytest.raises(r.LedgerError, match="nobody holds 'candidate'"):
        r.resolve_version(ledger, model_id, "candidate")
    gate_pass(ledger, v1.id, None)
    r.promote(ledger, None, v1.id)
    assert r.resolve_version(ledger, model_id, "champion").id == v1.id
    with pytest.raises(r.LedgerError, match=f"matches 0 versions .*{v2.name}"):
        r.resolve_version(ledger, model_id, "v9")


def test_releases_of_different_skills_never_share_a_target_row(ledger, store):
    """v2 teaches another skill on top of v1: its target row is its own skill's, and v1's side of
    each score row is the one measured with v2 (the champion's score on v2's target, and the
    released skill's no-regression score)."""
    _, base, v1, _ = hand_made(ledger, store)
    model_id, (v2,) = make_candidates(ledger, store, unique_backbone(), skill="format", seeds=(0,))
    v2 = r.get_version(ledger, v2.id)
    r.record_evaluation(
        ledger,
        r.EvaluationRecord(
            v2.id,
            3,
            4,
            [r.DomainKL("gsm8k", 0.01)],
            release_version_id=v1.id,
            extra={
                "target_score": 1.1,
                "champion_score": 1.4,
                "released": {
                    "gsm8k": {"n": 20, "champion_score": 12.0, "score": 11.0, "mean_drop": 0.05, "sd_drop": 0.2}
                },
            },
        ),
    )
    metrics = {m.name: m for m in compare_versions(ledger, v1.id, v2.id).metrics}
    assert (metrics["target_solved[gsm8k]"].a, metrics["target_solved[gsm8k]"].b) == (12, None)
    assert (metrics["target_solved[format]"].a, metrics["target_solved[format]"].b) == (None, 3)
    assert (metrics["score[format]"].a, metrics["score[format]"].b) == (1.4, 1.1)
    assert (metrics["score[gsm8k]"].a, metrics["score[gsm8k]"].b) == (12.0, 11.0)
    assert "target_solved" not in metrics

    # A base evaluation records the skill it measured; one from before lines is the other side's.
    r.record_evaluation(ledger, r.EvaluationRecord(base.id, 9, 20, [], extra={"skill": "format"}))
    against_base = {m.name for m in compare_versions(ledger, base.id, v1.id).metrics}
    assert {"target_solved[format]", "target_solved[gsm8k]"} <= against_base
