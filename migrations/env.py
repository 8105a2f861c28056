"""Alembic environment: runs migrations on the connection `dsocr db upgrade` hands over, or on
DSOCR_DATABASE_URL when Alembic's own command line is used."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from dsocr_workers.settings import Settings
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Base

config = context.config
target_metadata = Base.metadata


def run_on(connection: Connection) -> None:
    # SQLite cannot ALTER most things: batch mode recreates tables instead.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_on(connection)
else:
    url = config.attributes.get("database_url") or Settings.from_env().database_url
    db = open_database(url)
    with db.engine.begin() as fresh:
        run_on(fresh)
    db.dispose()
