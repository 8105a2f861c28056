"""Serving measures: each job's time per output token after the first (`tpot_ms`),
and for a job of a run at `--concurrency` above 1 its wait in the worker for a slot of the batch
(`queue_wait_ms`) and the pages decoding beside it, averaged over its steps (`batch_occupancy`).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tpot_ms", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("queue_wait_ms", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("batch_occupancy", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_column("batch_occupancy")
        batch_op.drop_column("queue_wait_ms")
        batch_op.drop_column("tpot_ms")
