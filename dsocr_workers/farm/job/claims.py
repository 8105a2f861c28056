"""The one claim path of a job, batch-1 or batched (`start_claim`), and what a claimed job's outcome
can be: refused, run, or failed and classified (InputError final, TransientError released without
counting an attempt, anything else counted). Nothing here knows about Celery: retries are returned as
`Outcome.retry_in_s` for the caller to schedule."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Literal

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.owners import owner_is_dead
from dsocr_workers.farm.retries import job_retry_in_s
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database

# "decoding": handed to the batched engine (farm/job/batched.py), its result written when it finishes.
Status = Literal[
    "done", "completing", "decoding", "failed", "queued", "poisoned", "refused", "released", "lost"
]
# Outcomes that put a job back in line (delivered or tried again later): not an end of the job.
BACK_IN_LINE: tuple[Status, ...] = ("queued", "released")


class Refused(Exception):
    """Raised by `Claiming.result()`: the job is not this process's to run."""

    def __init__(self, refusal: ledger.Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@dataclass(frozen=True)
class Claiming:
    """A job's claim, written or under way."""

    job_id: str
    claim: Future[ledger.Claim | ledger.Refusal]

    def result(self) -> ledger.Claim:
        """The claim, once written; raises Refused, or TransientError when the ledger is out of reach."""
        claim = self.claim.result()
        if isinstance(claim, ledger.Refusal):
            raise Refused(claim)
        return claim


@dataclass(frozen=True)
class Outcome:
    job_id: str
    status: Status
    detail: str = ""
    retry_in_s: float | None = None  # deliver the job again after this long


def start_claim(
    db: Database, job_id: str, *, owner: str, settings: Settings, ledger_threads: LedgerThreads | None = None
) -> Claiming:
    """The one way a job is claimed (batch-1 and batched): on the claims thread of `ledger_threads`,
    under way when this returns, or here without one (its TransientError then kept for `result()`)."""
    claim_job = partial(
        ledger.claim_job,
        job_id=job_id,
        owner=owner,
        lease_s=settings.lease_s,
        max_attempts=settings.max_attempts,
        is_dead=owner_is_dead,
    )
    if ledger_threads is not None:
        return Claiming(job_id, ledger_threads.claim(claim_job))
    done: Future[ledger.Claim | ledger.Refusal] = Future()
    try:
        with db.transaction() as tx:
            done.set_result(claim_job(tx))
    except TransientError as exc:
        done.set_exception(exc)
    return Claiming(job_id, done)


def refused(refusal: ledger.Refusal) -> Outcome:
    """A job whose claim was refused: delivered again once the refusal's wait is over, if it says one."""
    later = None if refusal.retry_after_s is None else refusal.retry_after_s + 1
    return Outcome(refusal.job_id, "refused", refusal.reason, later)


def job_failed(db: Database, claim: ledger.Claim, exc: Exception, settings: Settings) -> Outcome:
    """A claimed job whose inference raised `exc`, recorded: an InputError is final, a TransientError
    releases the job (tried again later), anything else (a model bug, CUDA OOM, a soft time limit)
    counts an attempt."""
    if isinstance(exc, InputError):
        return _record_failure(db, claim, exc, final=True, settings=settings)
    if isinstance(exc, TransientError):
        with db.transaction() as tx:
            ledger.release_job(tx, claim, exc)
        return Outcome(claim.job_id, "released", str(exc), job_retry_in_s(claim.attempt, settings))
    return _record_failure(db, claim, exc, final=False, settings=settings)


def _record_failure(
    db: Database, claim: ledger.Claim, exc: Exception, *, final: bool, settings: Settings
) -> Outcome:
    with db.transaction() as tx:
        state = ledger.fail_job(tx, claim, exc, final=final, max_attempts=settings.max_attempts)
    detail = f"{type(exc).__name__}: {exc}"
    if state is None:
        return Outcome(claim.job_id, "lost", detail)
    retry = job_retry_in_s(claim.attempt, settings) if state == "queued" else None
    return Outcome(claim.job_id, state, detail, retry)  # type: ignore[arg-type]
