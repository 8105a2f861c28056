"""Liveness: one row per process that runs jobs, with its heartbeat; worker sessions point at it; the
jobs' lease columns indexed for the heartbeat's renewals and sweeps.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "worker_processes",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("queues", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_jobs_lease_owner", "jobs", ["lease_owner"])
    op.create_index("ix_jobs_state_lease_expires", "jobs", ["state", "lease_expires_at"])
    with op.batch_alter_table("worker_sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("worker_process_id", sa.String(length=200), nullable=True))
        batch_op.create_foreign_key(
            "fk_worker_sessions_worker_process_id", "worker_processes", ["worker_process_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("worker_sessions", schema=None) as batch_op:
        batch_op.drop_constraint("fk_worker_sessions_worker_process_id", type_="foreignkey")
        batch_op.drop_column("worker_process_id")
    op.drop_index("ix_jobs_state_lease_expires", table_name="jobs")
    op.drop_index("ix_jobs_lease_owner", table_name="jobs")
    op.drop_table("worker_processes")
