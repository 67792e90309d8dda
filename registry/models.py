"""SQLAlchemy 2.0 models of the release ledger.

The ledger is the source of truth for what was trained, evaluated, gated and released;
MLflow mirrors it for people to browse. Every table is prefixed `ledger_` because the
ledger may share a PostgreSQL database with MLflow, which has its own `registered_models`
and `model_versions` tables.

Schema changes go through an Alembic migration in `registry/migrations/versions/`;
`tests/test_registry_ledger.py` checks that the migrations produce exactly these models.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Stable constraint names, so that migrations can refer to them on every database.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s",
    "pk": "pk_%(table_name)s",
}

SHA256_LEN = 64


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """A timestamp that always comes back timezone-aware in UTC (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Optional[datetime], dialect: Any) -> Optional[datetime]:
        if value is not None and value.tzinfo is None:
            raise ValueError(f"timestamp {value} has no timezone; the ledger stores UTC")
        return value.astimezone(timezone.utc) if value is not None else None

    def process_result_value(self, value: Optional[datetime], dialect: Any) -> Optional[datetime]:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _created_at() -> Mapped[datetime]:
    return mapped_column(UTCDateTime, default=utcnow, nullable=False)


class Backbone(Base):
    """A base model: Hugging Face id plus the exact revision that was loaded."""

    __tablename__ = "ledger_backbones"
    __table_args__ = (UniqueConstraint("name", "revision"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    revision: Mapped[str] = mapped_column(String(255))
    # sha256 of the weights (atlas_core.backbone.weights_sha256); None until a cycle loaded them
    weights_sha256: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = _created_at()


class Dataset(Base):
    """One split of one data file, identified by its content (sha256)."""

    __tablename__ = "ledger_datasets"
    __table_args__ = (UniqueConstraint("name", "split", "sha256"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    split: Mapped[str] = mapped_column(String(64))
    sha256: Mapped[str] = mapped_column(String(SHA256_LEN))
    created_at: Mapped[datetime] = _created_at()


class Atlas(Base):
    """A fitted retained atlas; `content_hash` covers backbone, layer, data and config."""

    __tablename__ = "ledger_atlases"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    content_hash: Mapped[str] = mapped_column(String(SHA256_LEN), unique=True)
    backbone_id: Mapped[int] = mapped_column(ForeignKey("ledger_backbones.id"))
    layer: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    artifact_sha256: Mapped[str] = mapped_column(String(SHA256_LEN))
    artifact_uri: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = _created_at()


class AtlasDataset(Base):
    """Which retained datasets an atlas was fitted on."""

    __tablename__ = "ledger_atlas_datasets"
    atlas_id: Mapped[int] = mapped_column(ForeignKey("ledger_atlases.id"), primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("ledger_datasets.id"), primary_key=True)


class TrainingRun(Base):
    """One (method, seed) training of one skill on one backbone, on top of a parent version."""

    __tablename__ = "ledger_training_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    backbone_id: Mapped[int] = mapped_column(ForeignKey("ledger_backbones.id"))
    # The line it was trained for and the version it was trained on top of (the line's base
    # version when trained on the bare backbone). NULL: a run recorded before lines existed.
    registered_model_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_registered_models.id"))
    # use_alter: versions -> checkpoints -> runs -> versions is a cycle of foreign keys.
    parent_version_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_model_versions.id", use_alter=True))
    atlas_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_atlases.id"))
    dataset_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_datasets.id"))
    skill: Mapped[str] = mapped_column(String(128))
    method: Mapped[str] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))  # running | finished | failed
    failure: Mapped[Optional[str]] = mapped_column(Text)  # why it failed (None unless status is failed)
    flow_run_id: Mapped[Optional[str]] = mapped_column(String(64))
    mlflow_run_id: Mapped[Optional[str]] = mapped_column(String(64))
    started_at: Mapped[datetime] = _created_at()
    finished_at: Mapped[Optional[datetime]] = mapped_column(UTCDateTime)


class Checkpoint(Base):
    """An adapter saved during training (at least once per epoch)."""

    __tablename__ = "ledger_checkpoints"
    __table_args__ = (UniqueConstraint("training_run_id", "step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    training_run_id: Mapped[int] = mapped_column(ForeignKey("ledger_training_runs.id"))
    epoch: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    adapter_sha256: Mapped[str] = mapped_column(String(SHA256_LEN))
    adapter_uri: Mapped[str] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = _created_at()


class RegisteredModel(Base):
    """A line: one backbone (at one revision) and the skills released onto it over time.

    Its row is the promotion lock.
    """

    __tablename__ = "ledger_registered_models"
    __table_args__ = (UniqueConstraint("backbone_id", "line"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    backbone_id: Mapped[int] = mapped_column(ForeignKey("ledger_backbones.id"))
    line: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = _created_at()


class ModelVersion(Base):
    """A parent version plus one delta (a checkpoint's adapter), or the base backbone of a
    line when checkpoint_id and parent_version_id are NULL."""

    __tablename__ = "ledger_model_versions"
    __table_args__ = (
        UniqueConstraint("registered_model_id", "checkpoint_id"),
        # Named by hand: the convention would give it the same name as the constraint above.
        UniqueConstraint("registered_model_id", "name", name="uq_ledger_model_versions_name"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    registered_model_id: Mapped[int] = mapped_column(ForeignKey("ledger_registered_models.id"))
    checkpoint_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_checkpoints.id"))
    parent_version_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_model_versions.id"))
    name: Mapped[str] = mapped_column(String(255))
    # 'retired' once rolled back: no cycle promotes it again until a person re-nominates it.
    status: Mapped[str] = mapped_column(String(16), default="active", server_default="active")
    mlflow_version: Mapped[Optional[str]] = mapped_column(String(32))
    # sha256 of its release folder's manifest.json; written once, the first time the folder is written
    manifest_sha256: Mapped[Optional[str]] = mapped_column(String(SHA256_LEN), nullable=True)
    created_at: Mapped[datetime] = _created_at()


class Evaluation(Base):
    """Scores of one version, measured against the base and against the release of the day."""

    __tablename__ = "ledger_evaluations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("ledger_model_versions.id"))
    # The champion this evaluation compared against (NULL: there was none).
    release_version_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_model_versions.id"))
    target_solved: Mapped[int] = mapped_column(Integer)
    target_total: Mapped[int] = mapped_column(Integer)
    csqa_choice_churn: Mapped[Optional[float]] = mapped_column(Float)
    extra: Mapped[dict[str, Any]] = mapped_column(JSON)
    flow_run_id: Mapped[Optional[str]] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()


class EvaluationKL(Base):
    """Retained KL (nats/token) on one retained domain."""

    __tablename__ = "ledger_evaluation_kl"
    __table_args__ = (UniqueConstraint("evaluation_id", "domain"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    evaluation_id: Mapped[int] = mapped_column(ForeignKey("ledger_evaluations.id"))
    domain: Mapped[str] = mapped_column(String(128))
    kl_vs_base: Mapped[Optional[float]] = mapped_column(Float)
    kl_vs_release: Mapped[Optional[float]] = mapped_column(Float)


class EvaluationChurn(Base):
    """Answer churn on one retained domain against `against` ('base' or 'release')."""

    __tablename__ = "ledger_evaluation_churn"
    __table_args__ = (UniqueConstraint("evaluation_id", "against", "domain"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    evaluation_id: Mapped[int] = mapped_column(ForeignKey("ledger_evaluations.id"))
    against: Mapped[str] = mapped_column(String(16))
    domain: Mapped[str] = mapped_column(String(128))
    flips_f: Mapped[int] = mapped_column(Integer)
    flips_g: Mapped[int] = mapped_column(Integer)
    flips_w: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)


class Answer(Base):
    """The extracted answer of one version to one question, kept for later comparisons."""

    __tablename__ = "ledger_answers"
    __table_args__ = (UniqueConstraint("model_version_id", "dataset", "question_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("ledger_model_versions.id"))
    dataset: Mapped[str] = mapped_column(String(128))
    question_id: Mapped[str] = mapped_column(String(255))
    answer: Mapped[Optional[str]] = mapped_column(Text)
    correct: Mapped[bool] = mapped_column(Boolean)


class GateDecision(Base):
    """The verdict of a release policy on one version."""

    __tablename__ = "ledger_gate_decisions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("ledger_model_versions.id"))
    evaluation_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_evaluations.id"))
    # The champion the verdict was measured against; promotion requires it to still hold.
    release_version_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_model_versions.id"))
    policy_name: Mapped[str] = mapped_column(String(255))
    policy: Mapped[dict[str, Any]] = mapped_column(JSON)
    passed: Mapped[bool] = mapped_column(Boolean)
    flow_run_id: Mapped[Optional[str]] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()


class GateCheck(Base):
    """One threshold of a policy: what was required, what was measured, and the verdict."""

    __tablename__ = "ledger_gate_checks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    decision_id: Mapped[int] = mapped_column(ForeignKey("ledger_gate_decisions.id"))
    name: Mapped[str] = mapped_column(String(255))
    threshold: Mapped[Optional[float]] = mapped_column(Float)
    measured: Mapped[Optional[float]] = mapped_column(Float)
    passed: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(Text)


class Release(Base):
    """An alias move: `model_version_id` took `alias` from `previous_version_id`.

    A rollback to the base version records the base's id here and deletes the alias holder.
    """

    __tablename__ = "ledger_releases"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    registered_model_id: Mapped[int] = mapped_column(ForeignKey("ledger_registered_models.id"))
    alias: Mapped[str] = mapped_column(String(64))
    model_version_id: Mapped[int] = mapped_column(ForeignKey("ledger_model_versions.id"))
    previous_version_id: Mapped[Optional[int]] = mapped_column(ForeignKey("ledger_model_versions.id"))
    # promote | rollback | renominate (the last moves nothing: it lifts a rollback's retirement)
    action: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    flow_run_id: Mapped[Optional[str]] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()
    # Set once MLflow's alias was moved to match; NULL means `repair` still has work to do.
    mlflow_synced_at: Mapped[Optional[datetime]] = mapped_column(UTCDateTime)


class AliasHolder(Base):
    """The current holder of each alias: the primary key makes a second holder impossible."""

    __tablename__ = "ledger_aliases"
    registered_model_id: Mapped[int] = mapped_column(ForeignKey("ledger_registered_models.id"), primary_key=True)
    alias: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("ledger_model_versions.id"))
    release_id: Mapped[int] = mapped_column(ForeignKey("ledger_releases.id"))
