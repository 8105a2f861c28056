"""Prefetch: per result whether its page was prepared while the previous job ran and how long
it then waited, TTFT from the claim and from the job's start on the device, and when the device began
and finished the job (the device's idle time between a worker's jobs).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Rows written before this revision measured none of these: NULL (and not prefetched: nothing was).
_MS_COLUMNS = ("page_wait_ms", "ttft_from_claim_ms", "ttft_from_device_start_ms")
_TIME_COLUMNS = ("device_started_at", "device_finished_at")


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("prefetched", sa.Boolean(), nullable=False, server_default=sa.false()))
        for name in _MS_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))
        for name in _TIME_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for name in ("prefetched", *_MS_COLUMNS, *_TIME_COLUMNS):
            batch_op.drop_column(name)
