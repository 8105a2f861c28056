"""Worker sessions' import time: `worker_sessions.import_ms`, what a worker process's start spent
importing torch, transformers and the engine before its first model (0 where it forked from a
`dsocr worker` parent that had imported them).

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Sessions recorded before this revision did not measure it: NULL.
    with op.batch_alter_table("worker_sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("import_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("worker_sessions", schema=None) as batch_op:
        batch_op.drop_column("import_ms")
