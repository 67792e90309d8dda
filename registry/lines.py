"""Lines and their versions.

A line is what a team ships: one backbone at one revision and the skills released onto it
over time, one registered model `<backbone>.<line>` in the ledger and in MLflow. Its base
version stands for the bare backbone; every other version is a parent version plus one
delta (a checkpoint's adapter), so the model a version stands for is the backbone with the
deltas of `version_chain` applied in order.
"""

from __future__ import annotations

from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.db import Ledger, LedgerError
from registry.models import Atlas, Backbone, Checkpoint, ModelVersion, RegisteredModel, TrainingRun
from registry.records import ModelInfo, VersionInfo
from registry.rows import once_more_on_conflict, require_name, require_row
from registry.store import ArtifactError, check_sha256


def _mlflow_safe(text: str) -> str:
    """'/' and ':' are not allowed in MLflow registered-model names."""
    return text.replace("/", "--").replace(":", "-")


def model_name_for(backbone: str, line: str) -> str:
    """The registered-model name of a line: `<backbone>.<line>`, MLflow-safe."""
    return f"{_mlflow_safe(backbone)}.{line}"


def short_backbone(backbone: str) -> str:
    return backbone.rsplit("/", 1)[-1]


# -- lines ------------------------------------------------------------------------------


def _line_row(session: Session, backbone_id: int, line: str) -> RegisteredModel:
    """The line `line` of a backbone row, created on first use."""
    backbone = require_row(session, Backbone, backbone_id, "backbone")
    row = session.scalar(
        select(RegisteredModel).where(RegisteredModel.backbone_id == backbone_id, RegisteredModel.line == line)
    )
    if row is not None:
        return row
    plain = model_name_for(backbone.name, line)
    name = plain
    taken = lambda n: session.scalar(select(RegisteredModel.id).where(RegisteredModel.name == n))
    if taken(name) is not None:
        # A line of another revision of this backbone has the plain name: a changed
        # revision starts a new line beside it, it does not take over the old one.
        name = f"{plain}-rev{_mlflow_safe(backbone.revision[:8])}"
        if taken(name) is not None:
            raise LedgerError(
                f"line {line!r} of {backbone.name} at revision {backbone.revision}: the names "
                f"{plain!r} and {name!r} are both taken by other lines; choose another line name"
            )
    row = RegisteredModel(name=name, backbone_id=backbone_id, line=line)
    session.add(row)
    session.flush()
    return row


def _model_info(session: Session, row: RegisteredModel) -> ModelInfo:
    backbone = session.get(Backbone, row.backbone_id)
    return ModelInfo(id=row.id, name=row.name, backbone=backbone.name, revision=backbone.revision, line=row.line)


def ensure_model(ledger: Ledger, backbone_id: int, line: str) -> ModelInfo:
    """The line `line` of a backbone (name and revision), created on first use.

    Its name is `<backbone>.<line>`, or `<backbone>.<line>-rev<revision[:8]>` when another
    revision of the same backbone already has a line of that name.
    """
    require_name(line, "line")

    def create() -> ModelInfo:
        with ledger.transaction() as s:
            return _model_info(s, _line_row(s, backbone_id, line))

    return once_more_on_conflict(create)


def get_model(ledger: Ledger, model: int | str) -> ModelInfo:
    """A line by ledger id or by registered-model name."""
    with ledger.transaction() as s:
        if isinstance(model, int):
            row = require_row(s, RegisteredModel, model, "registered model")
        else:
            row = s.scalar(select(RegisteredModel).where(RegisteredModel.name == model))
            if row is None:
                raise LedgerError(f"registered model {model!r} does not exist in the ledger")
        return _model_info(s, row)


def lock_line(session: Session, model_id: int) -> RegisteredModel:
    """Lock a line's row until the transaction ends (SELECT ... FOR UPDATE on PostgreSQL;
    every SQLite transaction already holds the write lock)."""
    model = session.scalar(select(RegisteredModel).where(RegisteredModel.id == model_id).with_for_update())
    if model is None:
        raise LedgerError(f"registered model id {model_id} does not exist in the ledger")
    return model


def base_row(session: Session, model: RegisteredModel) -> ModelVersion:
    """The base version of a line locked with `lock_line`, created on first use.

    The lock matters: a NULL checkpoint_id escapes the unique constraint, so two concurrent
    callers must not both create one.
    """
    row = session.scalar(
        select(ModelVersion).where(ModelVersion.registered_model_id == model.id, ModelVersion.checkpoint_id.is_(None))
    )
    if row is None:
        backbone = session.get(Backbone, model.backbone_id)
        row = ModelVersion(
            registered_model_id=model.id,
            checkpoint_id=None,
            parent_version_id=None,
            name=f"{short_backbone(backbone.name)}-base",
        )
        session.add(row)
        session.flush()
    return row


# -- versions ---------------------------------------------------------------------------


def version_info(session: Session, version: ModelVersion) -> VersionInfo:
    model = session.get(RegisteredModel, version.registered_model_id)
    backbone = session.get(Backbone, model.backbone_id)
    common = dict(
        id=version.id,
        model_id=model.id,
        model_name=model.name,
        name=version.name,
        backbone=backbone.name,
        line=model.line,
        mlflow_version=version.mlflow_version,
        parent_id=version.parent_version_id,
        status=version.status,
    )
    if version.checkpoint_id is None:
        return VersionInfo(**common, skill=None)
    ckpt = session.get(Checkpoint, version.checkpoint_id)
    run = session.get(TrainingRun, ckpt.training_run_id)
    atlas = session.get(Atlas, run.atlas_id) if run.atlas_id is not None else None
    return VersionInfo(
        **common,
        skill=run.skill,
        checkpoint_id=ckpt.id,
        training_run_id=run.id,
        mlflow_run_id=run.mlflow_run_id,
        method=run.method,
        seed=run.seed,
        epoch=ckpt.epoch,
        step=ckpt.step,
        adapter_sha256=ckpt.adapter_sha256,
        atlas_id=run.atlas_id,
        atlas_sha256=atlas.artifact_sha256 if atlas else None,
    )


def get_version(ledger: Ledger, version_id: int) -> VersionInfo:
    with ledger.transaction() as s:
        return version_info(s, require_row(s, ModelVersion, version_id, "model version"))


def _free_name(session: Session, model_id: int, name: str) -> str:
    """`name`, or `name-r2`, `name-r3`, ...: the first one no version of the line has."""
    taken = set(session.scalars(select(ModelVersion.name).where(ModelVersion.registered_model_id == model_id)))
    candidate, k = name, 2
    while candidate in taken:
        candidate, k = f"{name}-r{k}", k + 1
    return candidate


def register_version(ledger: Ledger, checkpoint_id: int, name: Optional[str] = None) -> VersionInfo:
    """Make a checkpoint a candidate version of the line its run was trained for (idempotent).

    Its parent is the version the run was trained on top of (the line's base version when
    the run names none). A run recorded without a line goes to the line named after its
    skill. The name is `<backbone>-<skill>-<method>-s<seed>-e<epoch>`, with `-r2`, `-r3`, ...
    when another version of the line (a retrain on another snapshot or parent) has it. A `name`
    given by a person is used as it is, and refused if another version of the line has it.
    """
    if name is not None:
        require_name(name, "version name")

    def create() -> VersionInfo:
        with ledger.transaction() as s:
            ckpt = require_row(s, Checkpoint, checkpoint_id, "checkpoint")
            run = s.get(TrainingRun, ckpt.training_run_id)
            model_id = run.registered_model_id or _line_row(s, run.backbone_id, run.skill).id
            model = lock_line(s, model_id)  # names are chosen under the lock: no two alike
            row = s.scalar(
                select(ModelVersion).where(
                    ModelVersion.registered_model_id == model.id, ModelVersion.checkpoint_id == checkpoint_id
                )
            )
            if row is None:
                backbone = s.get(Backbone, run.backbone_id)
                default = f"{short_backbone(backbone.name)}-{run.skill}-{run.method}-s{run.seed}-e{ckpt.epoch}"
                if name is not None and _free_name(s, model.id, name) != name:
                    raise LedgerError(f"version name {name!r} is taken in line {model.name}; choose another")
                row = ModelVersion(
                    registered_model_id=model.id,
                    checkpoint_id=checkpoint_id,
                    parent_version_id=run.parent_version_id or base_row(s, model).id,
                    name=name or _free_name(s, model.id, default),
                )
                s.add(row)
                s.flush()
            return version_info(s, row)

    return once_more_on_conflict(create)


def base_version(ledger: Ledger, model_id: int) -> VersionInfo:
    """The version that stands for the unmodified backbone of a line (created on first use)."""
    with ledger.transaction() as s:
        return version_info(s, base_row(s, lock_line(s, model_id)))


def version_chain(ledger: Ledger, version_id: int) -> list[VersionInfo]:
    """The deltas a version is made of, oldest first: from the first version after the base
    up to and including this one (empty for the base version)."""
    with ledger.transaction() as s:
        row = require_row(s, ModelVersion, version_id, "model version")
        chain: list[ModelVersion] = []
        while row is not None and row.checkpoint_id is not None:
            if row in chain:
                raise LedgerError(f"version id {version_id}: its chain of parents loops at {row.name} (id {row.id})")
            chain.append(row)
            parent = s.get(ModelVersion, row.parent_version_id) if row.parent_version_id is not None else None
            if parent is not None and parent.registered_model_id != row.registered_model_id:
                raise LedgerError(
                    f"version {row.name} (id {row.id}): its parent {parent.name} (id {parent.id}) "
                    f"is in another line (registered model id {parent.registered_model_id})"
                )
            row = parent  # None: a version from before chains, on the bare backbone
        return [version_info(s, r) for r in reversed(chain)]


def list_versions(ledger: Ledger, model_id: int, include_retired: bool = True) -> list[VersionInfo]:
    """Every version of a line, oldest first (without the retired ones on request)."""
    with ledger.transaction() as s:
        query = select(ModelVersion).where(ModelVersion.registered_model_id == model_id)
        if not include_retired:
            query = query.where(ModelVersion.status != "retired")
        return [version_info(s, row) for row in s.scalars(query.order_by(ModelVersion.id))]


def set_mlflow_version(ledger: Ledger, version_id: int, mlflow_version: str) -> None:
    with ledger.transaction() as s:
        require_row(s, ModelVersion, version_id, "model version").mlflow_version = str(mlflow_version)


def record_manifest_sha256(ledger: Ledger, version_id: int, sha256: str, where: str) -> None:
    """Record the sha256 of a version's release manifest (`where`: the manifest.json being written),
    once: the ledger rows a manifest is written from never change, so a later write whose manifest
    hashes otherwise means the ledger no longer describes the release it recorded, and is refused."""
    check_sha256(sha256, "manifest sha256")
    with ledger.transaction() as s:
        row = s.scalar(select(ModelVersion).where(ModelVersion.id == version_id).with_for_update())
        if row is None:
            raise LedgerError(f"model version id {version_id} does not exist in the ledger")
        if row.manifest_sha256 is None:
            row.manifest_sha256 = sha256
        elif row.manifest_sha256 != sha256:
            raise ArtifactError(
                f"{where}: the ledger recorded release manifest sha256 {row.manifest_sha256} for "
                f"version {row.name} (id {row.id}), the ledger's rows now give {sha256}: a row the "
                "release was written from has changed since; the release is refused",
                where,
                row.manifest_sha256,
            )
