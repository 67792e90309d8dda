"""initial ledger schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_backbones",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("revision", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_backbones")),
        sa.UniqueConstraint("name", "revision", name=op.f("uq_ledger_backbones_name")),
    )
    op.create_table(
        "ledger_datasets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("split", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_datasets")),
        sa.UniqueConstraint("name", "split", "sha256", name=op.f("uq_ledger_datasets_name")),
    )
    op.create_table(
        "ledger_atlases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("backbone_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("artifact_sha256", sa.String(length=64), nullable=False),
        sa.Column("artifact_uri", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["backbone_id"], ["ledger_backbones.id"], name=op.f("fk_ledger_atlases_backbone_id")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_atlases")),
        sa.UniqueConstraint("content_hash", name=op.f("uq_ledger_atlases_content_hash")),
    )
    op.create_table(
        "ledger_registered_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("backbone_id", sa.Integer(), nullable=False),
        sa.Column("skill", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["backbone_id"], ["ledger_backbones.id"], name=op.f("fk_ledger_registered_models_backbone_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_registered_models")),
        sa.UniqueConstraint("backbone_id", "skill", name=op.f("uq_ledger_registered_models_backbone_id")),
        sa.UniqueConstraint("name", name=op.f("uq_ledger_registered_models_name")),
    )
    op.create_table(
        "ledger_atlas_datasets",
        sa.Column("atlas_id", sa.Integer(), nullable=False),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["atlas_id"], ["ledger_atlases.id"], name=op.f("fk_ledger_atlas_datasets_atlas_id")),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["ledger_datasets.id"], name=op.f("fk_ledger_atlas_datasets_dataset_id")
        ),
        sa.PrimaryKeyConstraint("atlas_id", "dataset_id", name=op.f("pk_ledger_atlas_datasets")),
    )
    op.create_table(
        "ledger_training_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("backbone_id", sa.Integer(), nullable=False),
        sa.Column("atlas_id", sa.Integer(), nullable=True),
        sa.Column("dataset_id", sa.Integer(), nullable=True),
        sa.Column("skill", sa.String(length=128), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["atlas_id"], ["ledger_atlases.id"], name=op.f("fk_ledger_training_runs_atlas_id")),
        sa.ForeignKeyConstraint(
            ["backbone_id"], ["ledger_backbones.id"], name=op.f("fk_ledger_training_runs_backbone_id")
        ),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["ledger_datasets.id"], name=op.f("fk_ledger_training_runs_dataset_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_training_runs")),
    )
    op.create_table(
        "ledger_checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("training_run_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("adapter_sha256", sa.String(length=64), nullable=False),
        sa.Column("adapter_uri", sa.Text(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["training_run_id"], ["ledger_training_runs.id"], name=op.f("fk_ledger_checkpoints_training_run_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_checkpoints")),
        sa.UniqueConstraint("training_run_id", "step", name=op.f("uq_ledger_checkpoints_training_run_id")),
    )
    op.create_table(
        "ledger_model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("registered_model_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("mlflow_version", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["ledger_checkpoints.id"], name=op.f("fk_ledger_model_versions_checkpoint_id")
        ),
        sa.ForeignKeyConstraint(
            ["registered_model_id"],
            ["ledger_registered_models.id"],
            name=op.f("fk_ledger_model_versions_registered_model_id"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_model_versions")),
        sa.UniqueConstraint(
            "registered_model_id", "checkpoint_id", name=op.f("uq_ledger_model_versions_registered_model_id")
        ),
    )
    op.create_table(
        "ledger_answers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("dataset", sa.String(length=128), nullable=False),
        sa.Column("question_id", sa.String(length=255), nullable=False),
        sa.Column("answer", sa.Text(), nullable=True),
        sa.Column("correct", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_answers_model_version_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_answers")),
        sa.UniqueConstraint(
            "model_version_id", "dataset", "question_id", name=op.f("uq_ledger_answers_model_version_id")
        ),
    )
    op.create_table(
        "ledger_evaluations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("release_version_id", sa.Integer(), nullable=True),
        sa.Column("target_solved", sa.Integer(), nullable=False),
        sa.Column("target_total", sa.Integer(), nullable=False),
        sa.Column("csqa_choice_churn", sa.Float(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_evaluations_model_version_id")
        ),
        sa.ForeignKeyConstraint(
            ["release_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_evaluations_release_version_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_evaluations")),
    )
    op.create_table(
        "ledger_releases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("registered_model_id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("previous_version_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("mlflow_synced_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_releases_model_version_id")
        ),
        sa.ForeignKeyConstraint(
            ["previous_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_releases_previous_version_id")
        ),
        sa.ForeignKeyConstraint(
            ["registered_model_id"],
            ["ledger_registered_models.id"],
            name=op.f("fk_ledger_releases_registered_model_id"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_releases")),
    )
    op.create_table(
        "ledger_aliases",
        sa.Column("registered_model_id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("release_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_aliases_model_version_id")
        ),
        sa.ForeignKeyConstraint(
            ["registered_model_id"], ["ledger_registered_models.id"], name=op.f("fk_ledger_aliases_registered_model_id")
        ),
        sa.ForeignKeyConstraint(["release_id"], ["ledger_releases.id"], name=op.f("fk_ledger_aliases_release_id")),
        sa.PrimaryKeyConstraint("registered_model_id", "alias", name=op.f("pk_ledger_aliases")),
    )
    op.create_table(
        "ledger_evaluation_churn",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("evaluation_id", sa.Integer(), nullable=False),
        sa.Column("against", sa.String(length=16), nullable=False),
        sa.Column("domain", sa.String(length=128), nullable=False),
        sa.Column("flips_f", sa.Integer(), nullable=False),
        sa.Column("flips_g", sa.Integer(), nullable=False),
        sa.Column("flips_w", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["evaluation_id"], ["ledger_evaluations.id"], name=op.f("fk_ledger_evaluation_churn_evaluation_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_evaluation_churn")),
        sa.UniqueConstraint(
            "evaluation_id", "against", "domain", name=op.f("uq_ledger_evaluation_churn_evaluation_id")
        ),
    )
    op.create_table(
        "ledger_evaluation_kl",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("evaluation_id", sa.Integer(), nullable=False),
        sa.Column("domain", sa.String(length=128), nullable=False),
        sa.Column("kl_vs_base", sa.Float(), nullable=True),
        sa.Column("kl_vs_release", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["evaluation_id"], ["ledger_evaluations.id"], name=op.f("fk_ledger_evaluation_kl_evaluation_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_evaluation_kl")),
        sa.UniqueConstraint("evaluation_id", "domain", name=op.f("uq_ledger_evaluation_kl_evaluation_id")),
    )
    op.create_table(
        "ledger_gate_decisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("evaluation_id", sa.Integer(), nullable=True),
        sa.Column("release_version_id", sa.Integer(), nullable=True),
        sa.Column("policy_name", sa.String(length=255), nullable=False),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["evaluation_id"], ["ledger_evaluations.id"], name=op.f("fk_ledger_gate_decisions_evaluation_id")
        ),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["ledger_model_versions.id"], name=op.f("fk_ledger_gate_decisions_model_version_id")
        ),
        sa.ForeignKeyConstraint(
            ["release_version_id"],
            ["ledger_model_versions.id"],
            name=op.f("fk_ledger_gate_decisions_release_version_id"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_gate_decisions")),
    )
    op.create_table(
        "ledger_gate_checks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("decision_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("measured", sa.Float(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["decision_id"], ["ledger_gate_decisions.id"], name=op.f("fk_ledger_gate_checks_decision_id")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_gate_checks")),
    )


def downgrade() -> None:
    op.drop_table("ledger_gate_checks")
    op.drop_table("ledger_gate_decisions")
    op.drop_table("ledger_evaluation_kl")
    op.drop_table("ledger_evaluation_churn")
    op.drop_table("ledger_aliases")
    op.drop_table("ledger_releases")
    op.drop_table("ledger_evaluations")
    op.drop_table("ledger_answers")
    op.drop_table("ledger_model_versions")
    op.drop_table("ledger_checkpoints")
    op.drop_table("ledger_training_runs")
    op.drop_table("ledger_atlas_datasets")
    op.drop_table("ledger_registered_models")
    op.drop_table("ledger_atlases")
    op.drop_table("ledger_datasets")
    op.drop_table("ledger_backbones")
