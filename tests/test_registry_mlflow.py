"""The MLflow bridge with the ledger: publishing, promotion, rollback, race, crash and repair.

One MLflow tracking database serves the whole module; every test uses its own backbone,
so its registered model is its own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlflow.artifacts
import pytest
from mlflow import MlflowClient

import registry as r
from tests.conftest_registry import (
    gate_pass,
    make_candidates,
    run_worker,
    unique_backbone,
)


def released_model(ledger, store, bridge, seeds=(0, 1, 2)):
    """Candidates published to MLflow, the first one champion; the others gated against it."""
    model_id, versions = make_candidates(ledger, store, unique_backbone(), seeds=seeds)
    for v in versions:
        r.record_answers(ledger, v.id, [r.AnswerRecord("gsm8k", "q1", str(v.seed), v.seed == 0)])
        r.publish_version(ledger, store, bridge, v.id)
    gate_pass(ledger, versions[0].id, None)
    r.promote(ledger, bridge, versions[0].id, reason="first release")
    for v in versions[1:]:
        gate_pass(ledger, v.id, versions[0].id)
    return model_id, [r.get_version(ledger, v.id) for v in versions]


def test_runs_versions_and_tags_are_readable_in_mlflow(ledger, store, bridge, mlflow_config):
    model_id, (v0, v1, _) = released_model(ledger, store, bridge)
    client = MlflowClient(tracking_uri=mlflow_config.tracking_uri, registry_uri=mlflow_config.tracking_uri)
    run = client.get_run(v1.mlflow_run_id)
    assert run.info.run_name == f"{v1.backbone.rsplit('/', 1)[-1]}-gsm8k-atlas-s1"
    assert run.data.params["method"] == "atlas" and run.data.params["config.lr"] == "0.001"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == f"{v1.backbone} / gsm8k"
    assert experiment.artifact_location.startswith(mlflow_config.artifact_root)

    ckpt = r.last_checkpoint(ledger, v1.training_run_id)
    r.log_checkpoint(ledger, bridge, ckpt.id)
    history = client.get_metric_history(v1.mlflow_run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(10, 0.5)]

    mv = client.get_model_version(v1.model_name, v1.mlflow_version)
    assert mv.description == v1.name
    assert mv.tags["version_name"] == v1.name
    assert (mv.tags["method"], mv.tags["seed"], mv.tags["epoch"]) == ("atlas", "1", "1")
    assert mv.tags["ledger.version_id"] == str(v1.id) and mv.tags["gate_verdict"] == "pending"
    r.sync_version_tags(ledger, bridge, v1.id)  # after the gate decided
    tags = bridge.version_tags(v1.model_name, v1.mlflow_version)
    assert tags["gate_verdict"] == "pass" and tags["gate_policy"] == "test-policy"
    # Publishing again neither duplicates the version nor re-uploads.
    assert r.publish_version(ledger, store, bridge, v1.id) == v1.mlflow_version
    assert len(client.search_model_versions(f"name = '{v1.model_name}'")) == 3
    assert bridge.aliases(v0.model_name) == {"champion": v0.mlflow_version}


def test_champion_download_has_the_ledger_files(ledger, store, bridge, mlflow_config, tmp_path, monkeypatch):
    model_id, (v0, v1, _) = released_model(ledger, store, bridge)
    r.promote(ledger, bridge, v1.id, reason="better")
    # A plain MLflow user: configured by environment, resolving a `models:/` URI.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_config.tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", mlflow_config.tracking_uri)
    folder = Path(
        mlflow.artifacts.download_artifacts(f"models:/{v1.model_name}@champion", dst_path=str(tmp_path / "dl"))
    )
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["ledger_version_id"] == v1.id and manifest["line"] == "gsm8k" and manifest["format"] == 2
    assert manifest["backbone"] == {"name": v1.backbone, "revision": "rev-1", "weights_sha256": None}
    (entry,) = manifest["chain"]  # the release folder holds every delta of the chain and its atlas
    assert entry["adapter_sha256"] == v1.adapter_sha256 and sha(folder / entry["adapter"]) == v1.adapter_sha256
    assert entry["atlas_sha256"] == v1.atlas_sha256 and sha(folder / entry["atlas"]) == v1.atlas_sha256
    answers = [json.loads(line) for line in (folder / "answers.jsonl").read_text().splitlines()]
    assert answers == [{"dataset": "gsm8k", "question_id": "q1", "answer": "1", "correct": False}]
    # The manifest's sha256: in the ledger, as the version's tag and in the folder's sidecar.
    manifest_sha = sha(folder / "manifest.json")
    assert r.recorded_manifest_sha256(ledger, v1.id) == manifest_sha
    assert bridge.version_tags(v1.model_name, v1.mlflow_version)[r.MANIFEST_TAG] == manifest_sha
    assert (folder / "manifest.sha256").read_text() == f"{manifest_sha}  manifest.json\n"
    again = bridge.download_version(v1.model_name, "champion", tmp_path / "dl2")
    assert sha(again / entry["adapter"]) == v1.adapter_sha256


def test_a_training_run_shows_running_failed_and_finished_in_mlflow(ledger, store, bridge):
    _, (v0,) = make_candidates(ledger, store, unique_backbone(), seeds=(0,))
    run_id = r.ensure_mlflow_run(ledger, bridge, v0.training_run_id)
    for status in ("failed", "running", "finished"):  # failed, resumed by a rerun, then done
        r.end_mlflow_run(ledger, bridge, v0.training_run_id, status)
        info = bridge.client.get_run(run_id).info
        assert info.status == status.upper()
        if status != "running":
            assert info.end_time is not None
    with ledger.transaction() as s:
        from registry.models import TrainingRun

        assert s.get(TrainingRun, v0.training_run_id).status == "finished"


def test_publish_refuses_a_corrupted_adapter(ledger, store, bridge):
    _, (v0,) = make_candidates(ledger, store, unique_backbone(), seeds=(0,))
    Path(store.path_for(v0.adapter_sha256)).write_bytes(b"bit rot")
    with pytest.raises(r.ArtifactCorruptedError, match=v0.adapter_sha256):
        r.publish_version(ledger, store, bridge, v0.id)
    assert r.get_version(ledger, v0.id).mlflow_version is None


def test_a_release_folder_written_again_must_be_the_one_recorded(ledger, store, bridge, tmp_path):
    """Write-once: once a version's manifest sha256 is recorded (here by publishing), a new write
    from changed ledger rows (the backbone's weights recorded later) is refused before any file."""
    backbone = unique_backbone()
    _, (v0,) = make_candidates(ledger, store, backbone, seeds=(0,))
    r.publish_version(ledger, store, bridge, v0.id)
    recorded = r.recorded_manifest_sha256(ledger, v0.id)
    r.write_release_folder(ledger, store, v0.id, tmp_path / "again")  # the same rows: the same bytes
    assert hashlib.sha256((tmp_path / "again" / "manifest.json").read_bytes()).hexdigest() == recorded
    r.ensure_backbone(ledger, backbone, "rev-1", "ab" * 32)
    with pytest.raises(r.ArtifactError, match=recorded) as e:
        r.write_release_folder(ledger, store, v0.id, tmp_path / "changed")
    assert str(tmp_path / "changed" / "manifest.json") in str(e.value) and not (tmp_path / "changed").exists()
    assert r.recorded_manifest_sha256(ledger, v0.id) == recorded


def test_promote_and_rollback_move_mlflow_aliases(ledger, store, bridge):
    model_id, (v0, v1, v2) = released_model(ledger, store, bridge)
    unpublished = make_candidates(ledger, store, v0.backbone, seeds=(7,))[1][0]
    with pytest.raises(r.PromotionError, match="not in MLflow"):
        r.promote(ledger, bridge, unpublished.id)
    release = r.promote(ledger, bridge, v1.id, reason="target +2", flow_run_id="flow-1")
    assert release.mlflow_synced and release.previous_version_id == v0.id
    assert bridge.aliases(v1.model_name)["champion"] == v1.mlflow_version
    r.mark_candidate(ledger, bridge, v2.id)
    assert bridge.aliases(v1.model_name) == {"champion": v1.mlflow_version, "candidate": v2.mlflow_version}
    back = r.rollback(ledger, bridge, model_id, "NFR regression reported by users")
    assert back.version_id == v0.id and back.mlflow_synced
    assert bridge.aliases(v1.model_name)["champion"] == v0.mlflow_version
    assert r.repair(ledger, bridge, model_id) == []  # already in agreement


def test_rollback_to_the_base_removes_the_mlflow_alias(ledger, store, bridge):
    model_id, (v0,) = released_model(ledger, store, bridge, seeds=(0,))
    back = r.rollback(ledger, bridge, model_id, "the first release was bad")
    assert back.version_id == r.base_version(ledger, model_id).id and back.mlflow_synced
    assert "champion" not in bridge.aliases(v0.model_name)  # nobody holds it: the base serves
    assert r.repair(ledger, bridge, model_id) == []
    bridge.set_alias(v0.model_name, "champion", v0.mlflow_version)  # someone clicked in the UI
    assert r.repair(ledger, bridge, model_id) == [f"{v0.model_name}@champion: removed (the ledger has no holder)"]
    with pytest.raises(r.PromotionError, match="retired by rollback"):
        r.promote(ledger, bridge, v0.id)


def test_repair_restores_aliases_changed_behind_the_ledger(ledger, store, bridge):
    model_id, (v0, v1, v2) = released_model(ledger, store, bridge)
    bridge.set_alias(v0.model_name, "champion", v2.mlflow_version)  # someone clicked in the UI
    bridge.set_alias(v0.model_name, "candidate", v1.mlflow_version)
    changes = r.repair(ledger, bridge)
    assert any("champion" in c for c in changes) and any("candidate: removed" in c for c in changes)
    assert bridge.aliases(v0.model_name) == {"champion": v0.mlflow_version}


def test_crash_between_ledger_commit_and_mlflow_is_repaired(ledger, ledger_url, store, bridge, mlflow_config):
    model_id, (v0, v1, _) = released_model(ledger, store, bridge)
    proc = run_worker(
        {
            "mode": "crash",
            "ledger_url": ledger_url,
            "tracking_uri": mlflow_config.tracking_uri,
            "artifact_root": mlflow_config.artifact_root,
            "version_id": v1.id,
            "reason": "crash",
        }
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    # The ledger committed; MLflow still shows the old champion.
    assert r.alias_holder(ledger, model_id).id == v1.id
    latest = r.list_releases(ledger, model_id)[-1]
    assert latest.version_id == v1.id and not latest.mlflow_synced
    assert bridge.aliases(v1.model_name)["champion"] == v0.mlflow_version

    assert r.repair(ledger, bridge) == [
        f"{v1.model_name}@champion: {v0.mlflow_version} -> {v1.mlflow_version} ({v1.name} (id {v1.id}))"
    ]
    assert bridge.aliases(v1.model_name)["champion"] == v1.mlflow_version
    assert all(rel.mlflow_synced for rel in r.list_releases(ledger, model_id))
    # Re-running the interrupted promotion is a no-op.
    assert r.promote(ledger, bridge, v1.id).id == latest.id
    assert len(r.list_releases(ledger, model_id)) == 2


def test_two_processes_racing_to_promote_only_one_wins(ledger, ledger_url, store, bridge, mlflow_config, tmp_path):
    model_id, (v0, v1, v2) = released_model(ledger, store, bridge)
    ready = [str(tmp_path / "ready-1"), str(tmp_path / "ready-2")]
    requested = [str(tmp_path / "requested-1"), str(tmp_path / "requested-2")]
    common = {
        "mode": "race",
        "ledger_url": ledger_url,
        "tracking_uri": mlflow_config.tracking_uri,
        "artifact_root": mlflow_config.artifact_root,
        "wait_for": ready,
        "holder": str(tmp_path / "holder"),
    }
    procs = [
        run_worker(
            {
                **common,
                "version_id": v.id,
                "reason": f"race {v.name}",
                "ready": ready[i],
                "me": requested[i],
                "other": requested[1 - i],
            },
            background=True,
        )
        for i, v in enumerate((v1, v2))
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(res["won"] for res in results) == [False, True], results
    winner = (v1, v2)[[res["won"] for res in results].index(True)]
    loser_message = next(res["error"] for res in results if not res["won"])
    assert winner.name in loser_message and "re-evaluate" in loser_message
    # It was decided by the lock: the winner held it first and waited for the loser to ask for it
    # (on PostgreSQL, until the server showed the loser's backend waiting on the lock); the loser
    # asked before the winner released it and got it only after.
    won, lost = (next(res["stamps"] for res in results if res["won"] is w) for w in (True, False))
    assert won.get("held_first") and not lost.get("held_first")
    assert lost["request"] < won["committing"] < lost["acquired"], (won, lost)

    assert r.alias_holder(ledger, model_id).id == winner.id
    assert bridge.aliases(winner.model_name)["champion"] == winner.mlflow_version
    releases = r.list_releases(ledger, model_id)
    assert [(x.version_id, x.previous_version_id) for x in releases] == [(v0.id, None), (winner.id, v0.id)]
    assert all(x.mlflow_synced for x in releases)
    # Nothing is lost: the loser is still a published, gated version that can be re-evaluated.
    loser = v2 if winner is v1 else v1
    assert r.get_version(ledger, loser.id).mlflow_version == loser.mlflow_version
    assert r.latest_gate_decision(ledger, loser.id).passed
