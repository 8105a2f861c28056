"""The ledger's tables: runs, their jobs, one result per job, and the environments that produced them;
beside a result, a batched run's engine steps (`batch_steps`), and the kernels of a profiled job or batch
step (`profiles`).

Times are naive UTC (`utcnow()`) on every dialect so that SQLite and PostgreSQL compare them alike.
Alembic owns the schema (`migrations/`); a change here needs a new migration.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    LargeBinary,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from dsocr_workers.stages import TIMINGS

JobState = Literal["pending", "queued", "running", "done", "failed", "poisoned"]
FINAL_STATES: tuple[str, ...] = ("done", "failed", "poisoned")
# The queue `dsocr run` records its runs under by default: no worker reads it, and its jobs are never sent
# to a broker (the report tells them from jobs a failed submit left pending).
IN_PROCESS_QUEUE = "in-process"

# Job ids are uuid5 of (run, image, repeat) in this namespace: the same job always has the same id.
JOB_ID_NAMESPACE = uuid.UUID("6f0c7c1e-4a8e-5f43-9a57-2d1f0b7e9c31")


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def job_id_for(run_id: str, image: str, repeat: int) -> str:
    return str(uuid.uuid5(JOB_ID_NAMESPACE, f"{run_id}\x00{image}\x00{repeat}"))


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=False)}


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    filelist: Mapped[str] = mapped_column(Text)  # the list as given to submit
    root: Mapped[str] = mapped_column(Text)  # absolute; job images are relative to it
    model: Mapped[str] = mapped_column(Text)  # preset name or checkpoint directory
    model_label: Mapped[str] = mapped_column(Text)
    # The model family (model/families.py), e.g. "deepseek-ocr", "deepseek-ocr2".
    model_family: Mapped[str] = mapped_column(String(64), server_default="deepseek-ocr")
    random_weights: Mapped[bool]
    queue: Mapped[str] = mapped_column(String(200))
    # Everything that decides what a job computes: mode, prompt, max_new_tokens, ignore_eos, engine,
    # dtype, repeats. Never credentials.
    parameters: Mapped[dict[str, Any]]
    tags: Mapped[dict[str, Any]]
    # The OmniDocBench annotation file the run was submitted with (`--ground-truth`), as given.
    ground_truth: Mapped[str | None] = mapped_column(Text)
    # When the process working through it in-process (`dsocr run`, `dsocr resume`) was interrupted with
    # jobs not final, handing them back; None once resumed (or never interrupted).
    interrupted_at: Mapped[datetime | None]


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_run_state", "run_id", "state"),
        # Every heartbeat renews its owner's leases and looks for expired ones (farm/liveness.py).
        Index("ix_jobs_lease_owner", "lease_owner"),
        Index("ix_jobs_state_lease_expires", "state", "lease_expires_at"),
        # Every heartbeat renews its owner's reservation too.
        Index("ix_jobs_reserved_by", "reserved_by"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)  # job_id_for(run, image, repeat)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    image: Mapped[str] = mapped_column(Text)  # relative to the run's root, posix separators
    line: Mapped[int]  # line of the file list it came from
    repeat: Mapped[int]
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    # A waiting job a worker process fetched to run next and prepares the page of, until `reserved_until`:
    # a claim ignores and clears it; a sweep brings the job's message back once it expires.
    reserved_by: Mapped[str | None] = mapped_column(String(200))
    reserved_until: Mapped[datetime | None]
    last_error_class: Mapped[str | None] = mapped_column(String(200))
    last_error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    queued_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]  # start of the latest attempt
    finished_at: Mapped[datetime | None]
    # The page's ground truth (quality.omnidocbench.PageReference.to_json), when the run has one.
    reference: Mapped[dict[str, Any] | None]
    # Run under torch.profiler (submit's `--profile N`, batch-1 runs); its trace and kernels go to `profiles`.
    profile: Mapped[bool] = mapped_column(default=False, server_default=false())


class JobAttempt(Base):
    """One claim of a job: which worker process (its lease owner name) took it, when; a report names
    every process that held a job, not only the one whose result it kept."""

    __tablename__ = "job_attempts"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int]
    owner: Mapped[str] = mapped_column(String(200))  # a worker_processes id (host:pid:nonce)
    claimed_at: Mapped[datetime]


class Worker(Base):
    """One environment fingerprint: the same host, device, software and model give the same id."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(32))
    gpu_name: Mapped[str | None] = mapped_column(String(255))
    gpu_uuid: Mapped[str | None] = mapped_column(String(64))
    driver: Mapped[str | None] = mapped_column(String(64))
    cuda: Mapped[str | None] = mapped_column(String(32))
    torch: Mapped[str] = mapped_column(String(64))
    transformers: Mapped[str] = mapped_column(String(64))
    python: Mapped[str] = mapped_column(String(32))
    project_version: Mapped[str] = mapped_column(String(32))
    git_sha: Mapped[str | None] = mapped_column(String(40))
    model_label: Mapped[str] = mapped_column(Text)
    model_fingerprint: Mapped[str | None] = mapped_column(String(128))
    random_weights: Mapped[bool]
    first_seen: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class WorkerProcess(Base):
    """One process that runs jobs (a `dsocr worker` child, or `dsocr run`), and its heartbeat. Its id is
    the lease owner name it claims jobs under; it is live while `heartbeat_at` is younger than the lease
    and it has not stopped (farm/liveness.py)."""

    __tablename__ = "worker_processes"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # host:pid:nonce (farm/owners.py)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    device: Mapped[str] = mapped_column(String(32))
    queues: Mapped[str] = mapped_column(Text)  # comma-separated (queue names have no commas)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[datetime | None]  # a clean shutdown; a killed process never sets it
    # When a sweep found it silent for a lease and not stopped (farm/liveness.py); a beat clears it.
    found_dead_at: Mapped[datetime | None]


class WorkerSession(Base):
    """One model loaded in one worker process: where and when, and what loading and warming it cost
    (the worker's, never a job's: the report counts a worker's jobs only from `ready_at` on)."""

    __tablename__ = "worker_sessions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    worker_id: Mapped[str | None] = mapped_column(ForeignKey("workers.id"))  # the environment fingerprint
    worker_process_id: Mapped[str | None] = mapped_column(ForeignKey("worker_processes.id"))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    device: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(Text)  # preset name or checkpoint directory, as the run names it
    engine: Mapped[str] = mapped_column(String(16))
    dtype: Mapped[str | None] = mapped_column(String(32))
    warmup: Mapped[str] = mapped_column(Text, default="")  # the shapes warmed, e.g. "gundam 2x3, base"
    started_at: Mapped[datetime] = mapped_column(default=utcnow)  # loading began
    # What the process's start spent importing torch, transformers and the engine, on its first session
    # (0: inherited from `dsocr worker`'s parent, and on later sessions); NULL: not measured.
    import_ms: Mapped[float | None] = mapped_column(Float)
    load_ms: Mapped[float | None] = mapped_column(Float)
    warmup_ms: Mapped[float | None] = mapped_column(Float)
    ready_at: Mapped[datetime | None]  # loaded and warmed: from here on its jobs are steady state
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class TimingColumns:
    """One Float column per figure of the stage registry, named by it (`preprocess_ms`, `e2e_ms`, …) and
    NULL-able where the registry says so: a new stage needs a migration, not an edit here. Read them
    through the registry (`Timing.of(result)`): they are generated, so the type checker does not see
    them as attributes."""


for _timing in TIMINGS:
    setattr(TimingColumns, _timing.column, mapped_column(Float, nullable=_timing.nullable))
del _timing


class Result(TimingColumns, Base):
    """What one job measured (DESIGN.md §3). Exactly one per job: `job_id` is unique and written by upsert."""

    __tablename__ = "results"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id"))
    worker_session_id: Mapped[str | None] = mapped_column(ForeignKey("worker_sessions.id"))
    attempt: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    clock: Mapped[str] = mapped_column(String(16))  # cuda_event | perf_counter
    # The figures of the stage registry (dsocr_workers/stages.py) are columns too: `TimingColumns`.
    # Prefetched: the page was prepared while the previous job ran; its preprocess_ms is still its own.
    prefetched: Mapped[bool] = mapped_column(default=False, server_default=false())
    # TTFT from the claim (lease taken), beside the registry's TTFT from the job's start on the device.
    ttft_from_claim_ms: Mapped[float | None] = mapped_column(Float)
    # When the device began the job (setup) and finished it (readback): the gaps between them are a
    # worker's device idle time.
    device_started_at: Mapped[datetime | None]
    device_finished_at: Mapped[datetime | None]
    decode_step_ms: Mapped[list[Any]]
    decode_ms_per_token_p50: Mapped[float | None] = mapped_column(Float)
    decode_ms_per_token_p90: Mapped[float | None] = mapped_column(Float)
    decode_ms_per_token_p99: Mapped[float | None] = mapped_column(Float)

    decode_tokens: Mapped[int]
    # A job of a run at --concurrency above 1: the pages decoding in its batch, averaged over its decode
    # steps (itself included); None on the batch-1 path.
    batch_occupancy: Mapped[float | None] = mapped_column(Float)
    wasted_steps: Mapped[int] = mapped_column(default=0)
    prompt_tokens: Mapped[int]
    image_tokens: Mapped[int]
    crop_cols: Mapped[int]
    crop_rows: Mapped[int]
    image_width: Mapped[int]
    image_height: Mapped[int]
    mode: Mapped[str] = mapped_column(String(32))
    stop_reason: Mapped[str] = mapped_column(String(32))
    # CUDA memory of this job (statistics reset at its start); None on CPU. peak = what was resident
    # when the job's compute began (weights, every cache bucket) + activation_peak.
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    weights_bytes: Mapped[int | None] = mapped_column(BigInteger)
    kv_cache_bytes: Mapped[int | None] = mapped_column(BigInteger)  # this job's cache bucket
    activation_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    kv_length: Mapped[int]
    vision_calls: Mapped[int]
    # A job that met a cold path (a compilation, a new cache bucket, allocator growth): its timings are
    # real but not steady state; reports leave it out of statistics unless asked.
    cold: Mapped[bool] = mapped_column(default=False, server_default=false())
    cold_reason: Mapped[str | None] = mapped_column(Text)
    # Run under torch.profiler (its trace and kernels: `profiles`): its timings hold the profiler's
    # cost, so reports leave it out of the latency statistics unless asked, like a cold one.
    profiled: Mapped[bool] = mapped_column(default=False, server_default=false())

    engine: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(32))
    dtype: Mapped[str] = mapped_column(String(32))
    model_label: Mapped[str] = mapped_column(Text)
    random_weights: Mapped[bool]

    markup: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[Any]]
    boxes: Mapped[list[Any]]
    box_count: Mapped[int]
    skipped_spans: Mapped[int]

    # The repetition loop the output ends in (engine/loops.py); None: no loop. `loop_start` indexes
    # token_ids, `loop_wasted_steps` counts the decode steps after the loop's first copy.
    loop_start: Mapped[int | None]
    loop_period: Mapped[int | None]
    loop_wasted_steps: Mapped[int | None]
    # Normalised edit distance to the job's reference, per OmniDocBench category (quality/scoring.py;
    # lower is better); None without a reference, or where neither side has the category.
    text_edit: Mapped[float | None] = mapped_column(Float)
    formula_edit: Mapped[float | None] = mapped_column(Float)
    table_edit: Mapped[float | None] = mapped_column(Float)
    reading_order_edit: Mapped[float | None] = mapped_column(Float)
    # Table TEDS (higher is better), the page's tables averaged; `_structure`: cells without content.
    table_teds: Mapped[float | None] = mapped_column(Float)
    table_teds_structure: Mapped[float | None] = mapped_column(Float)
    # The matching that paired the page's text and formulas (quality/matching.py): quick_match, or
    # one_to_one where quick_match ran past DSOCR_MATCH_TIME_LIMIT; None without a reference.
    matched_by: Mapped[str | None] = mapped_column(String(16))


class BatchStep(Base):
    """One step of a worker's batched engine (a run at `--concurrency` above 1): a page's prefill into its
    slot (whole, or one of its two parts with `--prefill split`), or one decode step over the batch; the
    device's side of the serving figures. A step that served jobs of two runs is a row of each."""

    __tablename__ = "batch_steps"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    worker_session_id: Mapped[str] = mapped_column(ForeignKey("worker_sessions.id"))  # the model it ran on
    step_index: Mapped[int]  # the engine's, from 0 when the engine was made (one per run's settings)
    kind: Mapped[str] = mapped_column(String(8))  # prefill | sam | join | decode (older runs: chunk)
    # Pages it gave a token: a decode step's pages decoding; a prefill or join, 1 (the joining page);
    # a sam, 0.
    occupancy: Mapped[int]
    bucket: Mapped[int]  # rows computed (a decode step's batch bucket; a prefill or its parts: 1)
    # When it started on the device and for how long (CUDA events on a GPU, host readings on a CPU).
    started_at: Mapped[datetime]
    duration_ms: Mapped[float] = mapped_column(Float)
    # A prefill's or join's: the joining page's prompt (a sam's: 0); the vision stages in it (SAM, the view
    # encoder, projector); None for a decode step.
    prompt_tokens: Mapped[int | None]
    vision_ms: Mapped[float | None] = mapped_column(Float)
    # A decode step's KV reads: the positions its pages' attention reads (each page's prompt and tokens so
    # far, the one it feeds included), summed, and the longest page's; None for a prefill or its parts.
    kv_positions: Mapped[int | None]
    kv_longest: Mapped[int | None]
    # Run under torch.profiler (a `--profile N` run's sampled step, engine/profiling.py `StepSample`): its
    # trace and kernels are its `profiles` row; its time holds the profiler's cost, so the step statistics
    # leave it out.
    profiled: Mapped[bool] = mapped_column(default=False, server_default=false())


class Profile(Base):
    """What torch.profiler left of a profiled job or of a batched run's sampled step (one of the two): its
    trace (gzip-compressed Chrome trace JSON, for `dsocr trace`) and its kernels per stage
    (`KernelSummary`). Beside the result or step, not in it: those rows stay small, and a report reads
    the summaries without the traces."""

    __tablename__ = "profiles"
    __table_args__ = (
        CheckConstraint("(job_id IS NULL) <> (batch_step_id IS NULL)", name="ck_profiles_job_or_step"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), index=True, unique=True
    )
    batch_step_id: Mapped[int | None] = mapped_column(
        ForeignKey("batch_steps.id", ondelete="CASCADE"), index=True, unique=True
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    activity: Mapped[str] = mapped_column(String(16))  # what a kernel is: cuda (GPU activities) or cpu (ops)
    trace_gz: Mapped[bytes] = mapped_column(LargeBinary)
    trace_bytes: Mapped[int] = mapped_column(BigInteger)  # uncompressed
    summary: Mapped[dict[str, Any]]
