"""Initial schema: runs, jobs (the ledger), workers (environment fingerprints), results.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("filelist", sa.Text(), nullable=False),
        sa.Column("root", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("model_label", sa.Text(), nullable=False),
        sa.Column("random_weights", sa.Boolean(), nullable=False),
        sa.Column("queue", sa.String(length=200), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("gpu_name", sa.String(length=255), nullable=True),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=True),
        sa.Column("driver", sa.String(length=64), nullable=True),
        sa.Column("cuda", sa.String(length=32), nullable=True),
        sa.Column("torch", sa.String(length=64), nullable=False),
        sa.Column("transformers", sa.String(length=64), nullable=False),
        sa.Column("python", sa.String(length=32), nullable=False),
        sa.Column("project_version", sa.String(length=32), nullable=False),
        sa.Column("git_sha", sa.String(length=40), nullable=True),
        sa.Column("model_label", sa.Text(), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=128), nullable=True),
        sa.Column("random_weights", sa.Boolean(), nullable=False),
        sa.Column("first_seen", sa.DateTime(), nullable=False),
        sa.Column("last_seen", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("image", sa.Text(), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("repeat", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("last_error_class", sa.String(length=200), nullable=True),
        sa.Column("last_error_message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("queued_at", sa.DateTime(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_run_state", ["run_id", "state"], unique=False)

    op.create_table(
        "results",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("worker_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("clock", sa.String(length=16), nullable=False),
        sa.Column("preprocess_ms", sa.Float(), nullable=False),
        sa.Column("prefill_ms", sa.Float(), nullable=False),
        sa.Column("vision_ms", sa.Float(), nullable=False),
        sa.Column("sam_ms", sa.Float(), nullable=False),
        sa.Column("clip_ms", sa.Float(), nullable=False),
        sa.Column("projector_ms", sa.Float(), nullable=False),
        sa.Column("lm_prefill_ms", sa.Float(), nullable=False),
        sa.Column("decode_ms", sa.Float(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=False),
        sa.Column("e2e_ms", sa.Float(), nullable=False),
        sa.Column("decode_step_ms", sa.JSON(), nullable=False),
        sa.Column("decode_ms_per_token_p50", sa.Float(), nullable=True),
        sa.Column("decode_ms_per_token_p90", sa.Float(), nullable=True),
        sa.Column("decode_ms_per_token_p99", sa.Float(), nullable=True),
        sa.Column("decode_tokens", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("image_tokens", sa.Integer(), nullable=False),
        sa.Column("crop_cols", sa.Integer(), nullable=False),
        sa.Column("crop_rows", sa.Integer(), nullable=False),
        sa.Column("image_width", sa.Integer(), nullable=False),
        sa.Column("image_height", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("stop_reason", sa.String(length=32), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("kv_length", sa.Integer(), nullable=False),
        sa.Column("vision_calls", sa.Integer(), nullable=False),
        sa.Column("engine", sa.String(length=16), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("model_label", sa.Text(), nullable=False),
        sa.Column("random_weights", sa.Boolean(), nullable=False),
        sa.Column("markup", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("boxes", sa.JSON(), nullable=False),
        sa.Column("box_count", sa.Integer(), nullable=False),
        sa.Column("skipped_spans", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["worker_id"],
            ["workers.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id"),
    )
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_results_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_results_run_id"))

    op.drop_table("results")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_run_state")

    op.drop_table("jobs")
    op.drop_table("workers")
    op.drop_table("runs")
