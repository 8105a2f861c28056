"""Trustworthy measurements: worker sessions (load and warm-up outside jobs), the parts of e2e, wasted
decode steps, cold results and the per-job memory split.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Rows written before this revision have no measured parts: 0 (or NULL for memory) says "not recorded".
_FLOAT_PARTS = (
    "setup_ms",
    "first_token_ms",
    "wasted_decode_ms",
    "readback_ms",
    "postprocess_ms",
    "host_gap_ms",
)


def upgrade() -> None:
    op.create_table(
        "worker_sessions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("worker_id", sa.String(length=32), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("engine", sa.String(length=16), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=True),
        sa.Column("warmup", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("load_ms", sa.Float(), nullable=True),
        sa.Column("warmup_ms", sa.Float(), nullable=True),
        sa.Column("ready_at", sa.DateTime(), nullable=True),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("worker_session_id", sa.String(length=32), nullable=True))
        for name in _FLOAT_PARTS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("wasted_steps", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("weights_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("kv_cache_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("activation_peak_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("cold", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column("cold_reason", sa.Text(), nullable=True))
        batch_op.create_foreign_key(
            "fk_results_worker_session_id", "worker_sessions", ["worker_session_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_constraint("fk_results_worker_session_id", type_="foreignkey")
        for name in (
            "worker_session_id",
            *_FLOAT_PARTS,
            "wasted_steps",
            "weights_bytes",
            "kv_cache_bytes",
            "activation_peak_bytes",
            "cold",
            "cold_reason",
        ):
            batch_op.drop_column(name)
    op.drop_table("worker_sessions")
