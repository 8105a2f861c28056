"""A process found dead: `worker_processes.found_dead_at`, set by the sweep that found it silent for a
lease without a clean stop and sent again the messages it may have taken from Redis with it.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Processes recorded before this revision were never found dead: NULL (a sweep looks at them once).
    with op.batch_alter_table("worker_processes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("found_dead_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("worker_processes", schema=None) as batch_op:
        batch_op.drop_column("found_dead_at")
