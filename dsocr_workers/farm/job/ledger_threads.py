"""A Celery child's ledger writes on threads of their own, off the path between two jobs.

- The claim (`claim`), on the claims thread: a prefetched job runs on the device while its claim is
  written, and waits for it before its readback; a refused claim drops what ran.
- Results (`complete`) and a batched engine's steps (`record_steps`), on the results thread: a row is
  built (the engine's host part, `DeviceRun.finish`, included) and written while the next message is
  handed over; what is handed over while the thread is busy is written in one transaction (`Pending`).
  A row that cannot be built fails its job. Two threads: a claim never waits behind a result's write.
- `hold` / `let_claims_go` / `release`: while a batch-1 job's setup and prefill, or a batched step's
  prefills, are launched, neither thread starts a claim or a write (one under way finishes): their
  Python would hold the GIL the launches wait for, and on a GPU the stages' CUDA events would time the
  wait. They start once the prefills are queued, while the device runs them; a hold lasts HOLD_LIMIT_S
  at most (a CPU's prefill may be longer). A batch-1 job with a next job known holds them from its end.
  The next job's claim goes once that job's prefill is queued (`let_claims_go`), and the held result's
  row is built then; that row and the reservation its lane made as the next job started
  (`wait_while_held`) are written once the claim is, so that no write contends with the claim the job
  waits for before its readback. On a CPU nothing is held (`holds`): its launches are the work itself,
  and a row held there would count the next job's whole prefill in its job's end-to-end time.
- A ledger outage: a claim fails at once (the task retries); a write is tried again until it goes
  through or the process closes. A write given up lets its job's lease run out (`Heartbeat.let_go`), so
  a sweep puts the job back in line, as after a crash; a late write finds the lease gone and writes nothing.
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

# The longest a held thread waits: past it, a claim or write goes ahead whatever is being launched.
HOLD_LIMIT_S = 1.0


@dataclass
class Completion:
    """A result handed over, and what became of its write."""

    claim: ledger.Claim
    build_row: Callable[[], dict[str, Any]]
    finished_at: datetime
    written: Future[bool] = field(default_factory=Future)


StepRows = Callable[[], list[dict[str, Any]]]  # a batched engine's steps as `batch_steps` rows, built late
Handed = Completion | StepRows  # what the results thread writes


@dataclass
class BuiltRows:
    """Rows built from what was handed over, to be written together."""

    results: list[tuple[Completion, dict[str, Any]]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    unbuilt: list[tuple[Completion, Exception]] = field(default_factory=list)  # those jobs fail


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

    def __init__(
        self, db: Database, let_go: Callable[[str], None] = lambda job_id: None, *, holds: bool = True
    ) -> None:
        self._db = db
        self._let_go = let_go  # a job whose result was given up: its lease is no longer renewed
        self.holds = holds  # whether `hold` holds: launches on an asynchronous device (a GPU)
        self._closing = threading.Event()
        self._claims_open = threading.Event()  # cleared by `hold`: no claim starts
        self._claims_open.set()
        self._writes_open = threading.Event()  # cleared by `hold`: no write or reservation starts
        self._writes_open.set()
        self._claims = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-claims")
        self._results = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-results")
        self._pending = Pending()
        self._last_write: Future[bool] | None = None

    def claim(
        self, claim_job: Callable[[Session], ledger.Claim | ledger.Refusal]
    ) -> Future[ledger.Claim | ledger.Refusal]:
        """`claim_job` in a transaction of its own: its Claim or Refusal, or its TransientError."""
        return self._claims.submit(self._claim, claim_job)

    def complete(
        self, claim: ledger.Claim, build_row: Callable[[], dict[str, Any]], finished_at: datetime
    ) -> None:
        """Mark `claim`'s job done with the result `build_row()` makes, after this call returns."""
        completion = Completion(claim, build_row, finished_at)
        self._last_write = completion.written
        self._hand_over(completion)

    def record_steps(self, build_rows: StepRows) -> None:
        """Insert the `batch_steps` rows `build_rows()` makes, after this call returns."""
        self._hand_over(build_rows)

    def hold(self) -> None:
        """Start no claim, write or reservation until `release` (claims: `let_claims_go`), or HOLD_LIMIT_S:
        the caller launches device work that a wait for the GIL would stretch."""
        if not self.holds:
            return
        self._claims_open.clear()
        self._writes_open.clear()

    def let_claims_go(self) -> None:
        """Let claims start; writes and reservations stay held until `release`."""
        self._claims_open.set()

    def release(self) -> None:
        self._claims_open.set()
        self._writes_open.set()

    def wait_while_held(self) -> None:
        """For a ledger write on another thread (a reservation): wait while held, HOLD_LIMIT_S at most."""
        self._writes_open.wait(HOLD_LIMIT_S)

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

    def _claim(
        self, claim_job: Callable[[Session], ledger.Claim | ledger.Refusal]
    ) -> ledger.Claim | ledger.Refusal:
        self._claims_open.wait(HOLD_LIMIT_S)
        with self._db.transaction() as tx:
            return claim_job(tx)

    def _pause(self, seconds: float) -> None:
        self._closing.wait(seconds)  # cut short by close()

    def _write_pending(self) -> None:
        """Every result and step handed over so far: their rows built once the launches are queued, then
        written in one transaction once no claim is waited for."""
        self._claims_open.wait(HOLD_LIMIT_S)
        items = self._pending.take()
        try:
            rows = self._build(items)
            self._writes_open.wait(HOLD_LIMIT_S)
            self._write(rows)
        except Exception:  # a bug here: the jobs' leases run out and a sweep puts them back in line
            log.exception("results that could not be written")
            for item in items:
                if isinstance(item, Completion) and not item.written.done():
                    self._let_go(item.claim.job_id)
                    item.written.set_result(False)

    def _build(self, items: list[Handed]) -> BuiltRows:
        rows = BuiltRows()
        for item in items:
            if isinstance(item, Completion):
                try:
                    rows.results.append((item, item.build_row()))
                except Exception as exc:  # the engine's host part or the scoring
                    log.exception("job %s: its result could not be built; the job fails", item.claim.job_id)
                    rows.unbuilt.append((item, exc))
            else:
                try:
                    rows.steps += item()
                except Exception:  # a bug, the same on every attempt: the steps are lost, the jobs are not
                    log.exception("batch steps that could not be made into rows; not written")
        return rows

    def _write(self, rows: BuiltRows) -> None:
        for completion, exc in rows.unbuilt:  # a bug, the same on every attempt: the job fails
            claim = completion.claim
            self._retrying(partial(ledger.fail_job, claim=claim, error=exc, final=True, max_attempts=claim.attempt))
            completion.written.set_result(False)
        built, steps = rows.results, rows.steps

        def write(tx: Session) -> list[bool]:
            ledger.record_batch_steps(tx, steps)
            return [ledger.complete_job(tx, c.claim, row, now=c.finished_at) for c, row in built]

        outcomes = self._retrying(write) if built or steps else []
        if outcomes is None and steps:
            log.warning("%d batch steps were given up; the run's report lacks them", len(steps))
        for index, (completion, _) in enumerate(built):
            written = None if outcomes is None else outcomes[index]
            job_id = completion.claim.job_id
            if written:
                log.info("job %s: done", job_id)
            elif written is not None:
                log.warning(
                    "job %s: lost: the lease was taken over before the result was written; discarded", job_id
                )
            else:
                self._let_go(job_id)
                log.warning(
                    "job %s: its result was given up; its lease is let run out and a sweep puts it back "
                    "in line",
                    job_id,
                )
            completion.written.set_result(bool(written))

    def _retrying(self, write: Callable[[Session], T]) -> T | None:
        """`write` in a transaction, tried again through ledger outages until this closes; None when
        given up (closing in an outage, or another error: the job is swept once this process is gone)."""
        retrying = ledger_retrying(until=self._closing, sleep=self._pause)
        try:
            for attempt in retrying:
                with attempt, self._db.transaction() as tx:
                    return write(tx)
        except Exception:
            log.exception("a ledger write was given up")
        return None
