"""Recording where a version comes from: backbone, data, atlas, training run, checkpoint.

Functions that "ensure" a row are idempotent: calling them again with the same identity
returns the existing row, so a flow that is retried after a crash does not duplicate it.
Lines and versions are in `registry.lines`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.db import Ledger, LedgerError
from registry.lines import base_row, lock_line
from registry.models import Atlas, AtlasDataset, Backbone, Checkpoint, Dataset, ModelVersion, TrainingRun, utcnow
from registry.records import AtlasInfo, CheckpointInfo
from registry.rows import json_field, once_more_on_conflict, require_name, require_row
from registry.store import StoredArtifact, check_sha256

RUN_STATUSES = ("running", "finished", "failed")


# -- backbones, datasets, atlases ------------------------------------------------------


def ensure_backbone(ledger: Ledger, name: str, revision: str, weights_sha256: Optional[str] = None) -> int:
    """The backbone row of (name, revision); records the weights' sha256 when given, and refuses
    one that differs from what was recorded (same revision, other weights)."""
    if not name or not revision:
        raise LedgerError(f"backbone: name and revision are required, got {name!r}, {revision!r}")
    if weights_sha256 is not None:
        check_sha256(weights_sha256, "backbone weights_sha256")

    def create() -> int:
        with ledger.transaction() as s:
            row = s.scalar(select(Backbone).where(Backbone.name == name, Backbone.revision == revision))
            if row is None:
                row = Backbone(name=name, revision=revision)
                s.add(row)
            if weights_sha256 is not None:
                if row.weights_sha256 not in (None, weights_sha256):
                    raise LedgerError(
                        f"backbone {name!r} at revision {revision}: its weights have sha256 "
                        f"{weights_sha256}, the ledger recorded {row.weights_sha256}"
                    )
                row.weights_sha256 = weights_sha256
            s.flush()
            return row.id

    return once_more_on_conflict(create)


def ensure_dataset(ledger: Ledger, name: str, split: str, sha256: str) -> int:
    check_sha256(sha256, f"dataset {name}/{split} sha256")

    def create() -> int:
        with ledger.transaction() as s:
            row = s.scalar(
                select(Dataset).where(Dataset.name == name, Dataset.split == split, Dataset.sha256 == sha256)
            )
            if row is None:
                row = Dataset(name=name, split=split, sha256=sha256)
                s.add(row)
                s.flush()
            return row.id

    return once_more_on_conflict(create)


def _atlas_info(row: Atlas) -> AtlasInfo:
    return AtlasInfo(
        row.id, row.content_hash, row.backbone_id, row.layer, dict(row.config), row.artifact_sha256, row.artifact_uri
    )


def find_atlas(ledger: Ledger, content_hash: str) -> Optional[AtlasInfo]:
    """The stored atlas with this content hash, so `refresh_atlas` can reuse it."""
    with ledger.transaction() as s:
        row = s.scalar(select(Atlas).where(Atlas.content_hash == check_sha256(content_hash, "content_hash")))
        return _atlas_info(row) if row else None


def find_atlas_file(ledger: Ledger, artifact_sha256: str) -> Optional[AtlasInfo]:
    """The first atlas recorded with this file (sha256), e.g. the one a submitted residual routes with."""
    with ledger.transaction() as s:
        row = s.scalar(
            select(Atlas)
            .where(Atlas.artifact_sha256 == check_sha256(artifact_sha256, "atlas sha256"))
            .order_by(Atlas.id)
            .limit(1)
        )
        return _atlas_info(row) if row else None


def record_atlas(
    ledger: Ledger,
    content_hash: str,
    backbone_id: int,
    layer: int,
    config: dict[str, Any],
    artifact: StoredArtifact,
    dataset_ids: Sequence[int] = (),
) -> AtlasInfo:
    """Record a fitted atlas; recording the same content hash again returns the first record."""
    check_sha256(content_hash, "content_hash")
    check_sha256(artifact.sha256, "atlas artifact sha256")
    with ledger.transaction() as s:
        existing = s.scalar(select(Atlas).where(Atlas.content_hash == content_hash))
        if existing is not None:
            if existing.artifact_sha256 != artifact.sha256:
                raise LedgerError(
                    f"atlas {content_hash}: already recorded with artifact {existing.artifact_sha256}, "
                    f"not {artifact.sha256}"
                )
            return _atlas_info(existing)
        require_row(s, Backbone, backbone_id, "backbone")
        row = Atlas(
            content_hash=content_hash,
            backbone_id=backbone_id,
            layer=int(layer),
            config=json_field(config, "atlas config"),
            artifact_sha256=artifact.sha256,
            artifact_uri=artifact.uri,
        )
        s.add(row)
        s.flush()
        for dataset_id in sorted(set(dataset_ids)):
            require_row(s, Dataset, dataset_id, "dataset")
            s.add(AtlasDataset(atlas_id=row.id, dataset_id=dataset_id))
        return _atlas_info(row)


# -- training runs and checkpoints -----------------------------------------------------


def start_training_run(
    ledger: Ledger,
    backbone_id: int,
    skill: str,
    method: str,
    seed: int,
    config: dict[str, Any],
    atlas_id: Optional[int] = None,
    dataset_id: Optional[int] = None,
    flow_run_id: Optional[str] = None,
    *,
    model_id: Optional[int] = None,
    parent_version_id: Optional[int] = None,
) -> int:
    """Record a training run that starts now; returns its id.

    `model_id` is the line it trains a delta for and `parent_version_id` the version of that
    line it trains on top of (default: the line's base version, the bare backbone). A run
    without a line registers its versions in the line named after its skill.
    """
    require_name(skill, "skill")
    require_name(method, "method")
    with ledger.transaction() as s:
        require_row(s, Backbone, backbone_id, "backbone")
        if atlas_id is not None:
            require_row(s, Atlas, atlas_id, "atlas")
        if dataset_id is not None:
            require_row(s, Dataset, dataset_id, "dataset")
        parent_id = _training_parent(s, backbone_id, model_id, parent_version_id)
        row = TrainingRun(
            backbone_id=backbone_id,
            skill=skill,
            method=method,
            seed=int(seed),
            config=json_field(config, "training config"),
            atlas_id=atlas_id,
            dataset_id=dataset_id,
            registered_model_id=model_id,
            parent_version_id=parent_id,
            status="running",
            flow_run_id=flow_run_id,
        )
        s.add(row)
        s.flush()
        return row.id


def _training_parent(
    s: Session, backbone_id: int, model_id: Optional[int], parent_version_id: Optional[int]
) -> Optional[int]:
    """The checked parent version id of a new training run (None: a run without a line)."""
    if model_id is None:
        if parent_version_id is not None:
            raise LedgerError(f"parent_version_id={parent_version_id}: needs model_id, the line it belongs to")
        return None
    model = lock_line(s, model_id)
    if model.backbone_id != backbone_id:
        raise LedgerError(
            f"model_id={model_id}: line {model.name} is on backbone id {model.backbone_id}, "
            f"not on backbone id {backbone_id}"
        )
    if parent_version_id is None:
        return base_row(s, model).id
    parent = require_row(s, ModelVersion, parent_version_id, "parent model version")
    if parent.registered_model_id != model_id:
        raise LedgerError(
            f"parent_version_id={parent_version_id}: version {parent.name} is in registered model "
            f"id {parent.registered_model_id}, not in line {model.name} (id {model_id})"
        )
    return parent.id


def complete_run_config(ledger: Ledger, training_run_id: int, key: str, value: Any) -> None:
    """Add `key` to a run's stored config once (e.g. the skill spec a submitted adapter was gated
    for); the same value again is a no-op, another value is refused: a run's config never changes."""
    with ledger.transaction() as s:
        row = require_row(s, TrainingRun, training_run_id, "training run")
        config = dict(row.config)
        if key in config and config[key] != value:
            raise LedgerError(
                f"training run {training_run_id}: its config already records {key} = {config[key]!r}, not {value!r}"
            )
        row.config = json_field(config | {key: value}, "training config")


def link_mlflow_run(ledger: Ledger, training_run_id: int, mlflow_run_id: str) -> None:
    with ledger.transaction() as s:
        require_row(s, TrainingRun, training_run_id, "training run").mlflow_run_id = mlflow_run_id


def finish_training_run(
    ledger: Ledger, training_run_id: int, status: str = "finished", failure: Optional[str] = None
) -> None:
    """Set a training run's status; `failure` (why it failed) only with status "failed"."""
    if status not in RUN_STATUSES:
        raise LedgerError(f"training run status: expected one of {RUN_STATUSES}, got {status!r}")
    if failure is not None and status != "failed":
        raise LedgerError(f"training run failure: only a failed run has one (status {status!r})")
    with ledger.transaction() as s:
        row = require_row(s, TrainingRun, training_run_id, "training run")
        row.status = status
        row.failure = failure
        row.finished_at = None if status == "running" else utcnow()


def _checkpoint_info(row: Checkpoint) -> CheckpointInfo:
    return CheckpointInfo(
        row.id, row.training_run_id, row.epoch, row.step, row.adapter_sha256, row.adapter_uri, dict(row.metrics)
    )


def record_checkpoint(
    ledger: Ledger, training_run_id: int, epoch: int, step: int, adapter: StoredArtifact, metrics: dict[str, float]
) -> CheckpointInfo:
    """Record a saved adapter. The same (run, step) twice is accepted only with the same file."""
    check_sha256(adapter.sha256, "adapter sha256")
    if epoch < 0 or step < 0:
        raise LedgerError(f"checkpoint: epoch and step must be >= 0, got epoch={epoch} step={step}")
    with ledger.transaction() as s:
        require_row(s, TrainingRun, training_run_id, "training run")
        existing = s.scalar(
            select(Checkpoint).where(Checkpoint.training_run_id == training_run_id, Checkpoint.step == step)
        )
        if existing is not None:
            if existing.adapter_sha256 != adapter.sha256:
                raise LedgerError(
                    f"training run {training_run_id} step {step}: a checkpoint with adapter "
                    f"{existing.adapter_sha256} is already recorded, not {adapter.sha256}"
                )
            return _checkpoint_info(existing)
        row = Checkpoint(
            training_run_id=training_run_id,
            epoch=int(epoch),
            step=int(step),
            adapter_sha256=adapter.sha256,
            adapter_uri=adapter.uri,
            metrics=json_field(metrics, "checkpoint metrics"),
        )
        s.add(row)
        s.flush()
        return _checkpoint_info(row)


def last_checkpoint(ledger: Ledger, training_run_id: int) -> Optional[CheckpointInfo]:
    """The newest checkpoint of a run, where training resumes after a crash."""
    with ledger.transaction() as s:
        row = s.scalar(
            select(Checkpoint)
            .where(Checkpoint.training_run_id == training_run_id)
            .order_by(Checkpoint.step.desc())
            .limit(1)
        )
        return _checkpoint_info(row) if row else None
