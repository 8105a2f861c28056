"""One job, start to finish, as plain code: `execute_job` (batch-1: the Celery task and `dsocr run`) and
`run_in_batch` (a run with concurrency above 1), both through the one claim path (farm/job/claims.py):

    claim (lease) → infer → result + `done` in one transaction guarded by the lease
                          ↘ failure classified (`job_failed`)

Given a `LedgerThreads` (a Celery child), both transactions run on its threads: the claim while the job
starts (`infer` gets the claim under way and may start the job's prefill before it waits for it), the
result after this returns (the outcome is then `completing`). Without one (`dsocr run`) they run here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from dsocr_workers.engine.result import InferenceResult
from dsocr_workers.farm.job.claims import Claiming, Outcome, Refused, job_failed, refused, start_claim
from dsocr_workers.farm.job.columns import Score, accuracy_columns, device_columns, profile_columns
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.job.loaded import JobHost
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import utcnow

if TYPE_CHECKING:  # the engine's session imports torch: the farm's parent process does not need it
    from dsocr_workers.engine.session import DeviceRun


@dataclass(frozen=True)
class Ran:
    """One claimed job, run: the engine's result (or its device part, whose host part is left to
    `finished()`: a Celery child finishes it on its results thread) and who ran it."""

    result: InferenceResult | DeviceRun
    worker_id: str  # the environment fingerprint (`workers` row)
    worker_session_id: str | None = None  # the loaded model in its process (`worker_sessions` row)
    prefetched: bool = False  # its page was prepared while the previous job ran (farm/job/prefetch.py)
    device: str | None = None  # as the ledger names it, where the engine's name differs (farm/job/process.py)

    def finished(self) -> InferenceResult:
        return self.result if isinstance(self.result, InferenceResult) else self.result.finish()


Infer = Callable[[Claiming], Ran]


def execute_job(
    db: Database,
    job_id: str,
    *,
    owner: str,
    settings: Settings,
    infer: Infer,
    ledger_threads: LedgerThreads | None = None,
    score: Score = accuracy_columns,
) -> Outcome:
    """Raises TransientError when the ledger cannot be reached; the job is then unchanged or still held
    under this owner's lease, and a later delivery to this process continues the same attempt. With
    `ledger_threads`, a job that ran is `completing`: its result is written there, after this returns."""
    claimed_s = time.perf_counter()  # TTFT from the claim starts here, where the claim starts
    claiming = start_claim(db, job_id, owner=owner, settings=settings, ledger_threads=ledger_threads)
    if claiming.claim.done():  # refused or out of reach before anything ran
        try:
            claiming.result()
        except Refused as refusal:
            return refused(refusal.refusal)
    try:
        ran = infer(claiming)
    except Exception as exc:
        # The claim's own outcome first: a job refused is not this process's to fail, and a claim that
        # met a ledger outage raises it here (the job is unchanged: the caller retries).
        try:
            claim = claiming.result()
        except Refused as refusal:
            return refused(refusal.refusal)
        return job_failed(db, claim, exc, settings)
    try:
        claim = claiming.result()  # the job waited for it before its readback
    except Refused as refusal:
        return refused(refusal.refusal)
    finished_at = utcnow()
    # Scored outside the transaction holding the job's row.
    build_row = partial(result_row, ran, claim, claimed_s, score)
    if ledger_threads is not None:
        ledger_threads.complete(claim, build_row, finished_at)
        return Outcome(job_id, "completing")
    row = build_row()
    with db.transaction() as tx:
        written = ledger.complete_job(tx, claim, row, now=finished_at)
    if not written:
        return Outcome(job_id, "lost", "the lease was taken over before the result was written; discarded")
    return Outcome(job_id, "done")


def result_row(ran: Ran, claim: ledger.Claim, claimed_s: float, score: Score = accuracy_columns) -> dict[str, Any]:
    """The `results` columns for one inference of a job claimed at `claimed_s` (perf_counter), its
    accuracy from `score` (a worker's: its scoring process); the engine's host part, if it was left to
    do, is done here."""
    result = ran.finished()
    loop = result.loop
    t = result.timings
    memory = result.memory
    steps = t.decode_step_percentiles
    return {
        "worker_id": ran.worker_id,
        "worker_session_id": ran.worker_session_id,
        "attempt": claim.attempt,
        "clock": t.clock,
        **t.columns(),  # every figure of the stage registry (dsocr_workers/stages.py)
        "prefetched": ran.prefetched,
        **device_columns(result.device_span, claimed_s),
        "decode_step_ms": list(t.decode_step_ms),
        "decode_ms_per_token_p50": steps["p50"],
        "decode_ms_per_token_p90": steps["p90"],
        "decode_ms_per_token_p99": steps["p99"],
        "decode_tokens": result.decode_tokens,
        "batch_occupancy": result.batch_occupancy,
        "wasted_steps": result.wasted_steps,
        "prompt_tokens": result.prompt_tokens,
        "image_tokens": result.image_tokens,
        "crop_cols": result.crop_grid[0],
        "crop_rows": result.crop_grid[1],
        "image_width": result.image_size[0],
        "image_height": result.image_size[1],
        "mode": result.mode,
        "stop_reason": result.stop_reason,
        "peak_memory_bytes": memory.peak_bytes if memory else None,
        "weights_bytes": memory.weights_bytes if memory else None,
        "kv_cache_bytes": memory.kv_cache_bytes if memory else None,
        "activation_peak_bytes": memory.activation_peak_bytes if memory else None,
        "kv_length": result.kv_length,
        "vision_calls": result.vision_calls,
        "cold": result.cold,
        "cold_reason": "; ".join(result.cold_reasons) or None,
        "profiled": result.profile is not None,
        "engine": result.engine,
        "device": ran.device or result.device,
        "dtype": result.dtype,
        "model_label": result.model.label,
        "random_weights": result.model.random_weights,
        "markup": result.text,
        "token_ids": list(result.token_ids),
        "boxes": list(result.boxes),
        "box_count": len(result.boxes),
        "skipped_spans": result.skipped_spans,
        "loop_start": loop.start if loop else None,
        "loop_period": loop.period if loop else None,
        "loop_wasted_steps": loop.wasted_steps if loop else None,
        **score(result.text, claim.reference),
        **profile_columns(result),
    }


def run_in_batch(process: JobHost, job_id: str, options: RunOptions, more_coming: bool) -> Outcome:
    """The task of a job of a run with concurrency above 1: claim it, hand it to the process's batched
    engine (started before the claim), step while the batch is full; to the end when `more_coming` is
    False (the lane has no next message). Returns "decoding" for a job handed over: its result is
    written when the engine finishes it."""
    if process.batch is not None and job_id in process.batch.jobs:
        # A second delivery of a job this batch holds (a sweep took back a message this lane still held):
        # its claim would be this process's own and pass, and the engine would hold the page twice.
        return Outcome(job_id, "refused", "already in flight in this process's batch")
    claimed_s = time.perf_counter()
    # The batch's engine goes on meanwhile on its own thread.
    claiming = start_claim(
        process.db,
        job_id,
        owner=process.owner,
        settings=process.settings,
        ledger_threads=process.ledger_threads,
    )
    try:
        claimed = claiming.result()  # TransientError when the ledger is out of reach: the task retries
    except Refused as refusal:
        return refused(refusal.refusal)
    try:
        process.joinable_batch(options).add(claimed, claimed_s, options)
    except Exception as exc:  # a bad page, a batch that cannot hold it or is not open: this job alone
        outcome = job_failed(process.db, claimed, exc, process.settings)
    else:
        outcome = Outcome(job_id, "decoding")
    batch = process.batch
    if batch is not None:
        batch.wait_for_room()
        if not more_coming:
            batch.drain()
    return outcome
