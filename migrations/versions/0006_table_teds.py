"""Table TEDS: per result the tree-edit-distance similarity of its tables to the reference's,
with and without cell content, as OmniDocBench's end-to-end evaluator computes it.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Rows written before this revision were not scored by TEDS: NULL.
_COLUMNS = ("table_teds", "table_teds_structure")


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for name in _COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for name in _COLUMNS:
            batch_op.drop_column(name)
