"""A model family's own stage is NULL in another family's results: `results.clip_ms` becomes nullable,
and the 0 that rows stored for a stage their model does not have (CLIP in DeepSeek-OCR-2's rows, the
Qwen2 encoder in DeepSeek-OCR's since 0014) becomes NULL: not measured, as the report reads it.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# Each family stage's column and the family that has it, at this revision (model/families.py).
FAMILY_COLUMNS = {"clip_ms": "deepseek-ocr", "qwen2_ms": "deepseek-ocr2"}


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.alter_column("clip_ms", existing_type=sa.Float(), nullable=True)
    for column, family in FAMILY_COLUMNS.items():
        op.execute(
            sa.text(
                f"UPDATE results SET {column} = NULL "
                "WHERE run_id IN (SELECT id FROM runs WHERE model_family <> :family)"
            ).bindparams(family=family)
        )


def downgrade() -> None:
    # Before this revision a row without CLIP stored 0 there; the Qwen2 encoder's NULLs stay (nullable).
    op.execute(sa.text("UPDATE results SET clip_ms = 0 WHERE clip_ms IS NULL"))
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.alter_column("clip_ms", existing_type=sa.Float(), nullable=False)
