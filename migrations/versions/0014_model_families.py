"""Model families: the run's model family (`runs.model_family`; every run before this revision ran
DeepSeek-OCR), and the Qwen2 encoder's stage time of DeepSeek-OCR-2 (`results.qwen2_ms`, NULL in rows
measured before it existed).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("model_family", sa.String(length=64), nullable=False, server_default="deepseek-ocr")
        )
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("qwen2_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_column("qwen2_ms")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("model_family")
