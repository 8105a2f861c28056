"""A profile's trace out of the ledger (`dsocr trace`): the Chrome trace JSON torch.profiler wrote of a
profiled job or of a batched run's sampled step, stored gzip-compressed in `profiles` by the worker that
ran it, read back from any host that reaches the ledger. Perfetto (https://ui.perfetto.dev) and
chrome://tracing open it, compressed or not."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from dsocr_workers.errors import InputError
from dsocr_workers.store.db import open_ledger
from dsocr_workers.store.models import BatchStep, Job, Profile, Run
from dsocr_workers.store.runs import resolve_run

SHOWN = 8  # profiled steps a refusal names


@dataclass(frozen=True)
class TraceRequest:
    """One job: by id (or a unique prefix), or by run, image and repeat (None: the image's profiled
    repeat); or one sampled batch step: by run and the engine's step index."""

    job: str | None = None
    run: str | None = None
    image: str | None = None
    repeat: int | None = None
    step: int | None = None
    out: Path | None = None  # default: dsocr-trace-<job id or run-step>.json.gz here; without .gz: plain JSON


@dataclass(frozen=True)
class TraceWritten:
    what: str  # the job or step, in words
    path: Path
    bytes: int


def write_trace(database_url: str, request: TraceRequest) -> TraceWritten:
    by_job = request.run is not None and request.image is not None
    by_step = request.run is not None and request.step is not None
    if [request.job is not None, by_job, by_step].count(True) != 1:
        raise InputError("name one job or step: --job ID, --run ID --image NAME, or --run ID --step N")
    with open_ledger(database_url).transaction() as tx:
        if by_step:
            assert request.run is not None and request.step is not None
            trace, what, name = _step_trace(tx, resolve_run(tx, request.run), request.step)
        else:
            trace, what, name = _job_trace(tx, _job(tx, request))
    path = request.out or Path(f"dsocr-trace-{name}.json.gz")
    data = trace if path.suffix == ".gz" else gzip.decompress(trace)
    path.write_bytes(data)
    return TraceWritten(what, path, len(data))


def _job_trace(tx: Session, job: Job) -> tuple[bytes, str, str]:
    trace = tx.scalar(select(Profile.trace_gz).where(Profile.job_id == job.id))
    if trace is None:
        profiled = tx.scalars(
            select(Job.image).join(Profile, Profile.job_id == Job.id).where(Job.run_id == job.run_id).limit(3)
        ).all()
        if profiled:
            hint = f"the run's profiled jobs include {', '.join(profiled)}"
        elif _sampled_steps(tx, job.run_id):
            hint = f"its run profiled batch steps: dsocr trace --run {job.run_id} --step N"
        else:
            hint = "its run has none: submit with --profile N"
        raise InputError(f"job {job.id} ({job.image}, repeat {job.repeat}) has no profile; {hint}")
    return trace, f"job {job.id} ({job.image}, repeat {job.repeat})", job.id


def _step_trace(tx: Session, run: Run, index: int) -> tuple[bytes, str, str]:
    """The run's sampled step `index`: where several engines of the run sampled one (a worker each), the
    first to run."""
    found = tx.execute(
        select(Profile.trace_gz, BatchStep.kind, BatchStep.occupancy, BatchStep.worker_session_id)
        .join(BatchStep, Profile.batch_step_id == BatchStep.id)
        .where(Profile.run_id == run.id, BatchStep.step_index == index)
        .order_by(BatchStep.started_at)
        .limit(1)
    ).first()
    if found is None:
        sampled = _sampled_steps(tx, run.id)
        hint = (
            f"its profiled steps include {', '.join(f'{i} ({kind})' for i, kind in sampled)}"
            if sampled
            else "it has none: submit with --profile N and --concurrency above 1"
        )
        raise InputError(f"run {run.id} has no profiled batch step {index}; {hint}")
    trace, kind, occupancy, session = found
    what = f"batch {kind} step {index} of run {run.id} ({occupancy} page(s), worker session {session})"
    return trace, what, f"{run.id}-step-{index}"


def _sampled_steps(tx: Session, run_id: str) -> list[tuple[int, str]]:
    """(step index, kind) of the run's first profiled steps."""
    rows = tx.execute(
        select(BatchStep.step_index, BatchStep.kind)
        .join(Profile, Profile.batch_step_id == BatchStep.id)
        .where(Profile.run_id == run_id)
        .order_by(BatchStep.started_at)
        .limit(SHOWN)
    )
    return [(index, kind) for index, kind in rows]


def _job(tx: Session, request: TraceRequest) -> Job:
    if request.job is not None:
        matches = tx.scalars(
            select(Job).where(Job.id.startswith(request.job, autoescape=True)).limit(2)
        ).all()
        if len(matches) != 1:
            raise InputError(
                f"no job {request.job!r}" if not matches else f"job id prefix {request.job!r} is ambiguous"
            )
        return matches[0]
    assert request.run is not None and request.image is not None
    run = resolve_run(tx, request.run)
    image = request.image
    jobs = [
        j
        for j in tx.scalars(select(Job).where(Job.run_id == run.id).order_by(Job.line, Job.repeat))
        if j.image == image or j.image.rsplit("/", 1)[-1] == image
    ]
    if not jobs:
        raise InputError(f"run {run.id} has no image {image!r}")
    if len({j.image for j in jobs}) > 1:
        raise InputError(
            f"{image!r} names several images of run {run.id}: {', '.join(sorted({j.image for j in jobs}))}"
        )
    if request.repeat is not None:
        chosen = [j for j in jobs if j.repeat == request.repeat]
        if not chosen:
            raise InputError(f"run {run.id} has no repeat {request.repeat} of {image!r}")
        return chosen[0]
    return next((j for j in jobs if j.profile), jobs[0])
