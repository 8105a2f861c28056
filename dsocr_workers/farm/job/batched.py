"""Jobs of a run with `--concurrency N` above 1, in a Celery child: up to N of them in flight on the
batched engine (engine/batched/), decoding together on the child's loaded model.

The lane is unchanged (one child, prefetch 2): the task of such a job claims it (its lease, on the
claims thread), hands its page to the preparing threads (`PREPARE_THREADS`: reading, tiling and
tokenising a gundam page is ~0.1 s of host work), waits while N jobs are in flight, and returns; the lane
then hands the child its next message, which joins the batch. The engine has a thread of its own, the
only one on the device (`BatchedJobs._serve`): it steps while it has pages in flight or a prepared page
waits to join (a page joins at the first step after it is prepared), and waits otherwise. So the device
does not wait for the lane: when the tasks stepped the engine (once per task while the batch had room),
a batch refilled at the pace of its tasks (hand-over, claim and one step each), and two workers
refilling side by side on one host took 13.1 s a turnover of 128 pages against 12.2 s for one
(docs/benchmarks.md, K = 1 and 2 on 2 × H200). The task waits for the batch to finish once its lane has
no next message (`NextMessage.after`), before a job of another run or setting, and when the child
stops. A job's result is
written when the engine finishes it, on the child's results thread under the job's lease (as a batch-1
job's, farm/job/ledger_threads.py); its message was acknowledged when its task returned, as a batch-1
job's is before its result is written: the ledger is the truth. The heartbeat renews the lease of every
job in flight (they are all this process's); a child killed with jobs in flight leaves them running
under a lease that a live worker's sweep takes back (farm/liveness.py), with their messages.

What a job records: the engine's tokens and stop reason, its preprocess and postprocess stages, its TTFT
(from its claim to its first token: the claim, its page's preparation, its wait for a slot, its prefill;
the same figure as TTFT from the claim), TPOT, wait for a slot (`queue_wait_ms`) and the mean occupancy of
the batch it decoded in, and its decode steps' times as the gaps between its tokens (the inter-token
latency, the `decode_ms_per_token_*` columns); the prefill and decode stages are the batch's, not one
job's, and stay empty (their time is in the job's host gap).

The KV cache's slots hold the longest prompt the run's mode and prompt can make (its largest tile grid)
and the run's token budget: a slot sized for the model's whole context would be ~3x larger for gundam
and 1,024 tokens, and fewer pages would fit.

What the batch records: every engine step (`StepRecord`: prefill or decode, occupancy, bucket, start and
duration on the device) as a `batch_steps` row of the run whose jobs it served. The engine's thread takes the
engine's new steps after each of its steps (the engine's list is emptied, so it does not grow with the
batch's life) and hands them to the results thread `STEPS_PER_WRITE` at a time, and once the batch has
drained or failed: one insert there, none on the device's thread. A step's runs are those of the pages it
gave a token (the engine's token events carry the end of the step that produced them); a step that gave
none (launched for pages whose EOS was read back only after it) is the previous step's runs'.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from dsocr_workers.engine.result import DeviceSpan, InferenceResult
from dsocr_workers.farm.job.execute import Outcome, Ran, job_failed, result_row
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.job.loaded import LoadedSession
from dsocr_workers.farm.owners import owner_is_dead
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.model import postprocess
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import utcnow

if TYPE_CHECKING:  # the engine imports torch: the lane's parent imports this module and never torch
    from dsocr_workers.engine.batched import BatchedOutput, StepEvents, StepRecord
    from dsocr_workers.engine.session import PreparedJob

log = logging.getLogger("dsocr.worker")

# Threads preparing the batch's pages (PIL and torch's CPU ops release the GIL). A batch of N pages that
# started together finishes together, and its N successors are prepared before they can join: on an H200
# at concurrency 128 two threads (~0.12 s a gundam page) took ~8 s to refill it, about as long as the
# 1,024 tokens it decodes, and the batch ran at 106 pages of 128 on average. Half the host's cores, up
# to 8, share that; the task's thread keeps the GIL it needs to launch steps.
PREPARE_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))

# How long a task interrupted while it waits (its soft time limit) waits for the engine's thread to fail
# the batch's jobs: a step or two; a step that hangs is the hard time limit's.
ABORT_WAIT_S = 10.0

# Steps handed to the results thread at once: one insert of small rows every few hundred steps (a second
# or two of decoding on a GPU), and the steps a killed child loses with its batch stay few.
STEPS_PER_WRITE = 256


class JobHost(Protocol):
    """What the batched jobs use of their job process (farm/job/process.py `JobProcess`, which holds them:
    a protocol, not an import of it)."""

    db: Database
    settings: Settings
    owner: str
    device: str
    ledger_threads: LedgerThreads
    batch: BatchedJobs | None

    def batch_for(self, options: RunOptions) -> BatchedJobs: ...

    def send_again(self, job_ids: list[str]) -> None: ...


@dataclass
class InFlight:
    """A claimed job: its page being prepared, then in the engine."""

    claim: ledger.Claim
    claimed_s: float  # perf_counter when its claim started
    page: Future[PreparedJob]
    handed_over: bool = False


@dataclass(frozen=True)
class ServedStep:
    """An engine step and a run whose jobs it served (runs with the same settings share a batch)."""

    run_id: str
    record: StepRecord


def step_rows(steps: list[ServedStep], worker_session_id: str) -> list[dict[str, Any]]:
    """The `batch_steps` rows of `steps`, their perf_counter times made UTC times as a result's device
    span is (farm/job/execute.py `device_columns`)."""
    now_s, now = time.perf_counter(), utcnow()
    rows = []
    for step in steps:
        record, prefill = step.record, step.record.kind == "prefill"
        rows.append({
            "run_id": step.run_id, "worker_session_id": worker_session_id, "step_index": record.index,
            "kind": record.kind, "occupancy": record.occupancy, "bucket": record.bucket,
            "started_at": now - timedelta(seconds=now_s - record.started_s), "duration_ms": record.ms,
            "prompt_tokens": record.prompt_tokens if prefill else None,
            "vision_ms": record.vision_ms if prefill else None,
        })  # fmt: skip
    return rows


class BatchedJobs:
    """The batched engine of one run's settings in a job process, and the jobs it holds."""

    def __init__(self, process: JobHost, loaded: LoadedSession, options: RunOptions) -> None:
        from dsocr_workers.engine.batched import BatchedEngine

        session = loaded.session
        self.process, self.loaded, self.options = process, loaded, options
        longest = min(session.longest_prompt(options.mode, options.prompt), session.max_positions - 1)
        budget = options.max_new_tokens or session.max_positions - longest
        self.engine = BatchedEngine.create(
            session, max_batch=options.concurrency, max_prompt_tokens=longest, max_new_tokens=budget,
            options=options.decode_options,
            # The eager engine's routed experts read counts back to the host: no CUDA graphs there.
            cuda_graphs=None if session.engine == "fast" else False,
        )  # fmt: skip
        self.jobs: dict[str, InFlight] = {}  # in claim order
        self._pages = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="dsocr-batch-pages")
        self._steps: list[ServedStep] = []  # taken from the engine, not yet handed to the results thread
        self._last_runs: tuple[str, ...] = ()  # the runs of the latest step taken
        # Guards `jobs`, `failed`, `_idle` and `_stopping`; notified whenever one of them changes or a page
        # is prepared. The task's thread adds jobs and waits; the engine's thread steps and removes them.
        self._changed = threading.Condition()
        self.failed: Exception | None = None  # what failed every job in flight: the batch is over
        self._idle = True  # the engine's thread found nothing to do (its steps read back and handed over)
        self._stopping = False
        self._aborted: Exception | None = None  # met by a waiting task (its soft time limit): fail the batch
        self._engine_thread = threading.Thread(target=self._serve, name="dsocr-batch-engine", daemon=True)
        self._engine_thread.start()
        log.info("batched engine for %s: %s; %s attention", options.model, self.engine.plan.describe(), self.engine.attention)

    def describe(self) -> str:
        """Its concurrency, KV plan and step, for the worker session that records its start."""
        engine = self.engine
        step = (f"{engine.runner.captured} CUDA graphs ({', '.join(map(str, engine.buckets))} rows)"
                if engine.runner.cuda_graphs else "eager steps")  # fmt: skip
        return f"concurrency {self.options.concurrency}, {engine.plan.describe()}, {engine.attention} attention, {step}"

    def serves(self, options: RunOptions) -> bool:
        """Whether a job of a run with `options` can join this batch (not one that a failed step ended)."""
        return options == self.options and self.failed is None

    def add(self, claim: ledger.Claim, claimed_s: float) -> None:
        """Hand the job's page to the preparing threads; it joins the engine once it is prepared."""
        options, session = self.options, self.loaded.session
        # Pinned: its upload is queued behind decode steps, and a pageable copy would hold the engine's
        # thread until they ran (the device then idles while the thread launches the page's prefill).
        page = self._pages.submit(session.prepare_job, str(claim.image_path), options.prompt, options.mode,
                                  clock=session.new_clock(claim.job_id, marks_steps=False), pinned=True)  # fmt: skip
        with self._changed:
            self.jobs[claim.job_id] = InFlight(claim, claimed_s, page)
            self._idle = False
            self._changed.notify_all()
            in_flight = len(self.jobs)
        page.add_done_callback(lambda _: self._notify())
        log.info("job %s: in the batch, %d in flight", claim.job_id, in_flight)

    def wait_for_room(self) -> None:
        """Wait until fewer than the run's concurrency are in flight: room for the lane's next job."""
        self._wait(lambda: len(self.jobs) < self.options.concurrency)

    def drain(self) -> None:
        """Wait until every job in flight is finished (its result handed to the results thread), every
        step launched is read back and the steps are handed to the results thread."""
        self._wait(lambda: not self.jobs and self._idle)

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait until `done()` or the batch failed. Interrupted (the task's soft time limit: a batch that
        has held a task that long holds a page that does not end), the batch fails every job in flight,
        as a step that raises does, before the interruption goes on."""
        with self._changed:
            try:
                while not done() and self.failed is None:
                    self._changed.wait()
                return
            except Exception as exc:  # SoftTimeLimitExceeded is an Exception
                self._aborted = interrupted = exc
                self._changed.notify_all()
        self._engine_thread.join(timeout=ABORT_WAIT_S)  # it fails the jobs between two steps
        raise interrupted

    def close(self) -> None:
        """Finish the jobs in flight, stop the engine's thread and the preparing threads."""
        self.drain()
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._engine_thread.join()
        self._pages.shutdown()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _serve(self) -> None:
        """The engine's thread, the only one on the device: it steps while the engine has work or a
        prepared page waits to join, whatever the task's thread is doing (a claim, the lane handing
        over the next message), and waits otherwise."""
        while True:
            with self._changed:
                while not self._stopping and self._aborted is None and not self._has_work():
                    if not self._idle:
                        self._fail_lost()
                        self._write_steps()
                        self._idle = True
                        self._changed.notify_all()
                    self._changed.wait()
                aborted = self._aborted
                if aborted is None and not self._has_work():  # stopping, and nothing left
                    return
                self._idle = False
            if aborted is not None:
                log.error("the batched engine failed: %r met while a task waited on it", aborted)
                self._fail_batch(aborted)
                return
            self.step()
            self._notify()
            if self.failed is not None:
                return

    def _has_work(self) -> bool:
        """(Under `_changed`.) The engine has pages or steps in flight, or a prepared page waits to join."""
        return self.engine.busy or any(not job.handed_over and job.page.done() for job in self.jobs.values())

    def step(self) -> None:
        """(The engine's thread.) Hand the prepared pages to the engine, then one engine step; each
        finished job's result is written. A step that raises fails every job in flight (each counts an
        attempt, as a batch-1 job's failure) and ends this batch."""
        self._hand_over()
        if not self.engine.busy:
            return
        try:
            events = self.engine.step()
            self._take_steps(events)  # before the finished jobs leave `jobs`: their runs name the steps
        except Exception as exc:
            log.exception("the batched engine failed with %d jobs in flight", len(self.jobs))
            self._fail_batch(exc)
            return
        for output in events.finished:
            with self._changed:
                job = self.jobs.pop(output.request_id)
                self._changed.notify_all()
            try:
                self._finished(job, output)
            except Exception as exc:  # its result could not be built (its postprocess raised): this job
                # alone fails, as it would on the batch-1 path; the batch goes on
                log.exception("job %s: its result could not be built", job.claim.job_id)
                self._fail_alone(job, exc)
        if len(self._steps) >= STEPS_PER_WRITE:
            self._write_steps()

    def _fail_batch(self, exc: Exception) -> None:
        """(The engine's thread.) Every job in flight fails (an attempt each; a new message for each one
        retried: their own were acknowledged) and the batch is over."""
        with self._changed:
            jobs = list(self.jobs.values())
            self.jobs.clear()
            self.failed = exc
            self._changed.notify_all()
        again = [job_id for job in jobs if (job_id := self._fail(job, exc)) is not None]
        self._write_steps()  # those taken; the rest go with the engine
        self._pages.shutdown(wait=False, cancel_futures=True)
        self.process.send_again(again)

    def _take_steps(self, events: StepEvents) -> None:
        """The engine's steps read back in the call that returned `events`, each with the runs it served."""
        records = list(self.engine.steps)
        self.engine.steps.clear()
        runs_at: dict[float, set[str]] = {}  # a step's end -> the runs of the pages it gave a token
        with self._changed:
            run_of = {job_id: job.claim.run_id for job_id, job in self.jobs.items()}
        for token in events.tokens:
            runs_at.setdefault(token.at_s, set()).add(run_of[token.request_id])
        for record in records:
            if record.ended_s in runs_at:
                self._last_runs = tuple(sorted(runs_at[record.ended_s]))
            self._steps += [ServedStep(run_id, record) for run_id in self._last_runs]

    def _write_steps(self) -> None:
        if self._steps:
            steps, self._steps = self._steps, []
            self.process.ledger_threads.record_steps(partial(step_rows, steps, self.loaded.worker_session_id))

    def _fail_lost(self) -> None:
        """(Under `_changed`, the engine idle.) Jobs handed to an engine that has nothing left: it will
        never finish them (none should be; a bug here would otherwise keep `drain` waiting for ever).
        Each fails and counts an attempt."""
        for job_id, job in list(self.jobs.items()):
            if job.handed_over:
                self.jobs.pop(job_id)
                lost = RuntimeError("the batched engine finished without this job's output")
                log.error("job %s: %s", job_id, lost)
                self._fail_alone(job, lost)

    def _fail(self, job: InFlight, exc: Exception) -> str | None:
        """Record the job's failure (farm/job/execute.py `job_failed`); its id if it is queued again and so
        needs a message (its own was acknowledged when its task returned)."""
        outcome = job_failed(self.process.db, job.claim, exc, self.process.settings)
        log.info("job %s: %s %s", outcome.job_id, outcome.status, outcome.detail)
        return outcome.job_id if outcome.retry_in_s is not None else None

    def _fail_alone(self, job: InFlight, exc: Exception) -> None:
        """One job fails while the batch goes on."""
        if (again := self._fail(job, exc)) is not None:
            self.process.send_again([again])

    def _hand_over(self) -> None:
        """Every prepared page not yet in the engine goes in (submitted: it takes a slot at the next
        step with one free). A page that could not be prepared, or that the engine refuses (it cannot
        fit a slot), fails its job alone."""
        from dsocr_workers.engine.batched import PageRequest

        with self._changed:
            ready = [(job_id, job) for job_id, job in self.jobs.items() if not job.handed_over and job.page.done()]
        for job_id, job in ready:
            try:
                self.engine.submit(PageRequest(job_id, job.page.result().page, self.options.max_new_tokens))
            except Exception as exc:
                with self._changed:
                    self.jobs.pop(job_id)
                    self._changed.notify_all()
                self._fail_alone(job, exc)
                continue
            job.handed_over = True

    def _finished(self, job: InFlight, output: BatchedOutput) -> None:
        loaded = self.loaded
        ran = Ran(self._result(job, output), loaded.worker_id, loaded.worker_session_id, device=self.process.device)
        self.process.ledger_threads.complete(job.claim, partial(result_row, ran, job.claim, job.claimed_s), utcnow())
        log.info("job %s: decoded in the batch (%d tokens, %s, mean occupancy %.1f)", job.claim.job_id,
                 len(output.token_ids), output.stop_reason, _mean_occupancy(output))  # fmt: skip

    def _result(self, job: InFlight, output: BatchedOutput) -> InferenceResult:
        prepared = job.page.result()
        session, page, clock = self.loaded.session, prepared.page, prepared.clock
        with clock.stage("postprocess"):
            text = session.decode_text(output.token_ids)
            parsed = postprocess.parse_markup(text, *page.original.size)
        clock.finish()
        metrics = output.metrics
        own = clock.stage_timings(kept_steps=0)
        # The job's own serving figures (engine/batched/metrics.py); its inter-token gaps stand for its
        # decode steps. Its TTFT runs from its claim: its first token's time and the claim's are on the
        # same perf_counter clock (and TTFT from the claim, from the device span, is the same figure).
        timings = replace(
            own, decode_step_ms=metrics.itl_ms, ttft_ms=(metrics.token_s[0] - job.claimed_s) * 1e3,
            ttft_from_device_start_ms=metrics.prefill_ms, tpot_ms=metrics.tpot_ms or 0.0,
            queue_wait_ms=metrics.queue_wait_ms,
        )  # fmt: skip
        span = DeviceSpan(metrics.prefill_started_s, metrics.token_s[0], metrics.token_s[-1])
        return InferenceResult(
            text=text, token_ids=output.token_ids, stop_reason=output.stop_reason, prompt_tokens=output.prompt_tokens,
            image_tokens=output.image_tokens, crop_grid=output.crop_grid, mode=output.mode,
            image_size=page.original.size, timings=timings, batch_occupancy=metrics.mean_occupancy,
            boxes=postprocess.boxes_json(parsed), skipped_spans=parsed.skipped_spans, memory=None,
            engine=session.engine, device=str(session.device), dtype=str(session.dtype).removeprefix("torch."),
            model=session.source, kv_length=output.prompt_tokens + len(output.token_ids) - 1, vision_calls=1,
            wasted_steps=output.wasted_steps, device_span=span,
        )  # fmt: skip


def _mean_occupancy(output: BatchedOutput) -> float:
    metrics = output.metrics
    return metrics.occupancy_sum / metrics.decode_steps if metrics.decode_steps else 1.0


def run_in_batch(process: JobHost, job_id: str, options: RunOptions, more_coming: bool) -> Outcome:
    """The task of a job of a run with concurrency above 1: claim it, hand it to the process's batched
    engine, step while the batch is full; to the end when `more_coming` is False (the lane has no next
    message). Returns "decoding" for a job handed over: its result is written when the engine finishes it."""
    if process.batch is not None and job_id in process.batch.jobs:
        # A second delivery of a job this batch holds (a sweep took back a message this lane still held):
        # its claim would be this process's own and pass, and the engine would hold the page twice.
        return Outcome(job_id, "refused", "already in flight in this process's batch")
    claimed_s = time.perf_counter()
    # On the claims thread, like a batch-1 job's; the batch's engine goes on meanwhile on its own thread.
    claimed = process.ledger_threads.claim(partial(
        ledger.claim_job, job_id=job_id, owner=process.owner, lease_s=process.settings.lease_s,
        max_attempts=process.settings.max_attempts, is_dead=owner_is_dead,
    )).result()  # fmt: skip  (TransientError when the ledger is out of reach: the task retries)
    if isinstance(claimed, ledger.Refusal):
        later = None if claimed.retry_after_s is None else claimed.retry_after_s + 1
        return Outcome(job_id, "refused", claimed.reason, later)
    try:
        process.batch_for(options).add(claimed, claimed_s)
    except Exception as exc:  # a bad page or a batch that cannot hold it: this job fails, the batch goes on
        outcome = job_failed(process.db, claimed, exc, process.settings)
    else:
        outcome = Outcome(job_id, "decoding")
    batch = process.batch
    if batch is not None:
        batch.wait_for_room()
        if not more_coming:
            batch.drain()
    return outcome

