"""A run while it runs (`dsocr status`): its job counts, the worker processes on its queue as their
heartbeats show them, and an ETA from the live ones only.

A worker process is live while its last heartbeat is younger than the lease (farm/liveness.py): past
that, its jobs are taken back by the others, so it must not count towards the ETA either. Each live
worker's pace is the median wall time of its last jobs of this run (claim to result, from the ledger);
one that has not finished a job of this run yet is given the run's median. ETA = open jobs / Σ paces.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from dsocr_workers.store.db import open_ledger
from dsocr_workers.store.models import (
    FINAL_STATES,
    IN_PROCESS_QUEUE,
    Job,
    Result,
    Run,
    WorkerProcess,
    WorkerSession,
    utcnow,
)
from dsocr_workers.store.runs import resolve_run

PACE_JOBS = 20  # a worker's pace: the median of its last this-many jobs of the run
SHOW_SILENT_FOR = timedelta(minutes=10)  # a silent worker stays listed (as silent) this long


@dataclass(frozen=True)
class WorkerView:
    id: str  # host:pid:nonce, the lease owner name of its jobs
    host: str
    pid: int
    device: str
    live: bool
    stopped: bool
    heartbeat_age_s: float
    current_image: str | None  # the job of this run it holds now
    jobs_done: int  # of this run
    job_s: float | None  # its median seconds per job of this run


@dataclass(frozen=True)
class RunProgress:
    run_id: str
    queue: str
    counts: Counter[str]
    workers: list[WorkerView]
    pages_per_s: float | None  # the live workers' pace together; None when unknown
    eta_s: float | None  # open jobs / pages_per_s; None when no live worker or no pace yet
    interrupted: bool = False  # its in-process run was interrupted, its jobs handed back, and not resumed

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def final(self) -> int:
        return sum(self.counts.get(state, 0) for state in FINAL_STATES)

    @property
    def live_workers(self) -> int:
        return sum(w.live for w in self.workers)

    @property
    def finished(self) -> bool:
        return self.final == self.total


def run_progress(tx: Session, run: Run, lease_s: float, now: datetime | None = None) -> RunProgress:
    now = now or utcnow()
    jobs = tx.execute(
        select(Job.id, Job.image, Job.state, Job.lease_owner, Job.started_at, Job.finished_at).where(
            Job.run_id == run.id
        )
    ).all()
    counts = Counter(job.state for job in jobs)
    holding = {job.lease_owner: job.image for job in jobs if job.state == "running" and job.lease_owner}
    done_by = tx.execute(
        select(WorkerSession.worker_process_id, Job.started_at, Job.finished_at)
        .join(Result, Result.worker_session_id == WorkerSession.id)
        .join(Job, Job.id == Result.job_id)
        .where(Result.run_id == run.id, Job.state == "done")
    ).all()
    durations: dict[str | None, list[tuple[datetime, float]]] = {}
    for process_id, started, finished in done_by:
        if started is not None and finished is not None:
            durations.setdefault(process_id, []).append((finished, (finished - started).total_seconds()))
    run_median = statistics.median(s for pairs in durations.values() for _, s in pairs) if durations else None

    processes = tx.scalars(
        select(WorkerProcess).where(WorkerProcess.heartbeat_at >= now - SHOW_SILENT_FOR)
    ).all()
    workers = []
    for process in processes:
        served = process.id in holding or process.id in durations
        # `dsocr run`'s queue is every in-process run's: its line of another run is none of this run's.
        if not served and (run.queue not in process.queues.split(",") or run.queue == IN_PROCESS_QUEUE):
            continue
        latest = sorted(durations.get(process.id, []))[-PACE_JOBS:]
        age = (now - process.heartbeat_at).total_seconds()
        workers.append(
            WorkerView(
                id=process.id,
                host=process.host,
                pid=process.pid,
                device=process.device,
                live=process.stopped_at is None and age < lease_s,
                stopped=process.stopped_at is not None,
                heartbeat_age_s=max(0.0, age),
                current_image=holding.get(process.id),
                jobs_done=len(durations.get(process.id, [])),
                job_s=statistics.median(s for _, s in latest) if latest else None,
            )
        )
    workers.sort(key=lambda w: (not w.live, w.host, w.pid))
    paces = [w.job_s or run_median for w in workers if w.live]
    known = [p for p in paces if p]
    rate = sum(1 / p for p in known) if known and len(known) == len(paces) else None
    open_jobs = sum(count for state, count in counts.items() if state not in FINAL_STATES)
    eta = open_jobs / rate if rate else None
    return RunProgress(run.id, run.queue, counts, workers, rate, eta, interrupted=run.interrupted_at is not None)


def follow_progress(
    database_url: str, run_ref: str, lease_s: float, interval_s: float | None = None
) -> Iterator[RunProgress]:
    """The progress of the run named by `run_ref` (id, unique prefix or latest) now; with `interval_s`,
    again every `interval_s` seconds until every job of it is final (`dsocr status [--watch]`)."""
    db = open_ledger(database_url)
    while True:
        with db.transaction() as tx:
            progress = run_progress(tx, resolve_run(tx, run_ref), lease_s)
        yield progress
        if interval_s is None or progress.finished:
            return
        time.sleep(interval_s)
