"""Interrupted runs: `runs.interrupted_at`, set when `dsocr run` (or `dsocr resume`) is interrupted
with jobs of its run not final (their leases handed back, the jobs queued again), cleared when the
run is resumed.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("interrupted_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("interrupted_at")
