"""One job, start to finish, as plain code (the Celery task and `dsocr run` both call `execute_job`):

    claim (lease) → infer → result + `done` in one transaction guarded by the lease
                          ↘ failure classified: InputError final, TransientError released, other counted

Given a `LedgerThreads` (a Celery child: farm/job/ledger_threads.py), both transactions run on that thread: the
claim while the job starts (`infer` gets the claim under way, `Claiming`, and may start the job's prefill
before it waits for the claim), the result after this returns (the outcome is then `completing`).
Without one (`dsocr run`) they run here, in order.

Nothing here knows about Celery: retries are returned as `Outcome.retry_in_s` for the caller to schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from dsocr_workers.engine.result import DeviceSpan, InferenceResult
from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.owners import owner_is_dead
from dsocr_workers.farm.retries import job_retry_in_s
from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.quality.omnidocbench import PageReference
from dsocr_workers.quality.scoring import PageScores, score_page
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import utcnow

if TYPE_CHECKING:  # the engine's session imports torch: the farm's parent process does not need it
    from dsocr_workers.engine.session import DeviceRun

# "decoding": handed to the batched engine (farm/job/batched.py), its result written when it finishes.
Status = Literal["done", "completing", "decoding", "failed", "queued", "poisoned", "refused", "released", "lost"]
# Outcomes that put a job back in line (delivered or tried again later): not an end of the job.
BACK_IN_LINE: tuple[Status, ...] = ("queued", "released")

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


class Refused(Exception):
    """Raised by `Claiming.result()`: the job is not this process's to run."""

    def __init__(self, refusal: ledger.Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@dataclass(frozen=True)
class Claiming:
    """A job's claim, written or under way."""

    job_id: str
    claim: Future[ledger.Claim | ledger.Refusal]

    def result(self) -> ledger.Claim:
        """The claim, once written; raises Refused, or TransientError when the ledger is out of reach."""
        claim = self.claim.result()
        if isinstance(claim, ledger.Refusal):
            raise Refused(claim)
        return claim


Infer = Callable[[Claiming], Ran]


@dataclass(frozen=True)
class Outcome:
    job_id: str
    status: Status
    detail: str = ""
    retry_in_s: float | None = None  # deliver the job again after this long


def execute_job(
    db: Database, job_id: str, *, owner: str, settings: Settings, infer: Infer, ledger_threads: LedgerThreads | None = None
) -> Outcome:
    """Raises TransientError when the ledger cannot be reached; the job is then unchanged or still held
    under this owner's lease, and a later delivery to this process continues the same attempt. With
    `ledger_threads`, a job that ran is `completing`: its result is written there, after this returns."""
    claim_job = partial(ledger.claim_job, job_id=job_id, owner=owner, lease_s=settings.lease_s,
                        max_attempts=settings.max_attempts, is_dead=owner_is_dead)  # fmt: skip
    claimed_s = time.perf_counter()  # TTFT from the claim starts here, where the claim starts
    if ledger_threads is not None:
        claiming = Claiming(job_id, ledger_threads.claim(claim_job))
    else:
        with db.transaction() as session:
            claimed = claim_job(session)
        if isinstance(claimed, ledger.Refusal):
            return _refused(claimed)
        done: Future[ledger.Claim | ledger.Refusal] = Future()
        done.set_result(claimed)
        claiming = Claiming(job_id, done)

    try:
        ran = infer(claiming)
    except Exception as exc:
        # The claim's own outcome first: a job refused is not this process's to fail, and a claim that
        # met a ledger outage raises it here (the job is unchanged: the caller retries).
        try:
            claim = claiming.result()
        except Refused as refused:
            return _refused(refused.refusal)
        return job_failed(db, claim, exc, settings)

    try:
        claim = claiming.result()  # JobProcess.infer waited for it before the job's first decode step
    except Refused as refused:
        return _refused(refused.refusal)
    finished_at = utcnow()
    build_row = partial(result_row, ran, claim, claimed_s)  # scored outside the transaction holding the job's row
    if ledger_threads is not None:
        ledger_threads.complete(claim, build_row, finished_at)
        return Outcome(job_id, "completing")
    row = build_row()
    with db.transaction() as session:
        written = ledger.complete_job(session, claim, row, now=finished_at)
    if not written:
        return Outcome(job_id, "lost", "the lease was taken over before the result was written; discarded")
    return Outcome(job_id, "done")


def _refused(refusal: ledger.Refusal) -> Outcome:
    later = None if refusal.retry_after_s is None else refusal.retry_after_s + 1
    return Outcome(refusal.job_id, "refused", refusal.reason, later)


def job_failed(db: Database, claim: ledger.Claim, exc: Exception, settings: Settings) -> Outcome:
    """A claimed job whose inference raised `exc`, recorded: an InputError is final, a TransientError
    releases the job (tried again later), anything else (a model bug, CUDA OOM, a soft time limit)
    counts an attempt."""
    if isinstance(exc, InputError):
        return _record_failure(db, claim, exc, final=True, settings=settings)
    if isinstance(exc, TransientError):
        with db.transaction() as session:
            ledger.release_job(session, claim, exc)
        return Outcome(claim.job_id, "released", str(exc), job_retry_in_s(claim.attempt, settings))
    return _record_failure(db, claim, exc, final=False, settings=settings)


def _record_failure(
    db: Database, claim: ledger.Claim, exc: Exception, *, final: bool, settings: Settings
) -> Outcome:
    with db.transaction() as session:
        state = ledger.fail_job(session, claim, exc, final=final, max_attempts=settings.max_attempts)
    detail = f"{type(exc).__name__}: {exc}"
    if state is None:
        return Outcome(claim.job_id, "lost", detail)
    retry = job_retry_in_s(claim.attempt, settings) if state == "queued" else None
    return Outcome(claim.job_id, state, detail, retry)  # type: ignore[arg-type]


def accuracy_columns(markup: str, reference: dict[str, Any] | None) -> dict[str, float | None]:
    """The job's edit distances and table TEDS to its reference (quality/scoring.py), on the markdown
    the model's markup renders to (its `result.mmd`); all None without a reference."""
    scores = (PageScores(None, None, None, None) if reference is None
              else score_page(render_mmd(markup), PageReference.from_json(reference)))  # fmt: skip
    return {"text_edit": scores.text, "formula_edit": scores.formula, "table_edit": scores.table,
            "reading_order_edit": scores.reading_order, "table_teds": scores.table_teds,
            "table_teds_structure": scores.table_teds_structure}  # fmt: skip


def device_columns(span: DeviceSpan | None, claimed_s: float) -> dict[str, Any]:
    """TTFT from the claim (`claimed_s`, this process's perf_counter like the span) and when the device
    began and finished the job, as UTC times; None without timings."""
    if span is None:
        return {"ttft_from_claim_ms": None, "device_started_at": None, "device_finished_at": None}
    now_s, now = time.perf_counter(), utcnow()
    return {
        "ttft_from_claim_ms": (span.first_token_s - claimed_s) * 1e3,
        "device_started_at": now - timedelta(seconds=now_s - span.started_s),
        "device_finished_at": now - timedelta(seconds=now_s - span.finished_s),
    }


def result_row(ran: Ran, claim: ledger.Claim, claimed_s: float) -> dict[str, Any]:
    """The `results` columns for one inference of a job claimed at `claimed_s` (perf_counter); the
    engine's host part, if it was left to do, is done here."""
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
        **accuracy_columns(result.text, claim.reference),
        **profile_columns(result),
    }


def profile_columns(result: InferenceResult) -> dict[str, Any]:
    """A profiled job's trace and kernel summary, as its `job_profiles` row (under ledger.PROFILE: written
    with the result, in its transaction); nothing for any other job."""
    profile = result.profile
    if profile is None:
        return {}
    return {ledger.PROFILE: {"activity": profile.summary.activity, "trace_gz": profile.trace_gz,
                             "trace_bytes": profile.trace_bytes, "summary": profile.summary.to_json()}}  # fmt: skip
