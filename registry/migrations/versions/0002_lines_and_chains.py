"""lines and version chains

A registered model becomes a *line* (column `skill` -> `line`); a version records its
parent and whether a rollback retired it; a training run records the line it was trained
for and the version it was trained on top of; version names become unique within a line.

Existing rows are backfilled: every (backbone, skill) model is a line of the same name,
every non-base version and every training run sits on its line's base version (they were
all trained on the bare backbone), and versions that share a name in one model are renamed
`<name>-r2`, `<name>-r3`, ... in id order, before the unique constraint is created.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections import defaultdict

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

VERSION_NAME_UQ = "uq_ledger_model_versions_name"


def upgrade() -> None:
    with op.batch_alter_table("ledger_registered_models") as batch:
        batch.alter_column(
            "skill", new_column_name="line", existing_type=sa.String(length=128), existing_nullable=False
        )
    with op.batch_alter_table("ledger_model_versions") as batch:
        batch.add_column(sa.Column("parent_version_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("status", sa.String(length=16), server_default="active", nullable=False))
        batch.create_foreign_key(
            op.f("fk_ledger_model_versions_parent_version_id"), "ledger_model_versions", ["parent_version_id"], ["id"]
        )
    with op.batch_alter_table("ledger_training_runs") as batch:
        batch.add_column(sa.Column("registered_model_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("parent_version_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_ledger_training_runs_registered_model_id"),
            "ledger_registered_models",
            ["registered_model_id"],
            ["id"],
        )
        batch.create_foreign_key(
            op.f("fk_ledger_training_runs_parent_version_id"), "ledger_model_versions", ["parent_version_id"], ["id"]
        )
    _backfill_parents()
    _rename_duplicate_names()
    with op.batch_alter_table("ledger_model_versions") as batch:
        batch.create_unique_constraint(VERSION_NAME_UQ, ["registered_model_id", "name"])


def _backfill_parents() -> None:
    # MIN(): the base row is unique in practice; MIN keeps the subquery scalar regardless.
    base_of_model = (
        "SELECT MIN(b.id) FROM ledger_model_versions b "
        "WHERE b.registered_model_id = {model} AND b.checkpoint_id IS NULL"
    )
    op.execute(
        f"UPDATE ledger_model_versions SET parent_version_id = "
        f"({base_of_model.format(model='ledger_model_versions.registered_model_id')}) "
        f"WHERE checkpoint_id IS NOT NULL"
    )
    op.execute(
        "UPDATE ledger_training_runs SET registered_model_id = (SELECT m.id FROM ledger_registered_models m "
        "WHERE m.backbone_id = ledger_training_runs.backbone_id AND m.line = ledger_training_runs.skill)"
    )
    op.execute(
        f"UPDATE ledger_training_runs SET parent_version_id = "
        f"({base_of_model.format(model='ledger_training_runs.registered_model_id')}) "
        f"WHERE registered_model_id IS NOT NULL"
    )


def _rename_duplicate_names() -> None:
    """The second holder of a name in a model becomes `<name>-r2`, the third `-r3`, ...
    (the first suffix no version of that model has yet)."""
    versions = sa.table(
        "ledger_model_versions",
        sa.column("id", sa.Integer),
        sa.column("name", sa.String),
        sa.column("registered_model_id", sa.Integer),
    )
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(versions.c.id, versions.c.registered_model_id, versions.c.name).order_by(versions.c.id)
    ).all()
    taken: dict[int, set[str]] = defaultdict(set)
    for _, model_id, name in rows:
        taken[model_id].add(name)
    kept: dict[int, set[str]] = defaultdict(set)
    for version_id, model_id, name in rows:
        if name in kept[model_id]:
            k = 2
            while f"{name}-r{k}" in taken[model_id]:
                k += 1
            name = f"{name}-r{k}"
            taken[model_id].add(name)
            bind.execute(sa.update(versions).where(versions.c.id == version_id).values(name=name))
        kept[model_id].add(name)


def downgrade() -> None:
    # Chains, retirements and the runs' lines are dropped; renamed versions keep their names.
    with op.batch_alter_table("ledger_model_versions") as batch:
        batch.drop_constraint(VERSION_NAME_UQ, type_="unique")
        batch.drop_constraint(op.f("fk_ledger_model_versions_parent_version_id"), type_="foreignkey")
        batch.drop_column("status")
        batch.drop_column("parent_version_id")
    with op.batch_alter_table("ledger_training_runs") as batch:
        batch.drop_constraint(op.f("fk_ledger_training_runs_parent_version_id"), type_="foreignkey")
        batch.drop_constraint(op.f("fk_ledger_training_runs_registered_model_id"), type_="foreignkey")
        batch.drop_column("parent_version_id")
        batch.drop_column("registered_model_id")
    with op.batch_alter_table("ledger_registered_models") as batch:
        batch.alter_column(
            "line", new_column_name="skill", existing_type=sa.String(length=128), existing_nullable=False
        )
