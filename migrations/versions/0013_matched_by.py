"""Matched by: per result the matching that paired its page's text and formulas with the reference's,
quick_match or, past its time limit (DSOCR_MATCH_TIME_LIMIT), one-to-one as the evaluator falls back.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rows scored before this revision do not say which matching scored them: NULL.
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("matched_by", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_column("matched_by")
