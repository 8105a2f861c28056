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

from sqlalchemy import select

from dsocr_workers.errors import FailuresError, InputError
from dsocr_workers.farm.execute import BACK_IN_LINE, Outcome
from dsocr_workers.farm.submit import RunRequest, SubmittedRun, prepare_run
from dsocr_workers.farm.worker import IN_PROCESS_QUEUE, parse_devices, run_in_process
from dsocr_workers.settings import Settings, check_queue_name
from dsocr_workers.store.db import Database, check_schema, open_database, upgrade
from dsocr_workers.store.models import Job

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
    """Check the list and record the run for one device (`gpus`: cpu or one GPU index). `queue` names a
    worker queue to record it under, so that its workers take over the jobs this process leaves behind
    if it dies; None: `IN_PROCESS_QUEUE`, which no worker reads."""
    devices = parse_devices(gpus)
    if len(devices) != 1:
        raise InputError("dsocr run uses one device; start `dsocr worker` for several")
    prepared = prepare_run(request, on_bad_lines)
    db = open_database(settings.database_url)
    if db.is_sqlite:
        upgrade(db)  # the embedded default creates or updates its own file
    check_schema(db)
    run = prepared.record(db, check_queue_name(queue) if queue else IN_PROCESS_QUEUE)
    return LocalRun(db, run, devices[0])


def work_local_run(settings: Settings, local: LocalRun, on_final: Callable[[Outcome], None]) -> list[Outcome]:
    """Every job of the run, here, until it is final (`worker.run_in_process`, beating on the run's
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
    with local.db.transaction() as session:
        ids = [outcome.job_id for outcome in failures]
        images = dict(session.execute(select(Job.id, Job.image).where(Job.id.in_(ids))).all())
    counts = ", ".join(f"{count} {status}" for status, count in Counter(o.status for o in failures).items())
    which = "; ".join(f"{images.get(o.job_id, o.job_id)}: {o.status} ({o.detail})" for o in failures[:FAILURES_NAMED])
    more = f"; and {len(failures) - FAILURES_NAMED} more" if len(failures) > FAILURES_NAMED else ""
    raise FailuresError(f"run {local.run.run_id}: {counts} of {len(local.run.job_ids)} jobs: {which}{more}")
