"""Lines, version chains, unique names, rollback to the base, re-nomination, read-only queries."""

from __future__ import annotations

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

import registry as r
from registry.models import ModelVersion, TrainingRun
from tests.conftest_registry import gate_pass


def train(ledger, store, backbone_id, model_id, skill="code", seed=0, epoch=1, parent=None, snapshot=b"v1"):
    """One training run of `skill` on a line (on top of `parent`), registered as a version."""
    dataset = r.ensure_dataset(ledger, skill, "train", r.sha256_bytes(snapshot))
    run = r.start_training_run(
        ledger,
        backbone_id,
        skill,
        "atlas",
        seed,
        {"run_key": snapshot.hex()},
        dataset_id=dataset,
        model_id=model_id,
        parent_version_id=parent,
    )
    adapter = store.put_bytes(b"adapter of run %d" % run)
    return r.register_version(ledger, r.record_checkpoint(ledger, run, epoch, 10 * epoch, adapter, {}).id)


def line(ledger, name="code", backbone="org/tiny", revision="rev-1"):
    backbone_id = r.ensure_backbone(ledger, backbone, revision)
    return backbone_id, r.ensure_model(ledger, backbone_id, name)


def test_a_changed_revision_starts_a_new_line(ledger, store):
    old_bb, old = line(ledger, revision="aaaaaaaa1111")
    new_bb, new = line(ledger, revision="bbbbbbbb2222")
    assert (old.name, old.line, old.revision) == ("org--tiny.code", "code", "aaaaaaaa1111")
    assert (new.name, new.line, new.revision) == ("org--tiny.code-revbbbbbbbb", "code", "bbbbbbbb2222")
    assert r.ensure_model(ledger, new_bb, "code") == new and r.get_model(ledger, new.name) == new
    # A run recorded without a line lands in the line of its skill on its own backbone row.
    run = r.start_training_run(ledger, new_bb, "code", "atlas", 0, {})
    version = r.register_version(ledger, r.record_checkpoint(ledger, run, 1, 1, store.put_bytes(b"a"), {}).id)
    assert version.model_id == new.id and version.parent_id == r.base_version(ledger, new.id).id
    clash_bb = r.ensure_backbone(ledger, "org/tiny", "bbbbbbbb3333")  # same first 8 characters
    with pytest.raises(r.LedgerError, match="both taken by other lines"):
        r.ensure_model(ledger, clash_bb, "code")
    with pytest.raises(r.LedgerError, match="line"):
        r.ensure_model(ledger, old_bb, "no spaces")


def test_versions_chain_through_their_parents(ledger, store):
    bb, code = line(ledger)
    v1 = train(ledger, store, bb, code.id)
    base = r.base_version(ledger, code.id)
    assert (v1.parent_id, v1.line, v1.skill) == (base.id, "code", "code")
    with ledger.transaction() as s:  # the run records what it was trained on: the bare backbone
        run = s.get(TrainingRun, v1.training_run_id)
        assert (run.registered_model_id, run.parent_version_id) == (code.id, base.id)
    v2 = train(ledger, store, bb, code.id, skill="gsm8k", parent=v1.id)
    assert (v2.parent_id, v2.line, v2.skill, v2.model_id) == (v1.id, "code", "gsm8k", code.id)
    assert r.version_chain(ledger, v2.id) == [v1, v2]
    assert r.version_chain(ledger, v1.id) == [v1]
    assert r.version_chain(ledger, base.id) == []

    _, other = line(ledger, "other")
    with pytest.raises(r.LedgerError, match=f"parent_version_id={v1.id}: .* not in line {other.name}"):
        r.start_training_run(ledger, bb, "code", "atlas", 0, {}, model_id=other.id, parent_version_id=v1.id)
    with pytest.raises(r.LedgerError, match="parent_version_id=.*needs model_id"):
        r.start_training_run(ledger, bb, "code", "atlas", 0, {}, parent_version_id=v1.id)
    with pytest.raises(r.LedgerError, match=f"model_id={code.id}: .* not on backbone id"):
        r.start_training_run(
            ledger, r.ensure_backbone(ledger, "org/else", "r"), "code", "atlas", 0, {}, model_id=code.id
        )

    with ledger.transaction() as s:  # a hand-edited ledger: v1 on top of v2 on top of v1
        s.execute(update(ModelVersion).where(ModelVersion.id == v1.id).values(parent_version_id=v2.id))
    with pytest.raises(r.LedgerError, match="loops"):
        r.version_chain(ledger, v2.id)
    other_base = r.base_version(ledger, other.id)
    with ledger.transaction() as s:
        s.execute(update(ModelVersion).where(ModelVersion.id == v1.id).values(parent_version_id=other_base.id))
    with pytest.raises(r.LedgerError, match="in another line"):
        r.version_chain(ledger, v2.id)


def test_version_names_are_unique_within_a_line(ledger, store):
    bb, code = line(ledger)
    first = train(ledger, store, bb, code.id, snapshot=b"snapshot 1")
    again = train(ledger, store, bb, code.id, snapshot=b"snapshot 2")  # same skill, method, seed, epoch
    third = train(ledger, store, bb, code.id, parent=first.id, snapshot=b"snapshot 3")
    assert (first.name, again.name, third.name) == (
        "tiny-code-atlas-s0-e1",
        "tiny-code-atlas-s0-e1-r2",
        "tiny-code-atlas-s0-e1-r3",
    )
    for v in (first, again, third):
        assert r.resolve_version(ledger, code.name, v.name).id == v.id
        assert r.resolve_version(ledger, code.id, f"#{v.id}").id == v.id
    with pytest.raises(r.LedgerError, match="matches 0 versions"):
        r.resolve_version(ledger, code.id, "mlflow:None")  # unpublished versions have no MLflow number
    _, other = line(ledger, "other")
    assert train(ledger, store, bb, other.id).name == first.name  # another line has its own names
    with pytest.raises(IntegrityError):
        with ledger.transaction() as s:
            s.execute(update(ModelVersion).where(ModelVersion.id == again.id).values(name=first.name))


def test_rollback_retires_and_only_renominate_makes_it_promotable(ledger, store):
    bb, code = line(ledger)
    base = r.base_version(ledger, code.id)
    v1 = train(ledger, store, bb, code.id)
    v2 = train(ledger, store, bb, code.id, parent=v1.id)
    gate_pass(ledger, v1.id, None)
    r.promote(ledger, None, v1.id)
    gate_pass(ledger, v2.id, v1.id)
    r.promote(ledger, None, v2.id)

    back = r.rollback(ledger, None, code.id, "v2 broke csqa")
    assert (back.version_id, back.previous_version_id) == (v1.id, v2.id)
    assert r.get_version(ledger, v2.id).status == "retired" and r.get_version(ledger, v1.id).status == "active"
    assert [v.id for v in r.list_versions(ledger, code.id, include_retired=False)] == [base.id, v1.id]
    assert [v.id for v in r.list_versions(ledger, code.id)] == [base.id, v1.id, v2.id]
    gate_pass(ledger, v2.id, v1.id)  # a later cycle gates it again against the champion
    with pytest.raises(
        r.PromotionError,
        match=rf"retired by rollback \(release #{back.id}: v2 broke csqa\).*"
        "`atlas renominate`",
    ):
        r.promote(ledger, None, v2.id)
    with pytest.raises(r.PromotionError, match="active, not retired"):
        r.renominate(ledger, v1.id, "nothing to lift")
    with pytest.raises(r.PromotionError, match="reason"):
        r.renominate(ledger, v2.id, "")

    again = r.renominate(ledger, v2.id, "csqa fixed upstream")
    assert (again.action, again.alias, again.version_id, again.previous_version_id, again.reason) == (
        "renominate",
        "champion",
        v2.id,
        v1.id,
        "csqa fixed upstream",
    )
    assert r.alias_holder(ledger, code.id).id == v1.id  # re-nominating moves nothing
    assert r.get_version(ledger, v2.id).status == "active"
    assert r.promote(ledger, None, v2.id).version_id == v2.id
    assert [h.action for h in r.release_history(ledger, code.id)] == [
        "promote",
        "promote",
        "rollback",
        "renominate",
        "promote",
    ]


def test_rollback_without_a_previous_holder_goes_to_the_base(ledger, store):
    bb, code = line(ledger)
    v1 = train(ledger, store, bb, code.id)
    gate_pass(ledger, v1.id, None)
    r.promote(ledger, None, v1.id)
    back = r.rollback(ledger, None, code.id, "first release was bad")
    base = r.base_version(ledger, code.id)
    assert (back.action, back.version_id, back.previous_version_id) == ("rollback", base.id, v1.id)
    assert r.alias_holder(ledger, code.id) is None  # nobody holds champion: the base serves
    assert r.get_version(ledger, v1.id).status == "retired"
    with pytest.raises(r.PromotionError, match="retired by rollback"):
        r.promote(ledger, None, v1.id)
    v2 = train(ledger, store, bb, code.id, snapshot=b"v2")
    gate_pass(ledger, v2.id, None)  # gated against the base, which is what serves
    assert r.promote(ledger, None, v2.id).previous_version_id is None


def test_read_only_queries(ledger, store):
    bb, code = line(ledger)
    _, other = line(ledger, "other")
    runs = {}
    for model in (code, other):
        runs[model.id] = r.start_training_run(ledger, bb, "code", "atlas", 0, {"run_key": "k"}, model_id=model.id)
    assert r.find_training_run(ledger, bb, "code", "atlas", 0, "k") == (runs[code.id], "running")
    assert r.find_training_run(ledger, bb, "code", "atlas", 0, "k", model_id=other.id) == (runs[other.id], "running")
    assert r.find_training_run(ledger, bb, "code", "atlas", 0, "other key") is None
    later = r.record_checkpoint(ledger, runs[code.id], 2, 20, store.put_bytes(b"e2"), {"loss": 0.5})
    first = r.record_checkpoint(ledger, runs[code.id], 1, 10, store.put_bytes(b"e1"), {"loss": 0.9})
    assert r.run_checkpoints(ledger, runs[code.id]) == [
        (first.id, 1, 10, {"loss": 0.9}),
        (later.id, 2, 20, {"loss": 0.5}),
    ]
    version = r.register_version(ledger, first.id)
    assert r.run_versions(ledger, runs[code.id]) == [version] and r.run_versions(ledger, runs[other.id]) == []
    assert r.training_run_config(ledger, runs[code.id]) == {"run_key": "k"}
    with pytest.raises(r.LedgerError, match="training run id 999"):
        r.training_run_config(ledger, 999)
    evaluation = r.record_evaluation(ledger, r.EvaluationRecord(version.id, 1, 2, extra={"note": "x"}))
    assert r.evaluation_extra(ledger, evaluation) == {"note": "x"} and r.evaluation_extra(ledger, 999) == {}
    decision = gate_pass(ledger, version.id, None)
    assert [d[:3] for d in r.recent_decisions(ledger, code.id)] == [(decision.id, version.name, True)]
    assert r.recent_decisions(ledger, other.id) == []
    r.start_training_run(ledger, bb, "gsm8k", "atlas", 1, {}, model_id=code.id)
    assert [(x["skill"], x["seed"]) for x in r.recent_training_runs(ledger, bb, None, model_id=code.id)] == [
        ("gsm8k", 1),
        ("code", 0),
    ]
    assert [x["id"] for x in r.recent_training_runs(ledger, bb, "code", 1)] == [runs[other.id]]
    atlas = r.record_atlas(
        ledger, r.sha256_bytes(b"key"), bb, 2, {"manifest_sha256": "m" * 64}, store.put_bytes(b"atlas")
    )
    assert r.atlas_files(ledger, atlas.id) == (atlas.artifact_sha256, "m" * 64)
    with pytest.raises(r.LedgerError, match="atlas id 999"):
        r.atlas_files(ledger, 999)
