"""While a batch-1 job's setup and prefill are launched on a GPU, the ledger threads start no claim or
write (farm/job/ledger_threads.py `hold`): a claim handed over then waits for `release`, or at most
HOLD_LIMIT_S. The ledger (SQLite and PostgreSQL) and the threads are the real ones."""

from __future__ import annotations

import time

from sqlalchemy import text

from dsocr_workers.farm.job import ledger_threads
from dsocr_workers.farm.job.ledger_threads import LedgerThreads


def test_a_claim_handed_over_during_a_hold_starts_at_its_release(database):
    threads = LedgerThreads(database)
    try:
        threads.hold()
        claim = threads.claim(lambda tx: tx.execute(text("SELECT 1")).scalar_one())
        time.sleep(0.3)
        assert not claim.done()
        threads.release()
        assert claim.result(timeout=10) == 1
    finally:
        threads.close()


def test_a_hold_never_outlasts_its_limit(database, monkeypatch):
    monkeypatch.setattr(ledger_threads, "HOLD_LIMIT_S", 0.2)
    threads = LedgerThreads(database)
    try:
        threads.hold()  # and never released: a job that died between hold and release
        began = time.monotonic()
        claim = threads.claim(lambda tx: tx.execute(text("SELECT 1")).scalar_one())
        assert claim.result(timeout=10) == 1
        assert time.monotonic() - began >= 0.2
    finally:
        threads.close()
