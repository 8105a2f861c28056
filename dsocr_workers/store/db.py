"""Connections to the ledger: one SQLAlchemy engine per process, created after fork, and the schema check.

SQLite is set up for several writer processes on one machine: WAL (readers never block the writer),
a 30 s busy timeout, and `BEGIN IMMEDIATE` so that a transaction takes the write lock when it starts —
a deferred transaction that reads and then writes can fail at once with "database is locked" instead of
waiting for the busy timeout.

Ctrl-C raises KeyboardInterrupt wherever the main thread is; inside a ledger statement it can leave
SQLite's write lock held by a connection SQLAlchemy closed with the statement still open, and the
process's next writes wait out the busy timeout. A command that writes after Ctrl-C (`dsocr run` hands
its jobs back, `dsocr submit` marks what it sent) calls `defer_ctrl_c_to_transaction_ends`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.settings import redacted


def _migrations_dir() -> Path:
    """The Alembic scripts: inside the package where a wheel installed them, else the checkout's
    top-level migrations/ (which pyproject.toml maps into the package when it builds)."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "migrations"
    return installed if (installed / "env.py").is_file() else package.parent / "migrations"


MIGRATIONS_DIR = _migrations_dir()
SQLITE_BUSY_TIMEOUT_MS = 30_000
# libpq's TCP keepalive (libpq otherwise leaves it to the OS: hours): a query whose reply was lost in a
# partition would wait that long, a heartbeat that stops renewing leases; with it, the wait ends as a
# TransientError that the caller retries. A merely slow query is unaffected: the server answers probes.
POSTGRES_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 5, "keepalives_count": 3}


class SchemaError(InputError):
    """The database's schema is not the one this version of the code was written for."""


@dataclass
class Database:
    url: str
    engine: Engine
    sessions: sessionmaker[Session]
    pid: int

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error. A lost or refused
        connection comes out as TransientError so the caller can retry later."""
        on_main_thread = threading.current_thread() is threading.main_thread()
        with _ctrl_c_held() if on_main_thread else nullcontext():
            try:
                with self.sessions.begin() as tx:
                    yield tx
            except OperationalError as exc:
                raise TransientError(f"database unavailable ({redacted(self.url)}): {exc.orig}") from exc
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise TransientError(f"database connection lost ({redacted(self.url)}): {exc.orig}") from exc
                raise

    def dispose(self) -> None:
        self.engine.dispose()


# Signal handlers run on the main thread only: these two are the main thread's.
_main_thread_transactions = 0  # transactions of the main thread under way (nested: several engines)
_ctrl_c_pending = False  # Ctrl-C came during one of them


def defer_ctrl_c_to_transaction_ends() -> None:
    """From now on in this process, Ctrl-C during a ledger transaction of the main thread raises
    KeyboardInterrupt once that transaction has ended (committed or rolled back), elsewhere at once.
    Nothing changes where SIGINT is not Python's default handler (ignored, as in a background job)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_ctrl_c)


def _on_ctrl_c(_signum: int, _frame: object) -> None:
    global _ctrl_c_pending
    if _main_thread_transactions:
        _ctrl_c_pending = True
        return
    raise KeyboardInterrupt


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    global _main_thread_transactions, _ctrl_c_pending
    _main_thread_transactions += 1
    try:
        yield
    finally:
        _main_thread_transactions -= 1
        if not _main_thread_transactions and _ctrl_c_pending:
            _ctrl_c_pending = False
            raise KeyboardInterrupt


# `dsocr run` makes the embedded default's ledger itself; a server's is made by `dsocr db upgrade` only.
_FIRST_STEP_SQLITE = "run `dsocr run` or `dsocr db upgrade` first"
SUPPORTED_URLS = "sqlite:///PATH (the embedded default) or postgresql+psycopg://USER@HOST[:PORT]/DB"


def parse_database_url(url: str) -> URL:
    """The ledger URL, checked: a clear input error for anything but SQLite or PostgreSQL via psycopg."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InputError(f"DSOCR_DATABASE_URL is not a database URL; expected {SUPPORTED_URLS}") from None
    backend, driver = parsed.get_backend_name(), parsed.drivername.partition("+")[2]
    if backend == "sqlite":
        return parsed
    if backend in ("postgres", "postgresql"):
        if "+" in parsed.drivername and driver != "psycopg":  # the driver the project installs
            raise InputError(f"DSOCR_DATABASE_URL {parsed.render_as_string()!r}: use {SUPPORTED_URLS}")
        if not parsed.host or not parsed.database:
            raise InputError(
                f"DSOCR_DATABASE_URL {parsed.render_as_string()!r} names no host or database; "
                f"expected {SUPPORTED_URLS}"
            )
        return parsed.set(drivername="postgresql+psycopg")
    raise InputError(f"DSOCR_DATABASE_URL: the {backend!r} database is not supported; use {SUPPORTED_URLS}")


def open_database(url: str) -> Database:
    """A new engine for `url`, creating an SQLite file (in a folder that exists) on first use: for what makes a
    ledger (`dsocr db upgrade`, `dsocr run`). Call it in the process that uses it (after fork, never
    before); a command that needs a ledger to exist opens it with `open_ledger`."""
    parsed = parse_database_url(url)
    keepalive = {
        name: value for name, value in POSTGRES_KEEPALIVE.items() if name not in parsed.query
    }  # the URL's win
    options: dict[str, Any] = {"pool_pre_ping": True, "connect_args": keepalive}
    if parsed.get_backend_name() == "sqlite":
        _sqlite_file(parsed, url)
        options = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}}
    engine = create_engine(parsed, **options)
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    return Database(
        url=url, engine=engine, sessions=sessionmaker(engine, expire_on_commit=False), pid=os.getpid()
    )


def _sqlite_file(parsed: URL, url: str) -> Path | None:
    """The SQLite file `parsed` names (None: not a file), refused alike by every command where its folder
    is missing: a typo in the URL must not leave folders behind."""
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:"):
        return None
    file = Path(database).expanduser()
    if not file.parent.is_dir():
        raise InputError(f"DSOCR_DATABASE_URL {redacted(url)}: the folder {file.parent} does not exist")
    return file


def open_ledger(url: str) -> Database:
    """The ledger at `url` as it stands, for the commands that read it or add to it: an input error where
    there is none yet or its schema is not this code's. Creates nothing (no empty SQLite file left behind)."""
    parsed = parse_database_url(url)
    file = _sqlite_file(parsed, url)
    if file is not None and not file.is_file():
        raise SchemaError(f"no dsocr database at {redacted(url)}; {_FIRST_STEP_SQLITE}")
    db = open_database(url)
    try:
        check_schema(db)
    except BaseException:
        db.dispose()
        raise
    return db


_process_databases: dict[str, Database] = {}


def database_for(url: str) -> Database:
    """The process's engine for `url`, created on first use; a forked child gets its own."""
    db = _process_databases.get(url)
    if db is None or db.pid != os.getpid():
        db = open_database(url)
        _process_databases[url] = db
    return db


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN (pysqlite's own implicit BEGIN is deferred).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


# --- schema (Alembic) ---------------------------------------------------------------------------------


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = url
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    if head is None:
        raise SchemaError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def current_revision(db: Database) -> str | None:
    from alembic.runtime.migration import MigrationContext

    try:
        with db.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    except OperationalError as exc:
        raise TransientError(f"database unavailable ({redacted(db.url)}): {exc.orig}") from exc


def upgrade(db: Database) -> str:
    """Bring the schema to the newest migration; returns the revision it is at."""
    from alembic import command

    config = alembic_config(db.url)
    with db.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return head_revision()


def check_schema(db: Database) -> None:
    """Refuse a database whose schema is missing or older (or newer) than this code."""
    current, head = current_revision(db), head_revision()
    if current == head:
        return
    where = redacted(db.url)
    if current is None:
        first_step = _FIRST_STEP_SQLITE if db.is_sqlite else "run `dsocr db upgrade` first"
        raise SchemaError(f"no dsocr database at {where} (no dsocr schema in it); {first_step}")
    raise SchemaError(
        f"the database {where} is at schema revision {current}, this version of dsocr needs {head}; "
        "run `dsocr db upgrade` (with the newest dsocr) before starting workers"
    )
