"""Jobs of a run with `--concurrency N` above 1, in a Celery child: up to N of them in flight on the
batched engine (engine/batched/), decoding together on the child's loaded model.

The lane is unchanged (one child, prefetch 2): the task of such a job claims it (its lease; on the
claims thread, the engine stepping meanwhile), hands its page to the preparing threads
(`PREPARE_THREADS`: reading, tiling and tokenising a gundam page is ~0.1 s of host work, which on the
task's thread would hold every page of the batch), steps the engine
while N jobs are in flight, else once (the device keeps decoding while the lane hands the child its next
message), and returns; the lane then hands the child its next message, which joins the batch. A page
joins the engine at the first step after it is prepared. The task steps the engine to the end once its
lane has no next message (`NextMessage.after`), before a job of another run or setting, and when the
child stops. Every step runs on the task's thread, which alone touches the device. A job's result is
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
duration on the device) as a `batch_steps` row of the run whose jobs it served. The task takes the
engine's new steps after each of its steps (the engine's list is emptied, so it does not grow with the
batch's life) and hands them to the results thread `STEPS_PER_WRITE` at a time, and once the batch has
drained or failed: one insert there, none on the device's thread. A step's runs are those of the pages it
gave a token (the engine's token events carry the end of the step that produced them); a step that gave
none (launched for pages whose EOS was read back only after it) is the previous step's runs'.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
        log.info("batched engine for %s: %s", options.model, self.engine.plan.describe())

    def describe(self) -> str:
        """Its concurrency, KV plan and step, for the worker session that records its start."""
        engine = self.engine
        step = (f"{engine.runner.captured} CUDA graphs ({', '.join(map(str, engine.buckets))} rows)"
                if engine.runner.cuda_graphs else "eager steps")  # fmt: skip
        return f"concurrency {self.options.concurrency}, {engine.plan.describe()}, {engine.attention} attention, {step}"

    def serves(self, options: RunOptions) -> bool:
        """Whether a job of a run with `options` can join this batch."""
        return options == self.options

    def add(self, claim: ledger.Claim, claimed_s: float) -> None:
        """Hand the job's page to the preparing threads; it joins the engine at the first step after."""
        options, session = self.options, self.loaded.session
        page = self._pages.submit(session.prepare_job, str(claim.image_path), options.prompt, options.mode,
                                  job_id=claim.job_id)  # fmt: skip
        self.jobs[claim.job_id] = InFlight(claim, claimed_s, page)
        log.info("job %s: in the batch, %d in flight", claim.job_id, len(self.jobs))

    def step_while_full(self) -> None:
        """Step until fewer than the run's concurrency are in flight (room for the next job); else once,
        if the engine has work, so that the device goes on while the lane hands over the next message."""
        if len(self.jobs) < self.options.concurrency:
            if self.engine.busy:
                self.step()
            return
        while len(self.jobs) >= self.options.concurrency:
            self.step()

    def step_until(self, done: Callable[[], bool]) -> None:
        """Step while the engine has work and `done()` is false (the task waits on something else)."""
        while not done() and self.process.batch is self and self.engine.busy:
            self.step()

    def drain(self) -> None:
        """Step until every job in flight is finished (and its result handed to the results thread) and
        every step launched is read back; hand the steps to the results thread."""
        while self.jobs:
            self.step()
        if self.engine.busy and self.process.batch is self:  # not after a failed step: it dropped the batch
            # Steps launched past the last page's EOS held the device too: with no page left, one more
            # step launches nothing and reads them back.
            self.step()
        self._write_steps()

    def close(self) -> None:
        """Finish the jobs in flight and stop the preparing threads."""
        self.drain()
        self._pages.shutdown()

    def step(self) -> None:
        """Hand the prepared pages to the engine (waiting for one when the engine has nothing else to
        do), then one engine step; each finished job's result is written. A step that raises fails every
        job in flight (each counts an attempt, as a batch-1 job's failure) and drops this batch."""
        self._hand_over(wait_for_one=not self.engine.busy)
        if not self.engine.busy:
            self._fail_lost()
            return
        try:
            events = self.engine.step()
            # Before the finished jobs leave `jobs`: their runs name the steps. In the try: a soft time
            # limit met here is met in the step, as in the engine's part of it.
            self._take_steps(events)
        except Exception as exc:
            log.exception("the batched engine failed with %d jobs in flight", len(self.jobs))
            again = [job_id for job in self.jobs.values() if (job_id := self._fail(job, exc)) is not None]
            self.jobs.clear()
            self._write_steps()  # those taken; the rest go with the engine
            self.process.batch = None
            self._pages.shutdown(wait=False, cancel_futures=True)
            self.process.send_again(again)
            return
        for output in events.finished:
            job = self.jobs.pop(output.request_id)
            try:
                self._finished(job, output)
            except Exception as exc:  # its result could not be built (its postprocess raised, a soft time
                # limit met there): this job alone fails, as it would on the batch-1 path; the batch goes on
                log.exception("job %s: its result could not be built", job.claim.job_id)
                self._fail_alone(job, exc)
        if len(self._steps) >= STEPS_PER_WRITE:
            self._write_steps()

    def _take_steps(self, events: StepEvents) -> None:
        """The engine's steps read back in the call that returned `events`, each with the runs it served."""
        records = list(self.engine.steps)
        self.engine.steps.clear()
        runs_at: dict[float, set[str]] = {}  # a step's end -> the runs of the pages it gave a token
        for token in events.tokens:
            runs_at.setdefault(token.at_s, set()).add(self.jobs[token.request_id].claim.run_id)
        for record in records:
            if record.ended_s in runs_at:
                self._last_runs = tuple(sorted(runs_at[record.ended_s]))
            self._steps += [ServedStep(run_id, record) for run_id in self._last_runs]

    def _write_steps(self) -> None:
        if self._steps:
            steps, self._steps = self._steps, []
            self.process.ledger_threads.record_steps(partial(step_rows, steps, self.loaded.worker_session_id))

    def _fail_lost(self) -> None:
        """Jobs handed to an engine that has nothing left: it will never finish them (none should be; a
        bug here would otherwise keep `drain` stepping for ever). Each fails and counts an attempt."""
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

    def _hand_over(self, wait_for_one: bool) -> None:
        """Every prepared page not yet in the engine goes in (submitted: it takes a slot at the next
        step with one free). A page that could not be prepared, or that the engine refuses (it cannot
        fit a slot), fails its job alone."""
        from dsocr_workers.engine.batched import PageRequest

        preparing = [job.page for job in self.jobs.values() if not job.handed_over]
        if wait_for_one and preparing:
            wait(preparing, return_when=FIRST_COMPLETED)
        for job_id, job in list(self.jobs.items()):
            if job.handed_over or not job.page.done():
                continue
            try:
                self.engine.submit(PageRequest(job_id, job.page.result().page, self.options.max_new_tokens))
            except Exception as exc:
                self.jobs.pop(job_id)
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
    claiming = process.ledger_threads.claim(partial(
        ledger.claim_job, job_id=job_id, owner=process.owner, lease_s=process.settings.lease_s,
        max_attempts=process.settings.max_attempts, is_dead=owner_is_dead,
    ))  # fmt: skip
    if process.batch is not None:
        # The device goes on while the claim is written: on SQLite a claim waits its turn at the writer's
        # lock behind the results and claims of every worker on the host (a burst when a batch finishes).
        process.batch.step_until(claiming.done)
    claimed = claiming.result()  # TransientError when the ledger is out of reach: the task retries
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
        batch.step_while_full()
        if not more_coming:
            batch.drain()
    return outcome

