"""A heartbeat's sweep on the embedded default (SQLite): the labels of the messages it sends are read in
the sweep's own transaction (a second one would wait on SQLite's write lock until its busy timeout)."""

from __future__ import annotations

import time
from datetime import timedelta

from dsocr_workers.farm.celery.messages import job_labels
from dsocr_workers.farm.liveness import Heartbeat, Sweep
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Run, job_id_for, utcnow


def test_a_sqlite_sweep_requeues_a_dead_holders_job_at_once_with_its_label(sqlite_url):
    db = open_database(sqlite_url)
    job_id = job_id_for("r1", "a.png", 0)
    with db.transaction() as session:
        session.add(Run(id="r1", name="t", filelist="l", root="/d", model="tiny", model_label="tiny",
                        random_weights=True, queue="q", parameters={}, tags={}))  # fmt: skip
        session.flush()
        session.add(Job(id=job_id, run_id="r1", image="a.png", line=1, repeat=0, state="queued"))
    with db.transaction() as session:
        ledger.claim_job(session, job_id, "h:1:dead", lease_s=60, max_attempts=3, is_dead=lambda o: False)
    sent: dict[str, str] = {}
    sweep = Sweep(("q",), lambda session, jobs: sent.update(job_labels(session, [j for j, _ in jobs])))
    heartbeat = Heartbeat(db, "h:2:live", Settings(), device="cpu", queues=("q",), sweep=sweep)
    started = time.monotonic()
    beat = heartbeat.beat(utcnow() + timedelta(seconds=61))
    assert time.monotonic() - started < 5  # not a wait on the write lock
    assert beat.requeued == [(job_id, "q")]
    assert sent == {job_id: "{'run': 'r1', 'image': 'a.png', 'repeat': 0}"}
    db.dispose()
