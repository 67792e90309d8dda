"""The ledger on SQLite and PostgreSQL: migrations, lineage, results, bad input."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

import registry as r
from registry.db import VERSION_TABLE, make_engine
from registry.models import Answer, Base, Release
from tests.conftest_registry import gate_pass, make_candidates


def test_migration_from_empty_database_matches_the_models(ledger_url):
    engine = make_engine(ledger_url)
    try:
        assert inspect(engine).get_table_names() == []
        r.upgrade(ledger_url)
        tables = set(inspect(engine).get_table_names())
        assert {t.name for t in Base.metadata.sorted_tables} | {VERSION_TABLE} == tables
        with engine.connect() as conn:
            assert conn.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}")) == "0005"
            context = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": VERSION_TABLE})
            assert compare_metadata(context, Base.metadata) == []
        r.init_db(ledger_url).close()  # a second init is a no-op
        r.downgrade(ledger_url, "base")
        assert set(inspect(engine).get_table_names()) == {VERSION_TABLE}
        r.upgrade(ledger_url)
        assert set(inspect(engine).get_table_names()) == tables
    finally:
        engine.dispose()


def test_lineage_records_are_idempotent(ledger, store):
    bb = r.ensure_backbone(ledger, "Qwen/Qwen3-0.6B", "c1a2")
    assert r.ensure_backbone(ledger, "Qwen/Qwen3-0.6B", "c1a2") == bb
    assert r.ensure_backbone(ledger, "Qwen/Qwen3-0.6B", "other") != bb
    data_sha = r.sha256_bytes(b"gsm8k test split")
    ds = r.ensure_dataset(ledger, "gsm8k", "test", data_sha)
    assert r.ensure_dataset(ledger, "gsm8k", "test", data_sha) == ds

    content_hash = r.sha256_bytes(b"atlas identity")
    assert r.find_atlas(ledger, content_hash) is None
    artifact = store.put_bytes(b"atlas tensors")
    atlas = r.record_atlas(ledger, content_hash, bb, 12, {"k": 16}, artifact, [ds])
    assert r.find_atlas(ledger, content_hash) == atlas
    assert r.record_atlas(ledger, content_hash, bb, 12, {"k": 16}, artifact, [ds]) == atlas
    with pytest.raises(r.LedgerError, match="already recorded with artifact"):
        r.record_atlas(ledger, content_hash, bb, 12, {"k": 16}, store.put_bytes(b"other tensors"))

    run = r.start_training_run(ledger, bb, "mbpp", "atlas", 3, {"lr": 1e-3}, atlas_id=atlas.id, dataset_id=ds)
    assert r.last_checkpoint(ledger, run) is None
    first = r.record_checkpoint(ledger, run, 1, 50, store.put_bytes(b"adapter e1"), {"loss": 0.9})
    second = r.record_checkpoint(ledger, run, 2, 100, store.put_bytes(b"adapter e2"), {"loss": 0.5})
    assert r.record_checkpoint(ledger, run, 1, 50, store.put_bytes(b"adapter e1"), {"loss": 0.9}) == first
    with pytest.raises(r.LedgerError, match="step 50"):
        r.record_checkpoint(ledger, run, 1, 50, store.put_bytes(b"different"), {})
    assert r.last_checkpoint(ledger, run) == second
    r.finish_training_run(ledger, run, "finished")

    version = r.register_version(ledger, second.id)
    assert version.name == "Qwen3-0.6B-mbpp-atlas-s3-e2"
    assert version.model_name == "Qwen--Qwen3-0.6B.mbpp"
    assert (version.method, version.seed, version.epoch, version.step) == ("atlas", 3, 2, 100)
    assert version.adapter_sha256 == second.adapter_sha256 and version.atlas_sha256 == artifact.sha256
    assert r.register_version(ledger, second.id) == version
    base = r.base_version(ledger, version.model_id)
    assert base.is_base and base.name == "Qwen3-0.6B-base"
    assert r.base_version(ledger, version.model_id) == base
    # The base was made first: it is the parent of the version trained on the bare backbone.
    assert (version.parent_id, version.line, version.skill, version.status) == (base.id, "mbpp", "mbpp", "active")
    assert (base.parent_id, base.line, base.skill) == (None, "mbpp", None)
    assert [v.id for v in r.list_versions(ledger, version.model_id)] == [base.id, version.id]
    assert r.get_model(ledger, version.model_name).id == version.model_id
    assert r.ensure_model(ledger, bb, "mbpp").id == version.model_id


def test_backbone_weights_are_recorded_once_and_other_weights_refused(ledger):
    weights, other = "a" * 64, "b" * 64
    first = r.ensure_backbone(ledger, "bb-weights", "rev-1")  # before any cycle recorded them
    assert r.ensure_backbone(ledger, "bb-weights", "rev-1", weights) == first
    assert r.ensure_backbone(ledger, "bb-weights", "rev-1", weights) == first
    with pytest.raises(r.LedgerError, match=f"weights have sha256 {other}, the ledger recorded {weights}"):
        r.ensure_backbone(ledger, "bb-weights", "rev-1", other)
    with pytest.raises(ValueError, match="weights_sha256: expected 64"):
        r.ensure_backbone(ledger, "bb-weights", "rev-1", "not-a-hash")


def test_bad_input_names_the_field(ledger, store):
    bb = r.ensure_backbone(ledger, "m", "r")
    with pytest.raises(ValueError, match="dataset gsm8k/test sha256"):
        r.ensure_dataset(ledger, "gsm8k", "test", "not-a-hash")
    with pytest.raises(r.LedgerError, match="skill"):
        r.start_training_run(ledger, bb, "bad skill!", "atlas", 0, {})
    with pytest.raises(r.LedgerError, match="backbone id 999"):
        r.start_training_run(ledger, 999, "mbpp", "atlas", 0, {})
    with pytest.raises(r.LedgerError, match="status"):
        r.finish_training_run(ledger, 1, "exploded")
    with pytest.raises(r.LedgerError, match="model version id 42"):
        r.get_version(ledger, 42)
    with pytest.raises(r.LedgerError, match="registered model 'nope'"):
        r.get_model(ledger, "nope")


def test_evaluations_and_answers_round_trip(ledger, store):
    _, (v1, v2, _) = make_candidates(ledger, store, "org/tiny")
    record = r.EvaluationRecord(
        v2.id,
        target_solved=7,
        target_total=20,
        kl=[r.DomainKL("gsm8k", 0.01, 0.002), r.DomainKL("csqa", 0.03, None)],
        churn=[
            r.ChurnCounts("base", "gsm8k", 1, 2, 0, 10),
            r.ChurnCounts("release", "gsm8k", 0, 1, 1, 10),
            r.ChurnCounts("base", "csqa", 1, 0, 0, 10),
        ],
        csqa_choice_churn=0.1,
        release_version_id=v1.id,
        extra={"note": "x"},
        flow_run_id="fr-1",
    )
    eid = r.record_evaluation(ledger, record)
    ev = r.latest_evaluation(ledger, v2.id)
    assert ev.id == eid and (ev.target_solved, ev.target_total, ev.release_version_id) == (7, 20, v1.id)
    assert {k.domain: (k.kl_vs_base, k.kl_vs_release) for k in ev.kl} == {"gsm8k": (0.01, 0.002), "csqa": (0.03, None)}
    total = ev.churn_total("base")
    assert (total.flips_f, total.flips_g, total.flips_w, total.n) == (2, 2, 0, 20)
    assert total.nfr == pytest.approx(0.1) and ev.max_kl() == pytest.approx(0.03)
    assert r.latest_evaluation(ledger, v1.id) is None

    answers = [r.AnswerRecord("gsm8k", "q1", "42", True), r.AnswerRecord("gsm8k", "q2", None, False)]
    assert r.record_answers(ledger, v2.id, answers) == 2
    assert r.record_answers(ledger, v2.id, answers) == 0  # re-running an evaluation is safe
    assert r.get_answers(ledger, v2.id) == {("gsm8k", "q1"): answers[0], ("gsm8k", "q2"): answers[1]}
    # A conflicting rewrite is refused and the batch is all-or-nothing.
    batch = [r.AnswerRecord("gsm8k", "q3", "1", True), r.AnswerRecord("gsm8k", "q1", "41", False)]
    with pytest.raises(r.LedgerError, match=r"already stored as '42'"):
        r.record_answers(ledger, v2.id, batch)
    with ledger.transaction() as s:
        assert len(s.scalars(select(Answer).where(Answer.model_version_id == v2.id)).all()) == 2
    with pytest.raises(r.LedgerError, match="given twice"):
        r.record_answers(ledger, v1.id, [answers[0], answers[0]])
    # keep_stored: the stored answer wins (a concurrent worker's), the new question is added.
    assert r.record_answers(ledger, v2.id, batch, keep_stored=True) == 1
    assert r.get_answers(ledger, v2.id) == {("gsm8k", "q1"): answers[0], ("gsm8k", "q2"): answers[1]} | {
        ("gsm8k", "q3"): batch[0]
    }


@pytest.mark.parametrize("keep_stored", [False, True])
def test_two_workers_storing_answers_at_once_both_succeed(ledger, ledger_url, store, keep_stored):
    """Two candidates on two workers answer the champion's questions at once and both record them: on
    PostgreSQL both read "nothing stored" before either inserts (a barrier at the first INSERT makes it
    so); the second to commit hits the unique key and must accept the first's rows. Identical answers
    are accepted either way; with keep_stored the second's different answers give way, all of them."""
    import threading

    from sqlalchemy import event

    _, (v1, _, _) = make_candidates(ledger, store, "org/tiny")
    mine = [r.AnswerRecord("gsm8k", f"q{i}", str(i), i % 2 == 0) for i in range(50)]
    theirs = (
        [r.AnswerRecord(a.dataset, a.question_id, f"{a.answer}0", a.correct) for a in mine] if keep_stored else mine
    )
    both_read, passed = threading.Barrier(2, timeout=30), threading.local()

    def hold_first_insert(conn, cursor, statement, *args) -> None:
        if statement.startswith("INSERT INTO ledger_answers") and not getattr(passed, "done", False):
            passed.done = True
            both_read.wait()

    if ledger_url.startswith("postgresql"):  # SQLite's BEGIN IMMEDIATE makes the second writer wait for the first
        event.listen(ledger.engine, "before_cursor_execute", hold_first_insert)
    results, errors = {}, []

    def worker(answers) -> None:
        try:
            results[id(answers)] = r.record_answers(ledger, v1.id, answers, keep_stored=keep_stored)
        except Exception as e:  # the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(answers,)) for answers in (mine, list(theirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and sorted(results.values()) == [0, len(mine)], errors
    first = mine if results[id(mine)] else theirs
    assert r.get_answers(ledger, v1.id) == {("gsm8k", a.question_id): a for a in first}


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(kl=[r.DomainKL("gsm8k", math.nan)]), r"kl_vs_base\[gsm8k\]"),
        (dict(kl=[r.DomainKL("gsm8k", 0.1, math.inf)]), r"kl_vs_release\[gsm8k\]"),
        (dict(target_solved=5, target_total=4), "target_solved"),
        (dict(churn=[r.ChurnCounts("base", "csqa", 3, 3, 3, 5)]), r"churn\[base/csqa\]"),
        (dict(churn=[r.ChurnCounts("yesterday", "csqa", 0, 0, 0, 5)]), "against"),
        (dict(csqa_choice_churn=math.nan), "csqa_choice_churn"),
    ],
)
def test_invalid_evaluations_are_refused(ledger, store, bad, match):
    _, (v1, *_) = make_candidates(ledger, store, "org/tiny", seeds=(0,))
    fields = dict(target_solved=1, target_total=2) | bad
    with pytest.raises((r.LedgerError, ValueError), match=match):
        r.record_evaluation(ledger, r.EvaluationRecord(v1.id, **fields))
    assert r.latest_evaluation(ledger, v1.id) is None


def test_gate_decisions_record_each_threshold(ledger, store):
    _, (v1, v2, _) = make_candidates(ledger, store, "org/tiny")
    checks = [
        r.GateCheckRecord("target_gain", 1.0, 2.0, True, "2 more solved"),
        r.GateCheckRecord("kl_vs_release[gsm8k]", 0.05, math.nan, False, "metric is NaN"),
    ]
    decision = r.record_gate_decision(
        ledger, v2.id, "default", {"kl": 0.05}, checks, release_version_id=v1.id, flow_run_id="fr-2"
    )
    assert decision.passed is False
    stored = r.latest_gate_decision(ledger, v2.id)
    assert stored.id == decision.id and stored.release_version_id == v1.id and stored.passed is False
    assert [(c.name, c.threshold, c.measured, c.passed) for c in stored.checks] == [
        ("target_gain", 1.0, 2.0, True),
        ("kl_vs_release[gsm8k]", 0.05, None, False),
    ]
    assert "nan" in stored.checks[1].detail
    assert gate_pass(ledger, v2.id, v1.id).passed is True
    with pytest.raises(r.LedgerError, match="fail closed"):
        r.record_gate_decision(ledger, v2.id, "default", {}, [])
    with pytest.raises(r.LedgerError, match="must fail"):
        r.record_gate_decision(ledger, v2.id, "default", {}, [r.GateCheckRecord("nfr", 0.1, None, True)])


def test_promotion_and_rollback_in_the_ledger(ledger, store):
    """Without MLflow (bridge=None): the ledger's own rules for moving `champion`."""
    model_id, (v1, v2, v3) = make_candidates(ledger, store, "org/tiny")
    with pytest.raises(r.GateNotPassed, match="no gate decision"):
        r.promote(ledger, None, v1.id)
    r.record_gate_decision(ledger, v1.id, "p", {}, [r.GateCheckRecord("kl", 0.1, 0.5, False)])
    with pytest.raises(r.GateNotPassed, match="failed gate decision"):
        r.promote(ledger, None, v1.id)
    gate_pass(ledger, v1.id, None)
    first = r.promote(ledger, None, v1.id, reason="first release", flow_run_id="fr-1")
    assert (first.previous_version_id, first.action, first.mlflow_synced) == (None, "promote", False)
    assert r.promote(ledger, None, v1.id) == first  # idempotent: no second release
    gate_pass(ledger, v2.id, None)  # gated when there was no champion yet: now stale
    with pytest.raises(r.PromotionConflict, match="re-evaluate"):
        r.promote(ledger, None, v2.id)
    gate_pass(ledger, v2.id, v1.id)
    second = r.promote(ledger, None, v2.id, reason="better")
    assert second.previous_version_id == v1.id
    gate_pass(ledger, v3.id, v2.id)
    third = r.promote(ledger, None, v3.id)
    assert r.alias_holder(ledger, model_id).id == v3.id

    back = r.rollback(ledger, None, model_id, "v3 regressed on csqa", flow_run_id="fr-9")
    assert (back.version_id, back.previous_version_id, back.action) == (v2.id, v3.id, "rollback")
    assert back.reason == "v3 regressed on csqa"
    assert r.rollback(ledger, None, model_id, "v2 too").version_id == v1.id
    # v1 had no previous holder: champion goes back to the base (nobody holds it).
    to_base = r.rollback(ledger, None, model_id, "again")
    assert (to_base.version_id, to_base.previous_version_id) == (r.base_version(ledger, model_id).id, v1.id)
    assert r.alias_holder(ledger, model_id) is None
    with pytest.raises(r.RollbackError, match="nobody holds 'champion'"):
        r.rollback(ledger, None, model_id, "and again")
    with pytest.raises(r.RollbackError, match="reason"):
        r.rollback(ledger, None, model_id, " ")
    assert [x.id for x in r.list_releases(ledger, model_id)][:3] == [first.id, second.id, third.id]
    assert len(r.list_releases(ledger, model_id)) == 6

    r.mark_candidate(ledger, None, v3.id)  # candidate may point at a retired version
    assert r.alias_holder(ledger, model_id, "candidate").id == v3.id
    assert r.alias_holder(ledger, model_id, "champion") is None
    with pytest.raises(r.PromotionError, match="alias"):
        r.promote(ledger, None, v3.id, alias="latest")
    with ledger.transaction() as s:
        assert all(row.mlflow_synced_at is None for row in s.scalars(select(Release)))


def test_json_columns_refuse_nan_on_every_backend(ledger, store):
    bb = r.ensure_backbone(ledger, "m", "r")
    with pytest.raises(r.LedgerError, match="training config"):
        r.start_training_run(ledger, bb, "mbpp", "atlas", 0, {"lr": math.nan})
    run = r.start_training_run(ledger, bb, "mbpp", "atlas", 0, {"lr": 0.1})
    with pytest.raises(r.LedgerError, match="checkpoint metrics"):
        r.record_checkpoint(ledger, run, 1, 1, store.put_bytes(b"a"), {"loss": math.inf})
    assert r.last_checkpoint(ledger, run) is None


def test_registry_imports_nothing_else_of_the_project():
    code = (
        "import sys, registry; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('atlas_core', 'evaluation', 'flows')); print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent
    )
    assert done.returncode == 0, done.stdout + done.stderr
