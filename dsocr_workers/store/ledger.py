"""The job ledger's state changes: claim with a lease, complete with the result, record a failure, and
reconcile. Each function runs inside the caller's transaction (`Database.transaction()`).

    pending ──enqueue──► queued ──claim──► running ──complete──► done
                           ▲                  │ ├──input error──► failed
                           └──error < cap─────┘ └──error at cap─► poisoned
    running with an expired lease (or an owner the caller's probe finds dead) may be claimed again: that
    is a new attempt; a job whose attempts reached the cap is poisoned instead of claimed.

Every change to a running job is guarded by its lease owner, so a worker that lost its lease can never
write over the new owner's. A waiting job may be reserved (`reserve_job`) by the process that fetched its
message to run next; a claim ignores and clears it, and the sweep brings back the message of a job whose
reservation ran out (its worker is dead) rather than waiting out the broker's visibility timeout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, func, insert, select, true, update
from sqlalchemy.orm import Session

from dsocr_workers.store.models import (
    FINAL_STATES,
    BatchStep,
    Job,
    JobAttempt,
    Profile,
    Result,
    Run,
    WorkerProcess,
    utcnow,
)
from dsocr_workers.store.upsert import upsert

MAX_ERROR_MESSAGE = 4000
WAITING_STATES = ("pending", "queued")  # waiting for a worker: not running, not final
# A profiled job's result, and a sampled batch step's row, carry their `profiles` row (less its ids) under
# this key: `complete_job` and `record_batch_steps` write both in one transaction.
PROFILE = "profile"
UNRESERVED: dict[str, Any] = {"reserved_by": None, "reserved_until": None}


@dataclass(frozen=True)
class Claim:
    """A job this process may run now, until `lease_expires_at`."""

    job_id: str
    run_id: str
    image: str
    image_path: Path
    repeat: int
    attempt: int
    owner: str
    lease_expires_at: datetime
    model: str
    parameters: dict[str, Any]
    reference: dict[str, Any] | None = None  # the page's ground truth (jobs.reference), if any
    profile: bool = False  # run it under torch.profiler (jobs.profile)


@dataclass(frozen=True)
class Refusal:
    """Why a delivery of a job is not run. `retry_after_s` is set while another live worker holds it."""

    job_id: str
    reason: str
    state: str | None
    retry_after_s: float | None = None


def _rowcount(result: Any) -> int:
    """Rows an UPDATE matched (SQLAlchemy types `execute` as Result; an UPDATE returns a CursorResult)."""
    return cast(CursorResult[Any], result).rowcount


# --- claim / complete / fail ----------------------------------------------------------------------


def claim_job(
    tx: Session,
    job_id: str,
    owner: str,
    *,
    lease_s: float,
    max_attempts: int,
    is_dead: Callable[[str], bool],
    now: datetime | None = None,
    again: bool = True,
) -> Claim | Refusal:
    """Claim `job_id` for `owner` under a lease of `lease_s`. A job running under another owner's live
    lease is refused, unless `is_dead(that owner)` says its process is gone (the farm's probe,
    farm/owners.py): then it is taken over at once as a new attempt. `again`: a job found waiting
    after the claim's guard missed is claimed once more (below)."""
    now = now or utcnow()
    # The columns the claim reads, not the ORM objects: loading two entities into the session (and
    # flushing it at commit) is host time between one job's end and the next one's start on the device.
    job = tx.execute(
        select(
            Job.state,
            Job.lease_owner,
            Job.lease_expires_at,
            Job.attempts,
            Job.image,
            Job.repeat,
            Job.reference,
            Job.profile,
            Run.id.label("run_id"),
            Run.root,
            Run.model,
            Run.parameters,
        )
        .join(Run, Job.run_id == Run.id)
        .where(Job.id == job_id)
    ).one_or_none()
    if job is None:
        return Refusal(job_id, "unknown job", None)
    if job.state in FINAL_STATES:
        return Refusal(job_id, f"already {job.state}", job.state)

    previous_owner = job.lease_owner
    continuing = job.state == "running" and previous_owner == owner
    interrupted = job.state == "running" and not continuing
    if interrupted:
        expires = job.lease_expires_at
        gone = previous_owner is None or is_dead(previous_owner)
        if expires is not None and expires > now and not gone:
            return Refusal(
                job_id,
                f"running under a live lease of {previous_owner}",
                job.state,
                (expires - now).total_seconds(),
            )

    # Optimistic guard: the row must still be exactly what was read, or another worker got there first.
    # `pending` and `queued` are one state here: submit marks a job queued just after sending its message,
    # so a worker can read it pending and find it queued at its UPDATE; refusing would drop its only message.
    unchanged = (
        (Job.id == job_id)
        & (Job.state.in_(WAITING_STATES) if job.state in WAITING_STATES else Job.state == job.state)
        & (Job.attempts == job.attempts)
        & Job.lease_owner.is_not_distinct_from(previous_owner)
    )
    lost = (
        {
            "last_error_class": "WorkerLost",
            "last_error_message": f"attempt {job.attempts} by {previous_owner} did not finish "
            "(its worker died or its lease expired)",
        }
        if interrupted
        else {}
    )
    if not continuing and job.attempts >= max_attempts:
        tx.execute(
            update(Job)
            .where(unchanged)
            .values(
                state="poisoned",
                lease_owner=None,
                lease_expires_at=None,
                finished_at=now,
                **UNRESERVED,
                **lost,
            )
        )
        return Refusal(job_id, f"poisoned after {job.attempts} attempts", "poisoned")

    attempt = job.attempts if continuing else job.attempts + 1
    lease_expires_at = now + timedelta(seconds=lease_s)
    changed = tx.execute(
        update(Job)
        .where(unchanged)
        .values(
            state="running",
            attempts=attempt,
            lease_owner=owner,
            lease_expires_at=lease_expires_at,
            started_at=now,
            **UNRESERVED,
            **lost,
        )
    )
    if _rowcount(changed) != 1:
        # A sweep that took the job back sends its message before it commits, so this delivery can read the
        # job still running and meet it queued at the UPDATE; refusing would drop its only message.
        if again and tx.scalar(select(Job.state).where(Job.id == job_id)) in WAITING_STATES:
            return claim_job(
                tx,
                job_id,
                owner,
                lease_s=lease_s,
                max_attempts=max_attempts,
                is_dead=is_dead,
                now=now,
                again=False,
            )
        return Refusal(job_id, "claimed concurrently by another worker", None)
    if not continuing:  # who held it, kept past a takeover (the job's row names only its latest holder)
        tx.execute(
            insert(JobAttempt).values(
                job_id=job_id, run_id=job.run_id, attempt=attempt, owner=owner, claimed_at=now
            )
        )
    return Claim(
        job_id=job_id,
        run_id=job.run_id,
        image=job.image,
        image_path=Path(job.root) / job.image,
        repeat=job.repeat,
        attempt=attempt,
        owner=owner,
        lease_expires_at=lease_expires_at,
        model=job.model,
        parameters=dict(job.parameters),
        reference=job.reference,
        profile=job.profile,
    )


def _held(claim: Claim) -> Any:
    return (Job.id == claim.job_id) & (Job.state == "running") & (Job.lease_owner == claim.owner)


def complete_job(tx: Session, claim: Claim, result: dict[str, Any], now: datetime | None = None) -> bool:
    """Mark the job done and upsert its result (and a profiled job's profile, `PROFILE`), all or none.
    False (nothing written) when the claim's lease was lost to another worker."""
    changed = tx.execute(
        update(Job)
        .where(_held(claim))
        .values(state="done", lease_owner=None, lease_expires_at=None, finished_at=now or utcnow())
    )
    if _rowcount(changed) != 1:
        return False
    columns = dict(result)
    profile = columns.pop(PROFILE, None)
    upsert(tx, Result, {**columns, "job_id": claim.job_id, "run_id": claim.run_id}, ["job_id"])
    if profile is not None:
        upsert(tx, Profile, {**profile, "job_id": claim.job_id, "run_id": claim.run_id}, ["job_id"])
    return True


def record_batch_steps(tx: Session, steps: Sequence[dict[str, Any]]) -> int:
    """Insert a batched engine's steps (`batch_steps` rows, farm/job/batched.py), in one statement, and a
    sampled step (`PROFILE`) with its profile; returns how many. No lease guards them: a step ran on the
    device whoever holds its jobs now."""
    plain = [step for step in steps if PROFILE not in step]
    if plain:
        # NULLs rendered: every row then has the same columns and all go in one statement. Without, the
        # ORM's bulk insert leaves a None out, and starts a statement at each switch of prefill and decode.
        tx.execute(insert(BatchStep).execution_options(render_nulls=True), plain)
    for step in steps:
        if PROFILE in step:
            columns = dict(step)
            profile = columns.pop(PROFILE)
            step_id = tx.scalar(insert(BatchStep).values(columns).returning(BatchStep.id))
            tx.execute(
                insert(Profile).values({**profile, "run_id": columns["run_id"], "batch_step_id": step_id})
            )
    return len(steps)


def fail_job(
    tx: Session,
    claim: Claim,
    error: BaseException,
    *,
    final: bool,
    max_attempts: int,
    now: datetime | None = None,
) -> str | None:
    """Record a failed attempt: `failed` when final (input errors), `poisoned` at the attempt cap, else
    back to `queued` for another attempt. Returns the new state, None when the lease was lost."""
    now = now or utcnow()
    state = "failed" if final else "poisoned" if claim.attempt >= max_attempts else "queued"
    changed = tx.execute(
        update(Job)
        .where(_held(claim))
        .values(
            state=state,
            lease_owner=None,
            lease_expires_at=None,
            last_error_class=type(error).__name__,
            last_error_message=str(error)[:MAX_ERROR_MESSAGE],
            finished_at=now if state in FINAL_STATES else None,
            queued_at=now if state == "queued" else Job.queued_at,
        )
    )
    return state if _rowcount(changed) == 1 else None


def release_job(tx: Session, claim: Claim, error: BaseException, now: datetime | None = None) -> bool:
    """Give the job back without counting the attempt (a transient failure: database, broker)."""
    changed = tx.execute(
        update(Job)
        .where(_held(claim))
        .values(
            state="queued",
            attempts=Job.attempts - 1,
            lease_owner=None,
            lease_expires_at=None,
            last_error_class=type(error).__name__,
            last_error_message=str(error)[:MAX_ERROR_MESSAGE],
            queued_at=now or utcnow(),
        )
    )
    return _rowcount(changed) == 1


def release_held(tx: Session, owner: str, now: datetime | None = None) -> list[str]:
    """Every job `owner` holds back to `queued`, its attempt not counted: the process stops before it
    could finish them (`dsocr run` interrupted). Returns their ids."""
    held = (Job.state == "running") & (Job.lease_owner == owner)
    job_ids = list(tx.scalars(select(Job.id).where(held)))
    tx.execute(
        update(Job)
        .where(held)
        .values(
            state="queued",
            attempts=Job.attempts - 1,
            lease_owner=None,
            lease_expires_at=None,
            last_error_class="Interrupted",
            last_error_message=f"the attempt by {owner} stopped before it finished (its process was interrupted); "
            "not counted",
            queued_at=now or utcnow(),
        )
    )
    return job_ids


def record_timeout(
    tx: Session,
    job_id: str,
    owner_prefix: str,
    limit_s: float,
    *,
    max_attempts: int,
    now: datetime | None = None,
) -> tuple[str, str] | None:
    """Record, for the worker's parent, that the process holding `job_id` (its lease owner starts with
    `owner_prefix`) is being killed at the hard time limit: the attempt counts as a `TimeLimitExceeded`.
    Returns (new state, the run's queue); None when that process no longer holds the job."""
    now = now or utcnow()
    owned = Job.lease_owner.startswith(owner_prefix, autoescape=True)
    held = (Job.id == job_id) & (Job.state == "running") & owned
    row = tx.execute(
        select(Job.attempts, Run.queue).join(Run, Job.run_id == Run.id).where(held)
    ).one_or_none()
    if row is None:
        return None
    attempts, queue = row
    state = "poisoned" if attempts >= max_attempts else "queued"
    changed = tx.execute(
        update(Job)
        .where(held & (Job.attempts == attempts))
        .values(
            state=state,
            lease_owner=None,
            lease_expires_at=None,
            last_error_class="TimeLimitExceeded",
            last_error_message=f"attempt {attempts} was killed at the hard time limit of {limit_s:g} s",
            finished_at=now if state in FINAL_STATES else None,
            queued_at=now if state == "queued" else Job.queued_at,
        )
    )
    return (state, queue) if _rowcount(changed) == 1 else None


def job_state(tx: Session, job_id: str) -> str | None:
    """The job's state; None for no such job."""
    return tx.scalar(select(Job.state).where(Job.id == job_id))


# --- enqueue bookkeeping and reconcile ------------------------------------------------------------


def mark_queued(tx: Session, job_ids: Iterable[str], now: datetime | None = None) -> None:
    """pending → queued for jobs whose message is now in the broker. A job a worker claimed before its
    batch was marked keeps its state and gets the time too: without it, throughput would count its wait
    from the row's creation, the submit's own work included (report/throughput.py `waiting_since`)."""
    now = now or utcnow()
    ids = list(job_ids)
    for start in range(0, len(ids), 500):
        batch = ids[start : start + 500]
        tx.execute(
            update(Job).where(Job.id.in_(batch), Job.state == "pending").values(state="queued", queued_at=now)
        )
        tx.execute(update(Job).where(Job.id.in_(batch), Job.queued_at.is_(None)).values(queued_at=now))


def renew_leases(
    tx: Session, owner: str, lease_s: float, now: datetime | None = None, let_go: Iterable[str] = ()
) -> int:
    """Extend every lease `owner` holds but those of the jobs in `let_go` (ones it can no longer finish),
    and its reservation, to `lease_s` from now (its heartbeat). Returns how many leases."""
    now = now or utcnow()
    until = now + timedelta(seconds=lease_s)
    held = (Job.state == "running") & (Job.lease_owner == owner)
    if dropped := list(let_go):
        held &= Job.id.not_in(dropped)
    tx.execute(
        update(Job)
        .where(Job.reserved_by == owner, Job.state.in_(WAITING_STATES))
        .values(reserved_until=until)
    )
    return _rowcount(tx.execute(update(Job).where(held).values(lease_expires_at=until)))


@dataclass(frozen=True)
class ExpiredLeases:
    requeued: list[tuple[str, str]]  # (job id, queue): its holder stopped renewing; queued again here
    poisoned: list[str]  # the same at the attempt cap: poisoned instead
    # (job id, queue): waiting, its reservation ran out: its message sits with a worker that stopped beating
    unreserved: list[tuple[str, str]] = field(default_factory=list)

    @property
    def to_bring_back(self) -> list[tuple[str, str]]:
        """The jobs whose messages a dead worker holds: every one to be put back in its queue."""
        return self.requeued + self.unreserved


def expire_leases(
    tx: Session,
    *,
    max_attempts: int,
    now: datetime | None = None,
    run_id: str | None = None,
    queues: Iterable[str] | None = None,
    spare_owner: str | None = None,
) -> ExpiredLeases:
    """Take back every running job whose lease expired (in one run, or in runs on `queues`), but
    `spare_owner`'s own: `queued` again, or `poisoned` at the cap; waiting jobs whose reservation expired
    lose it. Guarded on what was read, so of several sweepers exactly one reports (and re-sends) each job."""
    now = now or utcnow()
    stale = (Job.state == "running") & (Job.lease_expires_at <= now)
    if run_id is not None:
        stale &= Job.run_id == run_id
    if queues is not None:
        stale &= Run.queue.in_(list(queues))
    if spare_owner is not None:
        stale &= Job.lease_owner != spare_owner
    rows = tx.execute(
        select(Job.id, Job.attempts, Job.lease_owner, Run.queue).join(Run, Job.run_id == Run.id).where(stale)
    ).all()
    requeued, poisoned = [], []
    for job_id, attempts, owner, queue in rows:
        unchanged = (
            (Job.id == job_id)
            & (Job.state == "running")
            & (Job.attempts == attempts)
            & Job.lease_owner.is_not_distinct_from(owner)
            & (Job.lease_expires_at <= now)
        )
        lost = {
            "lease_owner": None,
            "lease_expires_at": None,
            "last_error_class": "LeaseExpired",
            "last_error_message": f"attempt {attempts} by {owner} did not finish: its worker stopped renewing "
            "the lease (killed, frozen or cut off)",
        }
        at_cap = attempts >= max_attempts
        values = (
            {"state": "poisoned", "finished_at": now} if at_cap else {"state": "queued", "queued_at": now}
        )
        if _rowcount(tx.execute(update(Job).where(unchanged).values(**values, **lost))) != 1:
            continue
        if at_cap:
            poisoned.append(job_id)
        else:
            requeued.append((job_id, queue))
    return ExpiredLeases(requeued, poisoned, _expire_reservations(tx, now, run_id, queues, spare_owner))


def _expire_reservations(
    tx: Session, now: datetime, run_id: str | None, queues: Iterable[str] | None, spare_owner: str | None
) -> list[tuple[str, str]]:
    stale = Job.state.in_(WAITING_STATES) & (Job.reserved_until <= now)
    if run_id is not None:
        stale &= Job.run_id == run_id
    if queues is not None:
        stale &= Run.queue.in_(list(queues))
    if spare_owner is not None:
        stale &= Job.reserved_by != spare_owner
    rows = tx.execute(
        select(Job.id, Job.reserved_by, Run.queue).join(Run, Job.run_id == Run.id).where(stale)
    ).all()
    unreserved = []
    for job_id, owner, queue in rows:
        unchanged = (
            (Job.id == job_id)
            & Job.state.in_(WAITING_STATES)
            & (Job.reserved_by == owner)
            & (Job.reserved_until <= now)
        )
        if _rowcount(tx.execute(update(Job).where(unchanged).values(**UNRESERVED))) == 1:
            unreserved.append((job_id, queue))
    return unreserved


def waiting_on_queues(tx: Session, job_ids: Iterable[str]) -> list[tuple[str, str]]:
    """(job id, its run's queue) for those of `job_ids` waiting for a worker."""
    ids = list(job_ids)
    return [
        (job_id, queue)
        for start in range(0, len(ids), 500)
        for job_id, queue in tx.execute(
            select(Job.id, Run.queue)
            .join(Run, Job.run_id == Run.id)
            .where(Job.id.in_(ids[start : start + 500]), Job.state.in_(WAITING_STATES))
        )
    ]


def find_dead_processes(
    tx: Session, queues: Iterable[str], *, silent_for_s: float, now: datetime | None = None
) -> set[str]:
    """Mark as found dead every process serving any of `queues` that has not beaten for `silent_for_s`
    and never stopped cleanly; returns the queues they served. Guarded on what was read, so of several
    sweepers exactly one finds each."""
    now = now or utcnow()
    silent = (
        WorkerProcess.stopped_at.is_(None)
        & WorkerProcess.found_dead_at.is_(None)
        & (WorkerProcess.heartbeat_at <= now - timedelta(seconds=silent_for_s))
    )
    swept = set(queues)
    found: set[str] = set()
    for process_id, served in tx.execute(select(WorkerProcess.id, WorkerProcess.queues).where(silent)).all():
        theirs = set(served.split(","))
        if not theirs & swept:
            continue
        guarded = update(WorkerProcess).where(WorkerProcess.id == process_id, silent).values(found_dead_at=now)
        if _rowcount(tx.execute(guarded)) == 1:
            found |= theirs
    return found


def queued_on(tx: Session, queues: Iterable[str]) -> list[tuple[str, str]]:
    """(job id, queue) of every job `queued` in a run on `queues`: its message was sent (a `pending` job's
    may not have been yet)."""
    return [
        (job_id, queue)
        for job_id, queue in tx.execute(
            select(Job.id, Run.queue)
            .join(Run, Job.run_id == Run.id)
            .where(Run.queue.in_(list(queues)), Job.state == "queued")
        )
    ]


def unattended(tx: Session, job_ids: Iterable[str], now: datetime | None = None) -> list[str]:
    """Of `job_ids` (jobs whose messages a worker has held for a while), the ones waiting with no live
    reservation: their worker died before its child could reserve or claim them (farm/liveness.py)."""
    now = now or utcnow()
    ids = list(job_ids)
    free = Job.reserved_by.is_(None) | (Job.reserved_until <= now)
    found: list[str] = []
    for start in range(0, len(ids), 500):
        batch = ids[start : start + 500]
        found += tx.scalars(select(Job.id).where(Job.id.in_(batch), Job.state.in_(WAITING_STATES), free))
    return found


@dataclass(frozen=True)
class ReconcilePlan:
    requeue: list[tuple[str, str]]  # (job id, queue) of every job that is neither final nor running
    expired: int  # running jobs whose lease had expired: queued again, or poisoned at the cap
    poisoned: int  # of those, the ones poisoned
    running: int  # jobs still running under a live lease (left alone)
    # the expired jobs queued again and those whose reservation expired: a dead worker holds their messages
    expired_ids: frozenset[str] = frozenset()


def reconcile(
    tx: Session, *, max_attempts: int, run_id: str | None = None, now: datetime | None = None
) -> ReconcilePlan:
    """Expire stale leases (poisoning jobs at the cap) and list every open job to enqueue again."""
    now = now or utcnow()
    expired = expire_leases(tx, max_attempts=max_attempts, now=now, run_id=run_id)
    in_run = (Job.run_id == run_id) if run_id else true()
    running = (
        tx.scalar(select(func.count()).select_from(Job).where(in_run & (Job.state == "running"))) or 0
    )
    requeue = tx.execute(
        select(Job.id, Run.queue)
        .join(Run, Job.run_id == Run.id)
        .where(in_run & Job.state.in_(WAITING_STATES))
        .order_by(Job.run_id, Job.line, Job.repeat)
    ).all()
    return ReconcilePlan(
        [(job_id, queue) for job_id, queue in requeue],
        len(expired.requeued) + len(expired.poisoned),
        len(expired.poisoned),
        running,
        frozenset(job_id for job_id, _ in expired.to_bring_back),
    )


def job_counts(tx: Session, run_id: str) -> Counter[str]:
    rows = tx.execute(select(Job.state, func.count()).where(Job.run_id == run_id).group_by(Job.state))
    return Counter({state: count for state, count in rows})


# --- what a job waiting for a worker needs, read without claiming it ------------------------------


@dataclass(frozen=True)
class WaitingJob:
    """A job not yet claimed (pending or queued), as a worker reads it to prepare its page ahead of its
    claim: reading it changes nothing, and another worker may still be the one to claim it."""

    job_id: str
    image_path: Path
    model: str
    parameters: dict[str, Any]
    profile: bool = False  # run it under torch.profiler (jobs.profile)


def _waiting(row: Any) -> WaitingJob:
    return WaitingJob(row.id, Path(row.root) / row.image, row.model, dict(row.parameters), row.profile)


def _waiting_columns() -> Any:
    return select(Job.id, Job.image, Job.profile, Run.root, Run.model, Run.parameters).join(
        Run, Job.run_id == Run.id
    )


def waiting_job(tx: Session, job_id: str, owner: str) -> WaitingJob | None:
    """`job_id` if it is waiting for a worker, or claimed by `owner` already (it may have claimed it
    before this read: its previous job failed at once); None if it is unknown, final or another's."""
    mine = (Job.state == "running") & (Job.lease_owner == owner)
    row = tx.execute(
        _waiting_columns().where(Job.id == job_id, Job.state.in_(WAITING_STATES) | mine)
    ).one_or_none()
    return None if row is None else _waiting(row)


def reserve_job(
    tx: Session, job_id: str, owner: str, *, lease_s: float, now: datetime | None = None
) -> None:
    """Reserve `job_id`, if it is waiting, for `owner` (its worker fetched the job's message to run next)
    until the latest lease `owner` holds runs out, or `lease_s` from now if it holds none; its reservations
    of jobs no longer waiting are given up here."""
    now = now or utcnow()
    tx.execute(
        update(Job).where(Job.reserved_by == owner, Job.state.not_in(WAITING_STATES)).values(**UNRESERVED)
    )
    # Ending with the holder's lease (each heartbeat renews both to one time), a dead holder's job and
    # the one it fetched next go back in the same sweep, both before the jobs queued behind them.
    held = tx.scalar(
        select(func.max(Job.lease_expires_at)).where(Job.lease_owner == owner, Job.state == "running")
    )
    until = held if held is not None and held > now else now + timedelta(seconds=lease_s)
    tx.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_(WAITING_STATES))
        .values(reserved_by=owner, reserved_until=until)
    )


def drop_reservations(tx: Session, owner: str) -> None:
    """`owner` stops cleanly: the messages of the jobs it reserved go back to the broker with its worker."""
    tx.execute(update(Job).where(Job.reserved_by == owner).values(**UNRESERVED))
