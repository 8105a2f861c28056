"""Batch steps' KV reads: `batch_steps.kv_positions` (a decode step's pages' attended positions, summed)
and `batch_steps.kv_longest` (the longest page's), what a decode step's attention reads.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Steps recorded before this revision, and prefill steps, have none: NULL.
    with op.batch_alter_table("batch_steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kv_positions", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("kv_longest", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_steps", schema=None) as batch_op:
        batch_op.drop_column("kv_longest")
        batch_op.drop_column("kv_positions")
