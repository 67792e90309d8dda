"""backbone weights identity

A backbone row records the sha256 of its weights (atlas_core.backbone.weights_sha256) next
to its revision, so a release folder can name the exact weights its chain was trained on and
every loader can refuse others. Existing rows get it the next time a cycle loads them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_backbones") as batch:
        batch.add_column(sa.Column("weights_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_backbones") as batch:
        batch.drop_column("weights_sha256")
