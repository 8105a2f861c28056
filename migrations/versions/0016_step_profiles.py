"""Profiles of batch steps: a `--profile N` run at `--concurrency` above 1 runs sampled steps of its
batched engine under torch.profiler. `job_profiles` becomes `profiles`, whose row is a job's (`job_id`)
or a batch step's (`batch_step_id`), and `batch_steps.profiled` flags the sampled steps (left out of the
step statistics). The job profiles recorded before are kept; going down drops the steps' profiles.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

PAYLOAD = "run_id, job_id, created_at, activity, trace_gz, trace_bytes, summary"


def upgrade() -> None:
    with op.batch_alter_table("batch_steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("profiled", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=True),
        sa.Column("batch_step_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("activity", sa.String(length=16), nullable=False),
        sa.Column("trace_gz", sa.LargeBinary(), nullable=False),
        sa.Column("trace_bytes", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.CheckConstraint("(job_id IS NULL) <> (batch_step_id IS NULL)", name="ck_profiles_job_or_step"),
        sa.ForeignKeyConstraint(["batch_step_id"], ["batch_steps.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_profiles_run_id", "profiles", ["run_id"])
    op.create_index("ix_profiles_job_id", "profiles", ["job_id"], unique=True)
    op.create_index("ix_profiles_batch_step_id", "profiles", ["batch_step_id"], unique=True)
    op.execute(f"INSERT INTO profiles ({PAYLOAD}) SELECT {PAYLOAD} FROM job_profiles")
    op.drop_index("ix_job_profiles_run_id", table_name="job_profiles")
    op.drop_table("job_profiles")


def downgrade() -> None:
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
    op.execute(
        f"INSERT INTO job_profiles ({PAYLOAD}) SELECT {PAYLOAD} FROM profiles WHERE job_id IS NOT NULL"
    )
    op.drop_index("ix_profiles_batch_step_id", table_name="profiles")
    op.drop_index("ix_profiles_job_id", table_name="profiles")
    op.drop_index("ix_profiles_run_id", table_name="profiles")
    op.drop_table("profiles")
    with op.batch_alter_table("batch_steps", schema=None) as batch_op:
        batch_op.drop_column("profiled")
