"""A batched page's stages the batch does not time per page are NULL: the `results` columns of the device
stages (and the decode steps after EOS) become nullable, and the rows a batched run stored before (all 0,
its prefill too: no device stage of its own was timed) hold NULL there: not measured, as the report
reads it. A batch-1 row's prefill is never 0, so `prefill_ms = 0` finds those rows.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# The columns a batched row stored 0 in, at this revision (clip_ms and qwen2_ms: nullable since 0017).
COLUMNS = (
    "setup_ms",
    "prefill_ms",
    "vision_ms",
    "sam_ms",
    "projector_ms",
    "lm_prefill_ms",
    "first_token_ms",
    "decode_ms",
    "wasted_decode_ms",
    "readback_ms",
)
# Each family stage's column and the family that has it (as 0017's).
FAMILY_COLUMNS = {"clip_ms": "deepseek-ocr", "qwen2_ms": "deepseek-ocr2"}


def upgrade() -> None:
    with op.batch_alter_table("results", schema=None) as batch_op:
        for column in COLUMNS:
            batch_op.alter_column(column, existing_type=sa.Float(), nullable=True)
    nulls = ", ".join(f"{column} = NULL" for column in (*COLUMNS, *FAMILY_COLUMNS))
    op.execute(sa.text(f"UPDATE results SET {nulls} WHERE prefill_ms = 0"))


def downgrade() -> None:
    # Before this revision a batched row (its setup NULL since) stored 0 in each, and in its own
    # family's encoder.
    for column, family in FAMILY_COLUMNS.items():
        op.execute(
            sa.text(
                f"UPDATE results SET {column} = 0 WHERE setup_ms IS NULL "
                "AND run_id IN (SELECT id FROM runs WHERE model_family = :family)"
            ).bindparams(family=family)
        )
    for column in COLUMNS:
        op.execute(sa.text(f"UPDATE results SET {column} = 0 WHERE {column} IS NULL"))
    with op.batch_alter_table("results", schema=None) as batch_op:
        for column in COLUMNS:
            batch_op.alter_column(column, existing_type=sa.Float(), nullable=False)
