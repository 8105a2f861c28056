"""`upsert` against SQLite and PostgreSQL: insert, overwrite on conflict, leave alone, unknown columns."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from dsocr_workers.store.models import Worker, utcnow
from dsocr_workers.store.upsert import upsert


def worker(**overrides):
    return {"id": "w1", "host": "h", "device": "cpu", "torch": "2", "transformers": "5", "python": "3.11",
            "project_version": "0.1.0", "model_label": "preset:tiny", "random_weights": True, "last_seen": utcnow(),
            **overrides}  # fmt: skip


def test_insert_then_overwrite_then_leave_alone(database):
    with database.transaction() as tx:
        upsert(tx, Worker, worker(host="first"), ["id"])
    with database.transaction() as tx:
        upsert(tx, Worker, worker(host="second", device="cuda:0"), ["id"], ["host"])  # host only
    with database.transaction() as tx:
        upsert(tx, Worker, worker(host="third"), ["id"], [])  # a conflict changes nothing
        upsert(tx, Worker, worker(id="w2", host="other"), ["id"])  # the same statement, another row
    with database.transaction() as tx:
        rows = {w.id: (w.host, w.device) for w in tx.scalars(select(Worker))}
    assert rows == {"w1": ("second", "cpu"), "w2": ("other", "cpu")}


def test_an_unknown_column_is_an_error_and_writes_nothing(database):
    with pytest.raises(ValueError, match="workers has no column hostname"), database.transaction() as tx:
        upsert(tx, Worker, {**worker(), "hostname": "h"}, ["id"])
    with database.transaction() as tx:
        assert tx.scalars(select(Worker)).all() == []
