"""`dsocr run` and `dsocr resume`: a run recorded in the ledger and worked through in this process,
without a broker; a run with concurrency above 1 on the farm's batched engine (farm/job/batched.py).

Three calls, so that the caller can show the run before its work and the report after it:
`record_local_run` (the list checked, the run recorded; on the embedded SQLite default the schema is
created or updated first) or `resume_local_run` (a recorded run's jobs not final), `work_local_run`
(its jobs, here), and `raise_for_failures` once the report is out: a run whose jobs failed must not be
mistaken for a good one by a script. Interrupted, the process hands back the jobs it holds (farm/job/
process.py `close`) and `mark_interrupted` records the run as such until it is resumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

from sqlalchemy import select, update

from dsocr_workers.errors import FailuresError, InputError
from dsocr_workers.farm.devices import parse_devices
from dsocr_workers.farm.job.claims import BACK_IN_LINE, Outcome, Status
from dsocr_workers.farm.job.execute import execute_job, run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.retries import ledger_retrying
from dsocr_workers.farm.submit import RunRequest, SubmittedRun, prepare_run
from dsocr_workers.settings import Settings, check_queue_name
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, check_schema, open_database, upgrade
from dsocr_workers.store.models import FINAL_STATES, IN_PROCESS_QUEUE, Job, Run, utcnow
from dsocr_workers.store.runs import resolve_run

FAILURES_NAMED = 10  # failed jobs the error names one by one; the rest are counted


@dataclass(frozen=True)
class LocalRun:
    """A run recorded for this process to work through on `device` (`run.job_ids`: the jobs left to it)."""

    db: Database
    run: SubmittedRun
    device: str


def one_device(gpus: str) -> str:
    """The device `--gpus` names for a run in this process: auto (the first GPU, else the CPU), cpu or
    one GPU index."""
    several = InputError("dsocr run uses one device; start `dsocr worker` for several")
    if "," in gpus.strip(", "):  # said before whether those GPUs are here (parse_devices)
        raise several
    devices = parse_devices(gpus)
    if gpus.strip().lower() == "auto":  # a GPU machine profiles its GPU, as `dsocr infer` does
        devices = devices[:1]
    if len(devices) != 1:  # all on a host with several GPUs
        raise several
    return devices[0]


def _open_ledger(settings: Settings) -> Database:
    db = open_database(settings.database_url)
    if db.is_sqlite:
        upgrade(db)  # the embedded default creates or updates its own file
    check_schema(db)
    return db


def record_local_run(
    settings: Settings, request: RunRequest, *, gpus: str, queue: str | None, on_bad_lines: Callable[[str], None]
) -> LocalRun:
    """Check the list and record the run for one device (`one_device`). `queue` names a worker queue to
    record it under, so that its workers take over the jobs this process leaves behind if it dies; None:
    `IN_PROCESS_QUEUE`, which no worker reads."""
    device = one_device(gpus)
    prepared = prepare_run(request, on_bad_lines)
    db = _open_ledger(settings)
    run = prepared.record(db, check_queue_name(queue) if queue else IN_PROCESS_QUEUE)
    return LocalRun(db, run, device)


def resume_local_run(settings: Settings, run_ref: str, *, gpus: str) -> LocalRun:
    """The recorded run `run_ref` (id, unique prefix or latest) with its jobs not final, in line order, for
    this process on one device; no longer marked interrupted. A job a dead process still holds is taken
    over by its claim (farm/owners.py); one a live worker holds is refused."""
    device = one_device(gpus)
    db = _open_ledger(settings)
    with db.transaction() as tx:
        run = resolve_run(tx, run_ref)
        job_ids = list(
            tx.scalars(
                select(Job.id)
                .where(Job.run_id == run.id, Job.state.not_in(FINAL_STATES))
                .order_by(Job.line, Job.repeat)
            )
        )
        run.interrupted_at = None
        resumed = SubmittedRun(run.id, job_ids, run.queue)
    return LocalRun(db, resumed, device)


def work_local_run(settings: Settings, local: LocalRun, on_final: Callable[[Outcome], None]) -> list[Outcome]:
    """Every job of the run, here, until it is final (`run_in_process`, beating on the run's
    queue); `on_final` hears of each job's end. Returns the final outcomes."""

    def final_only(outcome: Outcome) -> None:
        if outcome.status not in BACK_IN_LINE:
            on_final(outcome)

    return run_in_process(settings, local.device, local.run.job_ids, final_only, queue=local.run.queue)


def mark_interrupted(local: LocalRun) -> Counter[str]:
    """Record the run as interrupted when jobs of it are not final (its process handed back those it
    held); returns its job counts by state."""
    with local.db.transaction() as tx:
        counts = ledger.job_counts(tx, local.run.run_id)
        if any(state not in FINAL_STATES for state in counts):
            tx.execute(update(Run).where(Run.id == local.run.run_id).values(interrupted_at=utcnow()))
    return counts


def raise_for_failures(local: LocalRun, finals: list[Outcome]) -> None:
    """FailuresError counting the jobs that did not end done, by final state, and naming the first
    `FAILURES_NAMED` by image; nothing when every job is done."""
    failures = [outcome for outcome in finals if outcome.status != "done"]
    if not failures:
        return
    with local.db.transaction() as tx:
        ids = [outcome.job_id for outcome in failures]
        images = dict(tx.execute(select(Job.id, Job.image).where(Job.id.in_(ids))).all())
    counts = ", ".join(f"{count} {status}" for status, count in Counter(o.status for o in failures).items())
    which = "; ".join(f"{images.get(o.job_id, o.job_id)}: {o.status} ({o.detail})" for o in failures[:FAILURES_NAMED])
    more = f"; and {len(failures) - FAILURES_NAMED} more" if len(failures) > FAILURES_NAMED else ""
    raise FailuresError(f"run {local.run.run_id}: {counts} of {len(local.run.job_ids)} jobs: {which}{more}")


def run_in_process(
    settings: Settings,
    device: str,
    job_ids: list[str],
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    max_transient_retries: int = 5,
    queue: str = IN_PROCESS_QUEUE,
) -> list[Outcome]:
    """Run jobs here, in line (`dsocr run`): one after the other, or a run with concurrency above 1 that
    many at a time in the batched engine, as a worker would. Failed attempts go to the back of the line
    until they are final; the ledger decides, exactly as for Celery workers. Each job's model is loaded
    and warmed before its claim (the first job's: before any claim). This process beats like a worker on
    `queue` (its run's), renewing its leases, but sweeps nothing: it has no broker to send messages to.
    Stopped before the line's end (Ctrl-C), it hands back the jobs it holds, their attempts not counted."""
    process = JobProcess.open(settings, device, queues=(queue,))
    finished = False
    try:
        finals = _run_line(process, settings, job_ids, on_outcome, max_transient_retries)
        finished = True
        return finals
    finally:
        process.close(hand_back=not finished)


def _run_line(
    process: JobProcess, settings: Settings, job_ids: list[str], on_outcome: Callable[[Outcome], None],
    max_transient_retries: int,
) -> list[Outcome]:  # fmt: skip
    line = list(job_ids)
    finals: list[Outcome] = []
    decoding: list[str] = []  # handed to the batched engine: their ends are read from the ledger

    def ended(outcome: Outcome) -> None:
        on_outcome(outcome)
        if outcome.status in BACK_IN_LINE:
            line.append(outcome.job_id)
        else:
            finals.append(outcome)

    while line:
        job_id = line.pop(0)
        retrying = ledger_retrying(attempts=max_transient_retries + 1)
        options = retrying(process.prepare_for, job_id)
        if options is not None and options.concurrency > 1:
            # The one claim path of the farm's batched jobs; with no next job in line, the batch runs to its end.
            outcome = retrying(run_in_batch, process, job_id, options, more_coming=bool(line))
        else:
            process.end_batch()
            # The next job of the line is known: its page is prepared while this one runs (farm/job/prefetch.py).
            upcoming = partial(ledger.waiting_job, job_id=line[0], owner=process.owner) if line else None
            infer = partial(process.infer, upcoming=upcoming)
            outcome = retrying(execute_job, process.db, job_id, owner=process.owner, settings=settings, infer=infer)
        if outcome.status == "decoding":
            decoding.append(job_id)
        else:
            ended(outcome)
        if decoding and not line:
            process.end_batch()  # every job in flight finished, or its failure recorded
            process.ledger_threads.wait()  # and the last result handed over written
        for batch_end in _batch_ends(process.db, decoding, all_over=not line):
            decoding.remove(batch_end.job_id)
            ended(batch_end)
    return finals


def _batch_ends(db: Database, decoding: list[str], *, all_over: bool) -> list[Outcome]:
    """The jobs of `decoding` that the ledger shows ended (done, failed, poisoned) or back in line (a
    failed batch's, queued again). `all_over`: the batch ended and its results were written, so a job
    still running lost its result (its write given up)."""
    if not decoding:
        return []
    with db.transaction() as tx:
        rows = tx.execute(
            select(Job.id, Job.state, Job.last_error_class, Job.last_error_message).where(Job.id.in_(decoding))
        ).all()
    ends = []
    for job_id, state, error_class, error in sorted(rows, key=lambda row: decoding.index(row.id)):
        detail = "" if state == "done" else f"{error_class}: {error}"
        if state in FINAL_STATES:
            ends.append(Outcome(job_id, cast(Status, state), detail))
        elif state in ledger.WAITING_STATES:
            ends.append(Outcome(job_id, "queued", detail))
        elif all_over:
            ends.append(Outcome(job_id, "lost", "its result was not written"))
    return ends
