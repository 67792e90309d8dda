"""Mirroring ledger records into MLflow: runs, checkpoint metrics, model versions, tags.

Each function is safe to call again after a crash: it looks for what a previous attempt
already created in MLflow (by the `ledger.*` tags) before creating anything.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional

from registry.db import Ledger, LedgerError
from registry.lineage import finish_training_run, link_mlflow_run
from registry.lines import get_version, record_manifest_sha256, set_mlflow_version, short_backbone, version_chain
from registry.mlflow_bridge import MlflowBridge, PyfuncModel
from registry.models import Atlas, Backbone, Checkpoint, Dataset, RegisteredModel, TrainingRun
from registry.queries import atlas_config, recorded_manifest_sha256, run_checkpoints, submission
from registry.results import get_answers, latest_gate_decision
from registry.rows import require_row
from registry.store import ArtifactStore, atomic_write_text, sha256_bytes

RUN_TAG = "ledger.training_run_id"
FAILURE_TAG = "atlas.failure"  # why a failed training run failed (its ledger row's `failure`)
VERSION_TAG = "ledger.version_id"
RELEASE_FORMAT = 2  # the folder layout atlas_core.release reads
MANIFEST, SIDECAR = "manifest.json", "manifest.sha256"  # atlas_core.release.MANIFEST / SIDECAR
MANIFEST_TAG = "manifest_sha256"  # the MLflow model version's tag that `models:/` loads verify


def ensure_mlflow_run(ledger: Ledger, bridge: MlflowBridge, training_run_id: int) -> str:
    """The MLflow run mirroring a training run, created (with its params) on first use."""
    with ledger.transaction() as s:
        run = require_row(s, TrainingRun, training_run_id, "training run")
        backbone = s.get(Backbone, run.backbone_id)
        atlas = s.get(Atlas, run.atlas_id) if run.atlas_id is not None else None
        dataset = s.get(Dataset, run.dataset_id) if run.dataset_id is not None else None
        data = (dataset.name, dataset.split, dataset.sha256) if dataset else None
        if run.mlflow_run_id:
            return run.mlflow_run_id
        # One experiment per line; a run recorded without a line belongs to the line of its skill.
        line = s.get(RegisteredModel, run.registered_model_id).line if run.registered_model_id else run.skill
        facts = dict(
            backbone=backbone.name,
            revision=backbone.revision,
            line=line,
            skill=run.skill,
            method=run.method,
            seed=run.seed,
            parent=run.parent_version_id,
            config=dict(run.config),
        )
    experiment = bridge.experiment_id(facts["backbone"], facts["line"])
    found = bridge.client.search_runs([experiment], filter_string=f"tags.`{RUN_TAG}` = '{training_run_id}'")
    if found:
        run_id = found[0].info.run_id
    else:
        params = {
            "backbone": facts["backbone"],
            "backbone_revision": facts["revision"],
            "line": facts["line"],
            "skill": facts["skill"],
            "method": facts["method"],
            "seed": facts["seed"],
            "parent_version_id": str(facts["parent"]),
            "atlas_content_hash": atlas.content_hash if atlas else "none",
            **{f"config.{k}": v for k, v in sorted(facts["config"].items())},
        }
        name = f"{short_backbone(facts['backbone'])}-{facts['skill']}-{facts['method']}-s{facts['seed']}"
        run_id = bridge.start_run(facts["backbone"], facts["line"], name, params, tags={RUN_TAG: str(training_run_id)})
        if data is not None:  # the skill's data snapshot, by content
            name, split, sha256 = data
            bridge.log_dataset(
                run_id,
                f"{name}:{split}",
                sha256,
                json.dumps({"dataset": name, "split": split, "sha256": sha256}, sort_keys=True),
            )
    link_mlflow_run(ledger, training_run_id, run_id)
    return run_id


def end_mlflow_run(
    ledger: Ledger, bridge: MlflowBridge, training_run_id: int, status: str, failure: Optional[str] = None
) -> None:
    """Set a training run's ledger status ("running" | "finished" | "failed", with `failure`: why) and
    its MLflow run's to match (RUNNING | FINISHED | FAILED, the reason as tag `atlas.failure`), so the
    MLflow UI shows runs end when training ends and why one failed."""
    finish_training_run(ledger, training_run_id, status, failure)
    run_id = ensure_mlflow_run(ledger, bridge, training_run_id)
    if failure is not None:
        bridge.client.set_tag(run_id, FAILURE_TAG, failure[:5000])  # MLflow caps tag values
    bridge.set_run_status(run_id, status.upper())


def log_checkpoint(ledger: Ledger, bridge: MlflowBridge, checkpoint_id: int) -> None:
    """Log a checkpoint's numeric metrics (and its epoch) at its training step."""
    with ledger.transaction() as s:
        ckpt = require_row(s, Checkpoint, checkpoint_id, "checkpoint")
        training_run_id, step, epoch = ckpt.training_run_id, ckpt.step, ckpt.epoch
        metrics = {
            k: float(v) for k, v in ckpt.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    run_id = ensure_mlflow_run(ledger, bridge, training_run_id)
    bridge.log_metrics(run_id, {**metrics, "epoch": float(epoch)}, step)


def version_tags(ledger: Ledger, version_id: int) -> dict[str, str]:
    """What a person needs on an MLflow model version: method, seed, epoch, verdict, ledger ids."""
    v = get_version(ledger, version_id)
    decision = latest_gate_decision(ledger, version_id)
    tags = {
        "version_name": v.name,
        "backbone": v.backbone,
        "line": v.line,
        "skill": str(v.skill),
        "ledger.parent_version_id": str(v.parent_id),
        "method": str(v.method),
        "seed": str(v.seed),
        "epoch": str(v.epoch),
        "step": str(v.step),
        "adapter_sha256": str(v.adapter_sha256),
        "atlas_sha256": str(v.atlas_sha256),
        "gate_verdict": "pending" if decision is None else ("pass" if decision.passed else "fail"),
        VERSION_TAG: str(v.id),
        "ledger.checkpoint_id": str(v.checkpoint_id),
        "ledger.training_run_id": str(v.training_run_id),
    }
    manifest_sha256 = recorded_manifest_sha256(ledger, version_id)
    if manifest_sha256 is not None:  # recorded when the release folder is written, before it is published
        tags[MANIFEST_TAG] = manifest_sha256
    submitted = submission(ledger, v)
    tags["source"] = "submitted" if submitted else "trained"  # `atlas submit`: an adapter trained elsewhere
    if submitted:
        tags["source_uri"], tags["source_sha256"] = str(submitted.get("source")), str(submitted.get("sha256"))
    if decision is not None:
        tags["gate_policy"] = decision.policy_name
        tags["ledger.gate_decision_id"] = str(decision.id)
        failed = [c.name for c in decision.checks if not c.passed]
        tags["gate_failed_checks"] = ", ".join(failed) if failed else "none"
    return tags


def sync_version_tags(ledger: Ledger, bridge: MlflowBridge, version_id: int) -> None:
    """Refresh a published version's tags (e.g. after the gate decided)."""
    v = get_version(ledger, version_id)
    if v.mlflow_version is None:
        raise LedgerError(f"version {v.name} (id {v.id}) is not published to MLflow yet")
    bridge.set_version_tags(v.model_name, v.mlflow_version, version_tags(ledger, version_id))


def _delta_files(ledger: Ledger, v) -> dict[str, tuple[str, str | None]]:
    """role -> (sha256, manifest sha256 or None) of a version's delta and of the atlas it routes with."""
    metrics = {cid: m for cid, _, _, m in run_checkpoints(ledger, v.training_run_id)}
    files = {"adapter": (v.adapter_sha256, metrics.get(v.checkpoint_id, {}).get("manifest_sha256"))}
    if v.atlas_sha256 is not None:
        files["atlas"] = (v.atlas_sha256, atlas_config(ledger, v.atlas_id).get("manifest_sha256"))
    return files


def _release_plan(ledger: Ledger, version_id: int) -> tuple[dict, list[tuple[str, str, str | None]]]:
    """The manifest of a version's release folder and the files it lists, as (path stem in the
    folder, sha256, the sha256 of the file's own .json manifest or None), from the ledger alone."""
    v = get_version(ledger, version_id)
    with ledger.transaction() as s:
        backbone = s.get(Backbone, s.get(RegisteredModel, v.model_id).backbone_id)
        revision, weights_sha256 = backbone.revision, backbone.weights_sha256
    chain, files = [], []
    for i, d in enumerate(version_chain(ledger, version_id), start=1):
        entry = {
            "ledger_version_id": d.id,
            "name": d.name,
            "skill": d.skill,
            "method": d.method,
            "adapter_sha256": d.adapter_sha256,
            "atlas_sha256": d.atlas_sha256,
            "atlas": None,
        }
        for role, (sha256, manifest_sha256) in _delta_files(ledger, d).items():
            stem = f"deltas/{i:02d}-{d.name}" if role == "adapter" else f"atlases/{sha256[:16]}"
            files.append((stem, sha256, manifest_sha256))
            entry[role] = f"{stem}.safetensors"
        chain.append(entry)
    manifest = {
        "format": RELEASE_FORMAT,
        "name": v.name,
        "model": v.model_name,
        "line": v.line,
        "skill": v.skill,
        "backbone": {"name": v.backbone, "revision": revision, "weights_sha256": weights_sha256},
        "method": v.method,
        "seed": v.seed,
        "epoch": v.epoch,
        "step": v.step,
        "ledger_version_id": v.id,
        "ledger_checkpoint_id": v.checkpoint_id,
        "ledger_parent_version_id": v.parent_id,
        "chain": chain,
    }
    return manifest, files


def _manifest_bytes(manifest: dict) -> bytes:
    """manifest.json as written: the same bytes for the same ledger rows, so their sha256 names the release."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def release_manifest_sha256(ledger: Ledger, version_id: int, where: str = MANIFEST) -> str:
    """The sha256 of the version's release manifest.json: the one the ledger recorded, else (a
    version whose folder was never written since the ledger records it) computed and recorded now."""
    recorded = recorded_manifest_sha256(ledger, version_id)
    if recorded is not None:
        return recorded
    sha256 = sha256_bytes(_manifest_bytes(_release_plan(ledger, version_id)[0]))
    record_manifest_sha256(ledger, version_id, sha256, where)
    return sha256


def write_release_folder(ledger: Ledger, store: ArtifactStore, version_id: int, folder: Path) -> dict:
    """The version's release folder (format of atlas_core.release): every delta of its chain and
    every atlas they route with, each with its manifest (verified copies from the store), the
    backbone by reference, answers.jsonl, then the manifest's sha256 (`manifest.sha256`, in
    sha256sum's format) and manifest.json, last: a folder with a manifest.json is complete.

    The manifest's sha256 is recorded in the ledger the first time (write-once, see
    `record_manifest_sha256`): a later write must give the same bytes or is refused before any file
    is written. Returns the manifest."""
    manifest, files = _release_plan(ledger, version_id)
    data = _manifest_bytes(manifest)
    sha256 = sha256_bytes(data)
    record_manifest_sha256(ledger, version_id, sha256, str(folder / MANIFEST))
    for stem, file_sha256, manifest_sha256 in files:
        store.fetch(file_sha256, folder / f"{stem}.safetensors")
        if manifest_sha256 is not None:  # recorded by every cycle; absent only in hand-made ledgers
            store.fetch(manifest_sha256, folder / f"{stem}.json")
    answers = sorted(get_answers(ledger, version_id).values(), key=lambda a: (a.dataset, a.question_id))
    lines = [
        json.dumps(
            {"dataset": a.dataset, "question_id": a.question_id, "answer": a.answer, "correct": a.correct},
            sort_keys=True,
        )
        for a in answers
    ]
    atomic_write_text(folder / "answers.jsonl", "".join(line + "\n" for line in lines))
    # The sidecar goes first: a crash before manifest.json leaves no manifest to verify (nor a
    # complete-looking folder), and one over an older folder leaves a pair that does not match.
    atomic_write_text(folder / SIDECAR, f"{sha256}  {MANIFEST}\n")
    atomic_write_text(folder / MANIFEST, data.decode())
    return manifest


def publish_version(
    ledger: Ledger, store: ArtifactStore, bridge: MlflowBridge, version_id: int, pyfunc: PyfuncModel | None = None
) -> str:
    """Create the MLflow model version of a ledger version; returns the MLflow version number.

    The version's release folder is logged under `versions/<name>/` of its training run and the
    version's source points there, so `models:/<name>@champion` is exactly it: with `pyfunc`
    an MLflow pyfunc model (MLmodel at the top, the folder under artifacts/release) that
    `mlflow.pyfunc.load_model` and `mlflow models serve` run; without it the bare folder.
    """
    v = get_version(ledger, version_id)
    if v.is_base:
        raise LedgerError(f"version {v.name} (id {v.id}) is the base backbone; it has no adapter to publish")
    if v.mlflow_version is not None:
        return v.mlflow_version
    run_id = ensure_mlflow_run(ledger, bridge, v.training_run_id)  # type: ignore[arg-type]
    bridge.ensure_registered_model(v.model_name, f"line {v.line} of {v.backbone}")
    existing = bridge.find_version(v.model_name, VERSION_TAG, str(v.id))
    if existing is None:
        artifact_path = f"versions/{v.name}"
        with tempfile.TemporaryDirectory(prefix="registry-publish-") as tmp:
            folder = Path(tmp) / "release"
            write_release_folder(ledger, store, version_id, folder)
            if pyfunc is None:
                bridge.log_folder(run_id, folder, artifact_path)
            else:
                bridge.log_pyfunc(run_id, artifact_path, folder, pyfunc)
        existing = bridge.create_version(
            v.model_name, run_id, artifact_path, version_tags(ledger, version_id), description=v.name
        )
    set_mlflow_version(ledger, version_id, existing)
    return existing
