"""INSERT … ON CONFLICT for the two dialects the ledger runs on (both spell it the same way)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, Session

from dsocr_workers.errors import InputError


def upsert(
    session: Session,
    model: type[DeclarativeBase],
    values: Mapping[str, Any],
    conflict_columns: Iterable[str],
    update_columns: Iterable[str] | None = None,
) -> None:
    """Insert `values` into `model`'s table; on a conflict on `conflict_columns` overwrite `update_columns` (every other
    column when None; nothing when empty)."""
    dialect = session.get_bind().dialect.name
    table = cast(Table, model.__table__)
    insert: Any = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
    if insert is None:
        raise InputError(f"the ledger runs on SQLite or PostgreSQL; DSOCR_DATABASE_URL names {dialect}")
    keys = list(conflict_columns)
    statement = insert(table).values(dict(values))
    columns = [c for c in values if c not in keys] if update_columns is None else list(update_columns)
    if columns:
        statement = statement.on_conflict_do_update(
            index_elements=keys, set_={c: statement.excluded[c] for c in columns}
        )
    else:
        statement = statement.on_conflict_do_nothing(index_elements=keys)
    session.execute(statement)
