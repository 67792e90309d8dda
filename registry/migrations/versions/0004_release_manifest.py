"""release manifest identity

A version row records the sha256 of its release folder's manifest.json (registry.publish
.write_release_folder writes the same bytes for the same ledger rows), so every loader can
refuse a folder whose manifest was edited: a dropped or reordered delta, another backbone.
Written once, the first time the folder is written; existing rows get it on their next write.

Revision ID: 0004
Revises: 0003
Create Date: 2027-01-15
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_model_versions") as batch:
        batch.add_column(sa.Column("manifest_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_model_versions") as batch:
        batch.drop_column("manifest_sha256")
