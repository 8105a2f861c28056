"""A profiled job's trace out of the ledger (`dsocr trace`): the Chrome trace JSON torch.profiler wrote,
stored gzip-compressed in `job_profiles` by the worker that ran the job, read back from any host that
reaches the ledger. Perfetto (https://ui.perfetto.dev) and chrome://tracing open it, compressed or not."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from dsocr_workers.errors import InputError
from dsocr_workers.store.db import open_ledger
from dsocr_workers.store.models import Job, JobProfile
from dsocr_workers.store.runs import resolve_run


@dataclass(frozen=True)
class TraceRequest:
    """One job: by id (or a unique prefix), or by run, image and repeat (None: the image's profiled
    repeat)."""

    job: str | None = None
    run: str | None = None
    image: str | None = None
    repeat: int | None = None
    out: Path | None = None  # default: dsocr-trace-<job id>.json.gz here; a name without .gz: plain JSON


@dataclass(frozen=True)
class TraceWritten:
    job_id: str
    image: str
    repeat: int
    path: Path
    bytes: int


def write_trace(database_url: str, request: TraceRequest) -> TraceWritten:
    if (request.job is None) == (request.run is None or request.image is None):
        raise InputError("name one job: --job ID, or --run ID --image NAME")
    with open_ledger(database_url).transaction() as tx:
        job = _job(tx, request)
        trace = tx.scalar(select(JobProfile.trace_gz).where(JobProfile.job_id == job.id))
        if trace is None:
            profiled = tx.scalars(
                select(Job.image)
                .join(JobProfile, JobProfile.job_id == Job.id)
                .where(Job.run_id == job.run_id)
                .limit(3)
            ).all()
            hint = (
                f"the run's profiled jobs include {', '.join(profiled)}"
                if profiled
                else "its run has none: submit with --profile N"
            )
            raise InputError(f"job {job.id} ({job.image}, repeat {job.repeat}) has no profile; {hint}")
    path = request.out or Path(f"dsocr-trace-{job.id}.json.gz")
    data = trace if path.suffix == ".gz" else gzip.decompress(trace)
    path.write_bytes(data)
    return TraceWritten(job.id, job.image, job.repeat, path, len(data))


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
