"""A finished job's result, written on a thread of its own while the process takes its next job (issue 10).

Between two jobs of a Celery child the device waits for the host: the result's transaction (~1.8 ms on
an H200 host), Celery's hand-over of the next message (~3 ms there: the child reports back, the parent
acknowledges and fetches the next message) and the next claim. The result's transaction need not be on
that path: `ResultWriter.write` hands the result row to this thread and returns, so the task returns
and the next message is delivered while the row is written. The child waits in a pipe read meanwhile
(the GIL is free), so the write overlaps the hand-over instead of preceding it.

What a crash loses: nothing. The job's message is acknowledged when its task returns, possibly before
its row is written; a process that dies in between leaves the job `running` under its dead lease, as a
crash during inference does, and a live worker's sweep (farm/liveness.py) or the lease's expiry puts it
back in line: its inference runs again. A result written late keeps the time the job finished
(`finished_at` is taken at the hand-over), so throughput and the gaps between jobs are not moved by the
write's place in time.

A ledger outage: the write is tried again (2 s, then doubling to 30 s) until it goes through or the process
closes. It is never given up while the process lives: the process's heartbeat renews every lease it
holds, so a job whose result was dropped would stay `running` under a live lease for good. If the outage
outlasts the lease, a sweep may give the job to another worker meanwhile; the late write then finds the
lease gone and writes nothing (the ledger's guard). `close()` lets the write under way finish, or, in an
outage, gives it up after its current try: the process exits and the job is put back in line as after a
crash. A warm shutdown with the ledger up writes every result it has.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any

from tenacity import Retrying, retry_if_exception_type, wait_exponential

from dsocr_workers.errors import TransientError
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database

log = logging.getLogger("dsocr.worker")


class ResultWriter:
    """Writes results one at a time, in the order handed over, on one thread."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._closing = threading.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-results")
        self._last: Future[bool] | None = None

    def write(self, claim: ledger.Claim, row: dict[str, Any], finished_at: datetime) -> None:
        """Mark `claim`'s job done with its result `row`, after this call returns."""
        self._last = self._thread.submit(self._write, claim, row, finished_at)

    def wait(self) -> bool | None:
        """Wait for the last result handed over: True when written, False when its lease was lost or the
        write was given up, None when none was handed over."""
        return None if self._last is None else self._last.result()

    def close(self) -> None:
        self._closing.set()  # ends the waits between tries, not a try under way
        self._thread.shutdown(wait=True)

    def _pause(self, seconds: float) -> None:
        self._closing.wait(seconds)  # cut short by close()

    def _write(self, claim: ledger.Claim, row: dict[str, Any], finished_at: datetime) -> bool:
        retrying = Retrying(
            retry=retry_if_exception_type(TransientError),
            wait=wait_exponential(multiplier=2, max=30),
            stop=lambda _: self._closing.is_set(),
            sleep=self._pause,
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt, self._db.transaction() as session:
                    written = ledger.complete_job(session, claim, row, now=finished_at)
        except Exception:  # closing in an outage, or a bug: the job is swept once this process is gone
            log.exception("job %s: its result could not be written; it will run again", claim.job_id)
            return False
        if written:
            log.info("job %s: done", claim.job_id)
        else:
            log.warning("job %s: lost: the lease was taken over before the result was written; discarded", claim.job_id)
        return written
