"""training run failure reason

A candidate whose training or evaluation raised, or whose flow run crashed or was cancelled on a
work pool, is recorded as a failed training run with the reason (flows/candidates.py); the reason
is cleared when a rerun resumes it.

Revision ID: 0005
Revises: 0004
Create Date: 2027-02-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_training_runs") as batch:
        batch.add_column(sa.Column("failure", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_training_runs") as batch:
        batch.drop_column("failure")
