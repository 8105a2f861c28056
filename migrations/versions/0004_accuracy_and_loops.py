"""Accuracy and degenerate output: a run's ground-truth file, each job's reference, and per result the
repetition loop its output ends in and its edit distances to the reference.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Rows written before this revision have no reference and were never looked at for loops: NULL.
_LOOP_COLUMNS = ("loop_start", "loop_period", "loop_wasted_steps")
_EDIT_COLUMNS = ("text_edit", "formula_edit", "table_edit", "reading_order_edit")


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ground_truth", sa.Text(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reference", sa.JSON(), nullable=True))
    with op.batch_alter_table("results", schema=None) as batch_op:
        for name in _LOOP_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=True))
        for name in _EDIT_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for name in (*_LOOP_COLUMNS, *_EDIT_COLUMNS):
            batch_op.drop_column(name)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("reference")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("ground_truth")
