"""A run by the name a user types (store/runs.py): id, unique prefix or latest, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest

from dsocr_workers.errors import InputError
from dsocr_workers.store.models import Run, utcnow
from dsocr_workers.store.runs import resolve_run


def add_runs(database, ids_by_age: list[str]) -> None:
    """Runs created one minute apart, oldest first."""
    now = utcnow()
    with database.transaction() as session:
        for age, run_id in enumerate(reversed(ids_by_age)):
            session.add(Run(id=run_id, name=run_id, created_at=now - timedelta(minutes=age), filelist="l", root="/d",
                            model="tiny", model_label="tiny", random_weights=True, queue="q", parameters={}, tags={}))  # fmt: skip


def test_a_run_by_id_unique_prefix_or_latest(database):
    with database.transaction() as session, pytest.raises(InputError, match="there is no run yet"):
        resolve_run(session, "latest")
    add_runs(database, ["abc123", "abd456", "a_c789", "zzz000"])
    with database.transaction() as session:
        assert resolve_run(session, "latest").id == "zzz000"
        assert resolve_run(session, "abc123").id == "abc123"
        assert resolve_run(session, "abd").id == "abd456"
        assert resolve_run(session, "a_").id == "a_c789"  # `_` is a character, not LIKE's wildcard
        with pytest.raises(InputError, match="run id prefix 'ab' is ambiguous"):
            resolve_run(session, "ab")
        with pytest.raises(InputError, match="no run 'nope'"):
            resolve_run(session, "nope")
