"""Recording where a version comes from: backbone, data, atlas, training run, checkpoint.

Functions that "ensure" a row are idempotent: calling them again with the same identity
returns the existing row, so a flow that is retried after a crash does not duplicate it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from registry.db import Ledger, LedgerError
from registry.models import (
    Atlas,
    AtlasDataset,
    Backbone,
    Checkpoint,
    Dataset,
    ModelVersion,
    RegisteredModel,
    TrainingRun,
    utcnow,
)
from registry.records import AtlasInfo, CheckpointInfo, ModelInfo, VersionInfo
from registry.store import StoredArtifact, check_sha256

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
RUN_STATUSES = ("running", "finished", "failed")
T = TypeVar("T")


def _require_name(value: str, field: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise LedgerError(f"{field}: expected letters, digits, '_', '.' or '-', got {value!r}")
    return value


def require_row(session: Session, model: type, row_id: int, what: str) -> Any:
    row = session.get(model, row_id)
    if row is None:
        raise LedgerError(f"{what} id {row_id} does not exist in the ledger")
    return row


def _once_more_on_conflict(create: Callable[[], T]) -> T:
    """Run a get-or-create again if a concurrent writer inserted the same row first."""
    try:
        return create()
    except IntegrityError:
        return create()


def json_field(value: dict[str, Any], field: str) -> dict[str, Any]:
    """A JSON column value; NaN/inf are refused because PostgreSQL's json type rejects them."""
    if not isinstance(value, dict):
        raise LedgerError(f"{field}: expected a dict, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise LedgerError(f"{field}: not storable as JSON ({e}); use null or a string for NaN/inf") from e
    return dict(value)


def model_name_for(backbone: str, skill: str) -> str:
    """MLflow-safe registered-model name: '/' and ':' are not allowed there."""
    return f"{backbone.replace('/', '--').replace(':', '-')}.{skill}"


def short_backbone(backbone: str) -> str:
    return backbone.rsplit("/", 1)[-1]


# -- backbones, datasets, atlases ------------------------------------------------------


def ensure_backbone(ledger: Ledger, name: str, revision: str) -> int:
    if not name or not revision:
        raise LedgerError(f"backbone: name and revision are required, got {name!r}, {revision!r}")

    def create() -> int:
        with ledger.transaction() as s:
            row = s.scalar(select(Backbone).where(Backbone.name == name, Backbone.revision == revision))
            if row is None:
                row = Backbone(name=name, revision=revision)
                s.add(row)
                s.flush()
            return row.id

    return _once_more_on_conflict(create)


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

    return _once_more_on_conflict(create)


def _atlas_info(row: Atlas) -> AtlasInfo:
    return AtlasInfo(row.id, row.content_hash, row.backbone_id, row.layer, dict(row.config),
                     row.artifact_sha256, row.artifact_uri)


def find_atlas(ledger: Ledger, content_hash: str) -> Optional[AtlasInfo]:
    """The stored atlas with this content hash, so `refresh_atlas` can reuse it."""
    with ledger.transaction() as s:
        row = s.scalar(select(Atlas).where(Atlas.content_hash == check_sha256(content_hash, "content_hash")))
        return _atlas_info(row) if row else None


def record_atlas(ledger: Ledger, content_hash: str, backbone_id: int, layer: int,
                 config: dict[str, Any], artifact: StoredArtifact,
                 dataset_ids: Sequence[int] = ()) -> AtlasInfo:
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
        row = Atlas(content_hash=content_hash, backbone_id=backbone_id, layer=int(layer),
                    config=json_field(config, "atlas config"),
                    artifact_sha256=artifact.sha256, artifact_uri=artifact.uri)
        s.add(row)
        s.flush()
        for dataset_id in sorted(set(dataset_ids)):
            require_row(s, Dataset, dataset_id, "dataset")
            s.add(AtlasDataset(atlas_id=row.id, dataset_id=dataset_id))
        return _atlas_info(row)


# -- training runs and checkpoints -----------------------------------------------------


def start_training_run(ledger: Ledger, backbone_id: int, skill: str, method: str, seed: int,
                       config: dict[str, Any], atlas_id: Optional[int] = None,
                       dataset_id: Optional[int] = None, flow_run_id: Optional[str] = None) -> int:
    _require_name(skill, "skill")
    _require_name(method, "method")
    with ledger.transaction() as s:
        require_row(s, Backbone, backbone_id, "backbone")
        if atlas_id is not None:
            require_row(s, Atlas, atlas_id, "atlas")
        if dataset_id is not None:
            require_row(s, Dataset, dataset_id, "dataset")
        row = TrainingRun(backbone_id=backbone_id, skill=skill, method=method, seed=int(seed),
                          config=json_field(config, "training config"), atlas_id=atlas_id, dataset_id=dataset_id,
                          status="running", flow_run_id=flow_run_id)
        s.add(row)
        s.flush()
        return row.id


def link_mlflow_run(ledger: Ledger, training_run_id: int, mlflow_run_id: str) -> None:
    with ledger.transaction() as s:
        require_row(s, TrainingRun, training_run_id, "training run").mlflow_run_id = mlflow_run_id


def finish_training_run(ledger: Ledger, training_run_id: int, status: str = "finished") -> None:
    if status not in RUN_STATUSES:
        raise LedgerError(f"training run status: expected one of {RUN_STATUSES}, got {status!r}")
    with ledger.transaction() as s:
        row = require_row(s, TrainingRun, training_run_id, "training run")
        row.status = status
        row.finished_at = None if status == "running" else utcnow()


def _checkpoint_info(row: Checkpoint) -> CheckpointInfo:
    return CheckpointInfo(row.id, row.training_run_id, row.epoch, row.step, row.adapter_sha256,
                          row.adapter_uri, dict(row.metrics))


def record_checkpoint(ledger: Ledger, training_run_id: int, epoch: int, step: int,
                      adapter: StoredArtifact, metrics: dict[str, float]) -> CheckpointInfo:
    """Record a saved adapter. The same (run, step) twice is accepted only with the same file."""
    check_sha256(adapter.sha256, "adapter sha256")
    if epoch < 0 or step < 0:
        raise LedgerError(f"checkpoint: epoch and step must be >= 0, got epoch={epoch} step={step}")
    with ledger.transaction() as s:
        require_row(s, TrainingRun, training_run_id, "training run")
        existing = s.scalar(select(Checkpoint).where(Checkpoint.training_run_id == training_run_id,
                                                     Checkpoint.step == step))
        if existing is not None:
            if existing.adapter_sha256 != adapter.sha256:
                raise LedgerError(f"training run {training_run_id} step {step}: a checkpoint with adapter "
                                  f"{existing.adapter_sha256} is already recorded, not {adapter.sha256}")
            return _checkpoint_info(existing)
        row = Checkpoint(training_run_id=training_run_id, epoch=int(epoch), step=int(step),
                         adapter_sha256=adapter.sha256, adapter_uri=adapter.uri,
                         metrics=json_field(metrics, "checkpoint metrics"))
        s.add(row)
        s.flush()
        return _checkpoint_info(row)


def last_checkpoint(ledger: Ledger, training_run_id: int) -> Optional[CheckpointInfo]:
    """The newest checkpoint of a run, where training resumes after a crash."""
    with ledger.transaction() as s:
        row = s.scalar(select(Checkpoint).where(Checkpoint.training_run_id == training_run_id)
                       .order_by(Checkpoint.step.desc()).limit(1))
        return _checkpoint_info(row) if row else None


# -- registered models and versions -------------------------------------------------------


def _model_row(session: Session, backbone_id: int, skill: str) -> RegisteredModel:
    backbone = require_row(session, Backbone, backbone_id, "backbone")
    row = session.scalar(select(RegisteredModel).where(RegisteredModel.backbone_id == backbone_id,
                                                       RegisteredModel.skill == skill))
    if row is None:
        row = RegisteredModel(name=model_name_for(backbone.name, skill), backbone_id=backbone_id, skill=skill)
        session.add(row)
        session.flush()
    return row


def ensure_model(ledger: Ledger, backbone_id: int, skill: str) -> ModelInfo:
    """The registered model of (backbone, skill), created on first use."""
    _require_name(skill, "skill")

    def create() -> ModelInfo:
        with ledger.transaction() as s:
            row = _model_row(s, backbone_id, skill)
            backbone = s.get(Backbone, backbone_id)
            return ModelInfo(row.id, row.name, backbone.name, backbone.revision, row.skill)

    return _once_more_on_conflict(create)


def get_model(ledger: Ledger, model: int | str) -> ModelInfo:
    """A registered model by ledger id or by name."""
    with ledger.transaction() as s:
        if isinstance(model, int):
            row = require_row(s, RegisteredModel, model, "registered model")
        else:
            row = s.scalar(select(RegisteredModel).where(RegisteredModel.name == model))
            if row is None:
                raise LedgerError(f"registered model {model!r} does not exist in the ledger")
        backbone = s.get(Backbone, row.backbone_id)
        return ModelInfo(row.id, row.name, backbone.name, backbone.revision, row.skill)


def version_info(session: Session, version: ModelVersion) -> VersionInfo:
    model = session.get(RegisteredModel, version.registered_model_id)
    backbone = session.get(Backbone, model.backbone_id)
    common = dict(id=version.id, model_id=model.id, model_name=model.name, name=version.name,
                  backbone=backbone.name, skill=model.skill, mlflow_version=version.mlflow_version)
    if version.checkpoint_id is None:
        return VersionInfo(**common)
    ckpt = session.get(Checkpoint, version.checkpoint_id)
    run = session.get(TrainingRun, ckpt.training_run_id)
    atlas = session.get(Atlas, run.atlas_id) if run.atlas_id is not None else None
    return VersionInfo(**common, checkpoint_id=ckpt.id, training_run_id=run.id,
                       mlflow_run_id=run.mlflow_run_id, method=run.method, seed=run.seed,
                       epoch=ckpt.epoch, step=ckpt.step, adapter_sha256=ckpt.adapter_sha256,
                       atlas_id=run.atlas_id, atlas_sha256=atlas.artifact_sha256 if atlas else None)


def get_version(ledger: Ledger, version_id: int) -> VersionInfo:
    with ledger.transaction() as s:
        return version_info(s, require_row(s, ModelVersion, version_id, "model version"))


def register_version(ledger: Ledger, checkpoint_id: int) -> VersionInfo:
    """Make a checkpoint a candidate version of its (backbone, skill) model (idempotent)."""

    def create() -> VersionInfo:
        with ledger.transaction() as s:
            ckpt = require_row(s, Checkpoint, checkpoint_id, "checkpoint")
            run = s.get(TrainingRun, ckpt.training_run_id)
            model = _model_row(s, run.backbone_id, run.skill)
            row = s.scalar(select(ModelVersion).where(ModelVersion.registered_model_id == model.id,
                                                      ModelVersion.checkpoint_id == checkpoint_id))
            if row is None:
                backbone = s.get(Backbone, run.backbone_id)
                name = f"{short_backbone(backbone.name)}-{run.skill}-{run.method}-s{run.seed}-e{ckpt.epoch}"
                row = ModelVersion(registered_model_id=model.id, checkpoint_id=checkpoint_id, name=name)
                s.add(row)
                s.flush()
            return version_info(s, row)

    return _once_more_on_conflict(create)


def base_version(ledger: Ledger, model_id: int) -> VersionInfo:
    """The version that stands for the unmodified backbone of a model (created on first use)."""
    with ledger.transaction() as s:
        # Lock the model row: NULL checkpoint_id escapes the unique constraint, so two
        # concurrent callers must not both create a base version.
        model = s.scalar(select(RegisteredModel).where(RegisteredModel.id == model_id).with_for_update())
        if model is None:
            raise LedgerError(f"registered model id {model_id} does not exist in the ledger")
        row = s.scalar(select(ModelVersion).where(ModelVersion.registered_model_id == model_id,
                                                  ModelVersion.checkpoint_id.is_(None)))
        if row is None:
            backbone = s.get(Backbone, model.backbone_id)
            row = ModelVersion(registered_model_id=model_id, checkpoint_id=None,
                               name=f"{short_backbone(backbone.name)}-base")
            s.add(row)
            s.flush()
        return version_info(s, row)


def list_versions(ledger: Ledger, model_id: int) -> list[VersionInfo]:
    with ledger.transaction() as s:
        rows = s.scalars(select(ModelVersion).where(ModelVersion.registered_model_id == model_id)
                         .order_by(ModelVersion.id))
        return [version_info(s, row) for row in rows]


def set_mlflow_version(ledger: Ledger, version_id: int, mlflow_version: str) -> None:
    with ledger.transaction() as s:
        require_row(s, ModelVersion, version_id, "model version").mlflow_version = str(mlflow_version)
