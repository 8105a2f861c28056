"""Job reservations: a worker child names the job its Celery worker has fetched for it
next (`jobs.reserved_by`, until `reserved_until`, renewed by its heartbeat) while it prepares that job's
page, so that a sweep can bring the job's message back at once if that worker dies before claiming it.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reserved_by", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("reserved_until", sa.DateTime(), nullable=True))
        batch_op.create_index("ix_jobs_reserved_by", ["reserved_by"])


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_reserved_by")
        batch_op.drop_column("reserved_until")
        batch_op.drop_column("reserved_by")
