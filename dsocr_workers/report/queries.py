"""What a report reads from the ledger: one run, its jobs, their results, and the workers and worker
sessions (loaded models) behind them; for a run at `--concurrency` above 1, its batched engine's steps;
for a run with `--profile`, its profiles' kernel summaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from dsocr_workers.kernels import KernelSummary
from dsocr_workers.store.db import open_ledger
from dsocr_workers.store.models import (
    FINAL_STATES,
    BatchStep,
    Job,
    JobAttempt,
    Profile,
    Result,
    Run,
    Worker,
    WorkerProcess,
    WorkerSession,
)
from dsocr_workers.store.runs import resolve_run


@dataclass(frozen=True)
class StepTime:
    """What a report reads of one `batch_steps` row (a long run has hundreds of thousands: no ORM objects)."""

    worker_session_id: str
    kind: str  # prefill | decode
    occupancy: int
    duration_ms: float
    started_at: datetime  # on the device, as a UTC time
    profiled: bool = False  # run under torch.profiler: its time holds the profiler's cost
    kv_positions: int | None = None  # a decode step's pages' KV positions read, summed (None: not recorded)
    kv_longest: int | None = None  # the longest page's

    @property
    def ended_at(self) -> datetime:
        """When its tokens were chosen."""
        return self.started_at + timedelta(milliseconds=self.duration_ms)


@dataclass(frozen=True)
class StepProfile:
    """A batched run's sampled step (`profiles` row of a `batch_steps` row): the step and its kernels."""

    step_index: int  # the engine's (`dsocr trace --run ID --step N`)
    kind: str  # prefill | decode
    occupancy: int
    duration_ms: float
    summary: KernelSummary


@dataclass(frozen=True)
class RunData:
    run: Run
    jobs: list[Job]
    results: dict[str, Result]  # by job id
    workers: dict[str, Worker]  # by worker id, the ones that produced results
    sessions: dict[str, WorkerSession]  # by id, the ones that produced results (none before schema 0002)
    # By worker session: when its jobs of other runs finished (since this run was created), so that a
    # lane's time on another run is never counted as this run's (report/throughput.py).
    elsewhere: dict[str, list[datetime]] = field(default_factory=dict)
    # Every claim of the run's jobs (none before schema 0007), and the worker processes that made them.
    attempts: list[JobAttempt] = field(default_factory=list)
    processes: dict[str, WorkerProcess] = field(default_factory=dict)  # by id (the lease owner name)
    # The profiled jobs' kernels per stage, by job id (their traces stay in the ledger: `dsocr trace`).
    profiles: dict[str, KernelSummary] = field(default_factory=dict)
    # Its batched engine's steps (none at --concurrency 1, or before schema 0011).
    steps: list[StepTime] = field(default_factory=list)
    # Its sampled batch steps' kernels, in the order they ran (a batched run with --profile).
    step_profiles: list[StepProfile] = field(default_factory=list)


def load_run(tx: Session, ref: str) -> RunData:
    run = resolve_run(tx, ref)
    jobs = list(tx.scalars(select(Job).where(Job.run_id == run.id).order_by(Job.line, Job.repeat)))
    results = {r.job_id: r for r in tx.scalars(select(Result).where(Result.run_id == run.id))}
    worker_ids = {r.worker_id for r in results.values()}
    session_ids = {r.worker_session_id for r in results.values() if r.worker_session_id is not None}
    workers = {w.id: w for w in tx.scalars(select(Worker).where(Worker.id.in_(worker_ids)))}
    sessions = {
        s.id: s for s in tx.scalars(select(WorkerSession).where(WorkerSession.id.in_(session_ids)))
    }
    elsewhere: dict[str, list[datetime]] = {}
    for session_id, finished in tx.execute(
        select(Result.worker_session_id, Job.finished_at)
        .join(Job, Job.id == Result.job_id)
        .where(
            Result.worker_session_id.in_(session_ids),
            Result.run_id != run.id,
            Job.finished_at >= run.created_at,
        )
    ):
        if session_id is not None and finished is not None:
            elsewhere.setdefault(session_id, []).append(finished)
    attempts = list(
        tx.scalars(select(JobAttempt).where(JobAttempt.run_id == run.id).order_by(JobAttempt.id))
    )
    owners = {a.owner for a in attempts} | {
        s.worker_process_id for s in sessions.values() if s.worker_process_id
    }
    processes = {p.id: p for p in tx.scalars(select(WorkerProcess).where(WorkerProcess.id.in_(owners)))}
    profiles = {
        job_id: KernelSummary.from_json(summary)
        for job_id, summary in tx.execute(
            select(Profile.job_id, Profile.summary).where(
                Profile.run_id == run.id, Profile.job_id.is_not(None)
            )
        )
    }
    columns = (
        BatchStep.worker_session_id,
        BatchStep.kind,
        BatchStep.occupancy,
        BatchStep.duration_ms,
        BatchStep.started_at,
        BatchStep.profiled,
        BatchStep.kv_positions,
        BatchStep.kv_longest,
    )
    steps = [StepTime(*row) for row in tx.execute(select(*columns).where(BatchStep.run_id == run.id))]
    sampled = (
        select(BatchStep.step_index, BatchStep.kind, BatchStep.occupancy, BatchStep.duration_ms, Profile.summary)
        .join(Profile, Profile.batch_step_id == BatchStep.id)
        .where(Profile.run_id == run.id)
        .order_by(BatchStep.started_at, BatchStep.id)
    )  # fmt: skip
    step_profiles = [
        StepProfile(index, kind, occupancy, ms, KernelSummary.from_json(summary))
        for index, kind, occupancy, ms, summary in tx.execute(sampled)
    ]
    return RunData(
        run, jobs, results, workers, sessions, elsewhere, attempts, processes, profiles, steps, step_profiles
    )


@dataclass(frozen=True)
class RunSummary:
    run: Run
    counts: dict[str, int]  # jobs by state

    @property
    def open_jobs(self) -> int:
        return sum(count for state, count in self.counts.items() if state not in FINAL_STATES)


def list_runs(database_url: str, limit: int = 20) -> list[RunSummary]:
    """The newest `limit` runs with their job counts (`dsocr runs`)."""
    with open_ledger(database_url).transaction() as tx:
        runs = list(tx.scalars(select(Run).order_by(Run.created_at.desc()).limit(limit)))
        counts: dict[str, dict[str, int]] = {r.id: {} for r in runs}
        if runs:
            rows = tx.execute(
                select(Job.run_id, Job.state, func.count())
                .where(Job.run_id.in_(list(counts)))
                .group_by(Job.run_id, Job.state)
            )
            for run_id, state, count in rows:
                counts[run_id][state] = count
    return [RunSummary(r, counts[r.id]) for r in runs]
