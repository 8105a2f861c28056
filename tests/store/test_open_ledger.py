"""A command that needs a ledger (`report`, `runs`, `status`, `export`, `submit`, `reconcile`) run where
there is none: one line, exit 2, and nothing created — neither the default ./dsocr.db nor the folders
of a DSOCR_DATABASE_URL that names a missing one."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from dsocr_workers.cli import main
from dsocr_workers.store.db import SchemaError, defer_ctrl_c_to_transaction_ends, open_database, open_ledger

COMMANDS = {
    "report": ["report", "--run", "latest"],
    "runs": ["runs"],
    "status": ["status", "--run", "latest"],
    "export": ["export", "--run", "latest", "--omnidocbench", "predictions"],
    "reconcile": ["reconcile"],
}


def invoke(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, env=env)
    return result.exit_code, result.output


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_fresh_directory_gets_no_database(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, output = invoke(COMMANDS[command], {"DSOCR_DATABASE_URL": ""})  # unset: the default ./dsocr.db
    assert code == 2, output
    assert output.strip().splitlines() == [
        "error: no dsocr database at sqlite:///./dsocr.db; run `dsocr run` or `dsocr db upgrade` first"
    ]
    assert list(tmp_path.iterdir()) == []  # no dsocr.db, no predictions/ folder


SAMPLES = Path(__file__).resolve().parents[2] / "datasets" / "samples" / "samples.txt"
MAKING = {"run": ["run", str(SAMPLES)], "submit": ["submit", str(SAMPLES)], "db upgrade": ["db", "upgrade"]}


@pytest.mark.parametrize("command", sorted({**COMMANDS, **MAKING}))
def test_missing_folder_is_refused_alike_and_not_created(command, tmp_path, monkeypatch):
    """Commands that read a ledger and those that make one refuse a SQLite URL whose folder is missing the
    same way, and none creates it."""
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"
    code, output = invoke({**COMMANDS, **MAKING}[command], {"DSOCR_DATABASE_URL": url})
    assert code == 2, output
    assert output.strip() == f"error: DSOCR_DATABASE_URL {url}: the folder {tmp_path / 'no' / 'such' / 'dir'} does not exist"
    assert not (tmp_path / "no").exists()


def test_submit_to_a_missing_ledger_creates_nothing(tmp_path, monkeypatch, make_png):
    image = make_png("p.png", folder=tmp_path / "pages")
    filelist = tmp_path / "pages" / "list.txt"
    filelist.write_text(f"{image.name}\n")
    monkeypatch.chdir(tmp_path)
    code, output = invoke(["submit", str(filelist)], {"DSOCR_DATABASE_URL": ""})
    assert code == 2, output
    assert "no dsocr database at sqlite:///./dsocr.db" in output
    assert not (tmp_path / "dsocr.db").exists()


def test_empty_file_is_refused_as_no_ledger(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    db = open_database(url)
    with db.engine.connect():  # an empty file, as an earlier version's read-only commands left behind
        pass
    db.dispose()
    with pytest.raises(SchemaError, match=r"no dsocr database at .*empty\.db \(no dsocr schema in it\); "
                                          r"run `dsocr run` or `dsocr db upgrade` first"):  # fmt: skip
        open_ledger(url)


def test_existing_ledger_opens(sqlite_url):
    db = open_ledger(sqlite_url)
    try:
        assert db.is_sqlite
    finally:
        db.dispose()


def test_runs_reads_an_existing_ledger(sqlite_url):
    code, output = invoke(["runs"], {"DSOCR_DATABASE_URL": sqlite_url})
    assert code == 0 and "no dsocr database" not in output, output


def test_ctrl_c_in_a_transaction_comes_at_its_end_and_leaves_the_ledger_writable(sqlite_url):
    """Ctrl-C (a real SIGINT to this process) inside a write transaction, with the deferral `dsocr run`
    and `dsocr submit` install: the transaction goes on and commits, then KeyboardInterrupt; another
    connection takes SQLite's write lock at once while it is handled, as `dsocr run` hands back its jobs.
    Outside a transaction Ctrl-C interrupts at once."""
    db = open_database(sqlite_url)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground process
    try:
        defer_ctrl_c_to_transaction_ends()
        with pytest.raises(KeyboardInterrupt) as interrupt, db.transaction() as tx:
            tx.execute(text("CREATE TABLE written (x)"))
            os.kill(os.getpid(), signal.SIGINT)
            tx.execute(text("INSERT INTO written VALUES (1)"))
        assert interrupt.traceback  # still alive, as in an `except KeyboardInterrupt:` block
        other = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=1, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # "database is locked" after 1 s while the lock is held
            assert other.execute("SELECT x FROM written").fetchall() == [(1,)]
            other.execute("ROLLBACK")
        finally:
            other.close()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGINT, previous)
        db.dispose()
