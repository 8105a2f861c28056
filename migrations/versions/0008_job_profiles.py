"""Kernel-level profiles: which jobs run under torch.profiler (`jobs.profile`, set by submit's
`--profile N`), which results did (`results.profiled`: left out of latency statistics unless asked), and
each profiled job's trace and kernels per stage (`job_profiles`).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("profile", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("profiled", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "job_profiles",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("activity", sa.String(length=16), nullable=False),
        sa.Column("trace_gz", sa.LargeBinary(), nullable=False),
        sa.Column("trace_bytes", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id"),
    )
    op.create_index("ix_job_profiles_run_id", "job_profiles", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_job_profiles_run_id", table_name="job_profiles")
    op.drop_table("job_profiles")
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_column("profiled")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("profile")
