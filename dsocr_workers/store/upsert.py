"""INSERT … ON CONFLICT for the two dialects the ledger runs on (both spell it the same way)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any, cast

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, Session

from dsocr_workers.errors import InputError

INSERTS: dict[str, Any] = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def upsert(
    tx: Session,
    model: type[DeclarativeBase],
    values: Mapping[str, Any],
    conflict_columns: Iterable[str],
    update_columns: Iterable[str] | None = None,
) -> None:
    """Insert `values` into `model`'s table; on a conflict on `conflict_columns` overwrite `update_columns`
    (every other
    column when None; nothing when empty). A name that is no column of the table is a ValueError."""
    dialect = tx.get_bind().dialect.name
    if dialect not in INSERTS:
        raise InputError(f"the ledger runs on SQLite or PostgreSQL; DSOCR_DATABASE_URL names {dialect}")
    table = cast(Table, model.__table__)
    unknown = [name for name in values if name not in table.c]
    if unknown:
        raise ValueError(f"{table.name} has no column {', '.join(unknown)}")
    keys = tuple(conflict_columns)
    columns = tuple(c for c in values if c not in keys) if update_columns is None else tuple(update_columns)
    tx.execute(_statement(dialect, table, keys, columns), dict(values))


@lru_cache(maxsize=64)
def _statement(dialect: str, table: Table, keys: tuple[str, ...], columns: tuple[str, ...]) -> Any:
    """The statement for one shape of upsert, built once: the values travel as parameters. Built on every
    call, a result row's ~70 columns were Python work on the farm's path between two jobs."""
    statement = INSERTS[dialect](table)
    if columns:
        return statement.on_conflict_do_update(
            index_elements=list(keys), set_={c: statement.excluded[c] for c in columns}
        )
    return statement.on_conflict_do_nothing(index_elements=list(keys))
