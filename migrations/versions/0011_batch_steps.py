"""Batch steps: each step of a worker's batched engine for a run at `--concurrency`
above 1 (`batch_steps`): its kind (prefill or decode), occupancy, bucket, start and duration on the
device, and a prefill's prompt tokens and vision time.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("worker_session_id", sa.String(length=32), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("occupancy", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("vision_ms", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_session_id"], ["worker_sessions.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_batch_steps_run_id", "batch_steps", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_batch_steps_run_id", table_name="batch_steps")
    op.drop_table("batch_steps")
