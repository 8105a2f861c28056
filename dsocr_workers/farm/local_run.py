"""`dsocr run`: a run recorded in the ledger and worked through in this process, without a broker.

Three calls, so that the caller can show the run before its work and the report after it:
`record_local_run` (the list checked, the run recorded; on the embedded SQLite default the schema is
created or updated first), `work_local_run` (its jobs, here), and `raise_for_failures` once the report
is out: a run whose jobs failed must not be mistaken for a good one by a script.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from sqlalchemy import select

from dsocr_workers.errors import FailuresError, InputError
from dsocr_workers.farm.devices import parse_devices
from dsocr_workers.farm.job.claims import BACK_IN_LINE, Outcome
from dsocr_workers.farm.job.execute import execute_job
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.retries import ledger_retrying
from dsocr_workers.farm.submit import RunRequest, SubmittedRun, prepare_run
from dsocr_workers.settings import Settings, check_queue_name
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, check_schema, open_database, upgrade
from dsocr_workers.store.models import IN_PROCESS_QUEUE, Job

FAILURES_NAMED = 10  # failed jobs the error names one by one; the rest are counted


@dataclass(frozen=True)
class LocalRun:
    """A run recorded for this process to work through on `device`."""

    db: Database
    run: SubmittedRun
    device: str


def record_local_run(
    settings: Settings, request: RunRequest, *, gpus: str, queue: str | None, on_bad_lines: Callable[[str], None]
) -> LocalRun:
    """Check the list and record the run for one device (`gpus`: auto — the first GPU, else the CPU —,
    cpu or one GPU index). `queue` names a
    worker queue to record it under, so that its workers take over the jobs this process leaves behind
    if it dies; None: `IN_PROCESS_QUEUE`, which no worker reads."""
    several = InputError("dsocr run uses one device; start `dsocr worker` for several")
    if request.options.concurrency > 1:
        raise InputError("dsocr run runs one job at a time; --concurrency above 1 needs workers (`dsocr submit`)")
    if "," in gpus.strip(", "):  # said before whether those GPUs are here (parse_devices)
        raise several
    devices = parse_devices(gpus)
    if gpus.strip().lower() == "auto":  # a GPU machine profiles its GPU, as `dsocr infer` does
        devices = devices[:1]
    if len(devices) != 1:  # all on a host with several GPUs
        raise several
    prepared = prepare_run(request, on_bad_lines)
    db = open_database(settings.database_url)
    if db.is_sqlite:
        upgrade(db)  # the embedded default creates or updates its own file
    check_schema(db)
    run = prepared.record(db, check_queue_name(queue) if queue else IN_PROCESS_QUEUE)
    return LocalRun(db, run, devices[0])


def work_local_run(settings: Settings, local: LocalRun, on_final: Callable[[Outcome], None]) -> list[Outcome]:
    """Every job of the run, here, until it is final (`run_in_process`, beating on the run's
    queue); `on_final` hears of each job's end. Returns the final outcomes."""

    def final_only(outcome: Outcome) -> None:
        if outcome.status not in BACK_IN_LINE:
            on_final(outcome)

    return run_in_process(settings, local.device, local.run.job_ids, final_only, queue=local.run.queue)


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
    """Run jobs here, one after the other (`dsocr run`). Failed attempts go to the back of the line until
    they are final; the ledger decides, exactly as for Celery workers. Each job's model is loaded and
    warmed before its claim (the first job's: before any claim). This process beats like a worker on
    `queue` (its run's), renewing its leases, but sweeps nothing: it has no broker to send messages to."""
    process = JobProcess.open(settings, device, queues=(queue,))
    try:
        return _run_line(process, settings, job_ids, on_outcome, max_transient_retries)
    finally:
        process.close()


def _run_line(
    process: JobProcess, settings: Settings, job_ids: list[str], on_outcome: Callable[[Outcome], None],
    max_transient_retries: int,
) -> list[Outcome]:  # fmt: skip
    line = list(job_ids)
    finals: list[Outcome] = []
    while line:
        job_id = line.pop(0)
        process.prepare_for(job_id)
        # The next job of the line is known: its page is prepared while this one runs (farm/job/prefetch.py).
        upcoming = partial(ledger.waiting_job, job_id=line[0], owner=process.owner) if line else None
        infer = partial(process.infer, upcoming=upcoming)
        outcome = ledger_retrying(attempts=max_transient_retries + 1)(
            execute_job, process.db, job_id, owner=process.owner, settings=settings, infer=infer
        )
        on_outcome(outcome)
        if outcome.status in BACK_IN_LINE:
            line.append(job_id)
        else:
            finals.append(outcome)
    return finals
