"""A Celery child's ledger writes on threads of their own, off the path between two jobs (issue 10).

Between two jobs of a Celery child the device waited for the host (bench_scaling's split, on an H200
host, docs/benchmarks.md): the finished job's host part and result row (2.6 ms), its transaction with
Celery's hand-over of the next message (5.5 ms; the hand-over alone ~3 ms, probe_celery_handover.py: the
child reports back, the parent acknowledges and fetches the next message) and the next job's claim
transaction with its setup (3.5 ms). Neither transaction needs the main thread:

- **The result** (`complete`): the row is built and written on one thread while the task returns and
  the next message is delivered; the child waits in a pipe read meanwhile (the GIL is free), so the write
  overlaps the hand-over instead of preceding it. Building the row includes the engine's host part after
  the device (`DeviceRun.finish`: the text decoded and parsed, the timings read from the job's CUDA
  events). A row that cannot be built (a bug: it would fail again) fails the job.
- **A batched engine's steps** (`record_steps`, farm/job/batched.py): a few hundred `batch_steps` rows
  at a time, in one insert, on the results thread in turn with the results: the engine's thread, the
  only one on the device, only hands them over.
- **The claim** (`claim`): a job whose page was prefetched starts on the device while its claim is
  written on the other thread; the job waits for its claim before its first decode step
  (farm/job/process.py), so only its prefill can run before the lease is its own, and a refused claim drops
  that prefill and writes nothing. The message was delivered to this process: a refusal is a duplicate
  delivery, rare. A batched job's engine goes on, on its own thread, while its claim is written
  (farm/job/batched.py).

Two threads, one for claims and one for results: a claim must never wait behind a result whose write is
waiting out a ledger outage (the job would sit unclaimed past its time limit). On SQLite the two take
turns at the single writer's lock (`busy_timeout`), a fraction of a millisecond each.

Results and steps handed over while the results thread is busy are written together, in one transaction
(`Pending`): a batched engine's pages that joined together finish together, and on SQLite 128 results
written one transaction each held the writer's lock ~10 ms apiece, 1.1-1.7 s per batch on an H200 (1.8-4.2 s
for two workers on one ledger), while the next pages' claims waited their turn at it. Each result keeps
its own lease guard inside the transaction; a row that cannot be built fails its own job, as before.

What a crash loses: nothing. A job's message is acknowledged when its task returns, possibly before its
result is written; a process that dies in between leaves the job `running` under its dead lease, as a
crash during inference does, and a live worker's sweep (farm/liveness.py) puts it back in line once the
lease has run out: its inference runs again. A result written late keeps the time the job finished
(`finished_at` is taken when the task hands it over), so throughput and the gaps between jobs do not
move with the write.

A ledger outage: a claim fails at once (TransientError from `Claiming.result()`: the task retries the
message, as before). A result is tried again (2 s, then doubling to 30 s) until it goes through or the
process closes. Any other error of the write (none that a retry would cure) gives it up: the job is let
go (`Heartbeat.let_go`: its lease is no longer renewed), so that it runs out and a sweep puts the job back
in line, instead of the heartbeat keeping it `running` under a live lease for good. If
the outage outlasts the lease, a sweep may give the job to another worker meanwhile; the late write
then finds the lease gone and writes nothing (the ledger's guard). `close()` lets the write under way
finish, or, in an outage, gives it up after its current try: the process exits and the job is put back
in line as after a crash. A warm shutdown with the ledger up writes every result it has. Batch steps
are tried again as results are; steps given up are lost (logged), their jobs are not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from dsocr_workers.farm.retries import ledger_retrying
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database

log = logging.getLogger("dsocr.worker")
T = TypeVar("T")


@dataclass
class Completion:
    """A result handed over, and what became of its write."""

    claim: ledger.Claim
    build_row: Callable[[], dict[str, Any]]
    finished_at: datetime
    written: Future[bool] = field(default_factory=Future)


StepRows = Callable[[], list[dict[str, Any]]]  # a batched engine's steps as `batch_steps` rows, built late
Handed = Completion | StepRows  # what the results thread writes


class Pending:
    """What was handed to the results thread and not yet taken by it, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Handed] = []
        self._queued = False  # a write is submitted that has not yet taken the items

    def add(self, item: Handed) -> bool:
        """Add `item`; True when a write must be submitted to take it."""
        with self._lock:
            self._items.append(item)
            submit, self._queued = not self._queued, True
            return submit

    def take(self) -> list[Handed]:
        with self._lock:
            items, self._items, self._queued = self._items, [], False
            return items


class LedgerThreads:
    """A process's claims, and its result writes, each one at a time in the order handed over."""

    def __init__(self, db: Database, let_go: Callable[[str], None] = lambda job_id: None) -> None:
        self._db = db
        self._let_go = let_go  # a job whose result was given up: its lease is no longer renewed
        self._closing = threading.Event()
        self._claims = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-claims")
        self._results = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-results")
        self._pending = Pending()
        self._last_write: Future[bool] | None = None

    def claim(self, claim_job: Callable[[Session], ledger.Claim | ledger.Refusal]) -> Future[ledger.Claim | ledger.Refusal]:
        """`claim_job` in a transaction of its own: its Claim or Refusal, or its TransientError."""
        return self._claims.submit(self._claim, claim_job)

    def complete(self, claim: ledger.Claim, build_row: Callable[[], dict[str, Any]], finished_at: datetime) -> None:
        """Mark `claim`'s job done with the result `build_row()` makes, after this call returns."""
        completion = Completion(claim, build_row, finished_at)
        self._last_write = completion.written
        self._hand_over(completion)

    def record_steps(self, build_rows: StepRows) -> None:
        """Insert the `batch_steps` rows `build_rows()` makes, after this call returns."""
        self._hand_over(build_rows)

    def _hand_over(self, item: Handed) -> None:
        if self._pending.add(item):
            self._results.submit(self._write_pending)

    def wait(self) -> bool | None:
        """Wait for the last result handed over: True when written; False when not (its lease was lost,
        its write given up, or it could not be built); None when none was handed over."""
        return None if self._last_write is None else self._last_write.result()

    def close(self) -> None:
        self._closing.set()  # ends the waits between tries, not a try under way
        self._claims.shutdown(wait=True)
        self._results.shutdown(wait=True)

    def _claim(self, claim_job: Callable[[Session], ledger.Claim | ledger.Refusal]) -> ledger.Claim | ledger.Refusal:
        with self._db.transaction() as session:
            return claim_job(session)

    def _pause(self, seconds: float) -> None:
        self._closing.wait(seconds)  # cut short by close()

    def _write_pending(self) -> None:
        """Every result and step handed over so far, in one transaction (the rows built first)."""
        items = self._pending.take()
        try:
            self._write(items)
        except Exception:  # a bug here: the jobs' leases run out and a sweep puts them back in line
            log.exception("results that could not be written")
            for item in items:
                if isinstance(item, Completion) and not item.written.done():
                    self._let_go(item.claim.job_id)
                    item.written.set_result(False)

    def _write(self, items: list[Handed]) -> None:
        built: list[tuple[Completion, dict[str, Any]]] = []
        steps: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, Completion):
                if (row := self._built(item)) is not None:
                    built.append((item, row))
            else:
                try:
                    steps += item()
                except Exception:  # a bug, the same on every attempt: the steps are lost, the jobs are not
                    log.exception("batch steps that could not be made into rows; not written")

        def write(session: Session) -> list[bool]:
            ledger.record_batch_steps(session, steps)
            return [ledger.complete_job(session, c.claim, row, now=c.finished_at) for c, row in built]

        outcomes = self._retrying(write) if built or steps else []
        if outcomes is None and steps:
            log.warning("%d batch steps were given up; the run's report lacks them", len(steps))
        for index, (completion, _) in enumerate(built):
            written = None if outcomes is None else outcomes[index]
            job_id = completion.claim.job_id
            if written:
                log.info("job %s: done", job_id)
            elif written is not None:
                log.warning("job %s: lost: the lease was taken over before the result was written; discarded", job_id)
            else:
                self._let_go(job_id)
                log.warning("job %s: its result was given up; its lease is let run out and a sweep puts it back in line",
                            job_id)  # fmt: skip
            completion.written.set_result(bool(written))

    def _built(self, completion: Completion) -> dict[str, Any] | None:
        """Its row; None when it cannot be built (the job then fails: a bug, the same on every attempt)."""
        claim = completion.claim
        try:
            return completion.build_row()
        except Exception as exc:  # the engine's host part or the scoring
            log.exception("job %s: its result could not be built; the job fails", claim.job_id)
            self._retrying(partial(ledger.fail_job, claim=claim, error=exc, final=True, max_attempts=claim.attempt))
            completion.written.set_result(False)
            return None

    def _retrying(self, write: Callable[[Session], T]) -> T | None:
        """`write` in a transaction, tried again through ledger outages until this closes; None when
        given up (closing in an outage, or another error: the job is swept once this process is gone)."""
        retrying = ledger_retrying(until=self._closing, sleep=self._pause)
        try:
            for attempt in retrying:
                with attempt, self._db.transaction() as session:
                    return write(session)
        except Exception:
            log.exception("a ledger write was given up")
        return None
