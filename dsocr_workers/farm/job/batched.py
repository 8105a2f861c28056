"""Jobs of a run with `--concurrency N` above 1, in a Celery child: up to N of them in flight on the
batched engine (engine/batched/), decoding together on the child's open model.

A job's task claims it (the one claim path, farm/job/execute.py `start_claim`), hands its page to the
preparing threads, waits while N jobs are in flight, and returns; the lane's next message joins the batch.
The engine has a thread of its own, the only one on the device (`BatchedJobs._serve`): it steps while it
has pages in flight or a prepared page waits to join, so the device does not wait for the lane. The
task waits for the batch to finish once its lane has no next message, before a job of another run or
setting, and when the child stops. A job's result (`DeviceRun.batched`: the engine's one result
assembly, with the page's TTFT from its claim, TPOT, ITL, queue wait and occupancy) is written when the
engine finishes it, on the child's results thread under the job's lease; the ledger is the truth, as
for a batch-1 job. The heartbeat renews the leases of every job in flight; a child killed with jobs in
flight leaves them to a live worker's sweep (farm/liveness.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from dsocr_workers.farm.job.batch_steps import StepLog
from dsocr_workers.farm.job.claims import job_failed
from dsocr_workers.farm.job.execute import Ran, result_row
from dsocr_workers.farm.job.loaded import JobHost, LoadedSession
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.store import ledger
from dsocr_workers.store.models import utcnow

if TYPE_CHECKING:  # the engine imports torch: the lane's parent imports this module and never torch
    from dsocr_workers.engine.batched import BatchedOutput, StepEvents
    from dsocr_workers.engine.session import PreparedJob

log = logging.getLogger("dsocr.worker")

# Threads preparing the batch's pages (PIL and torch's CPU ops release the GIL): a batch that finished
# together is refilled together, and one thread would refill it slower than it decodes. Half the host's
# cores at most: the engine's thread keeps the GIL it needs to launch steps.
PREPARE_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))

# How long a task interrupted while it waits (its soft time limit) waits for the engine's thread to fail
# the batch's jobs: a step or two; a step that hangs is the hard time limit's.
ABORT_WAIT_S = 10.0

@dataclass
class InFlight:
    """A claimed job: its page being prepared, then in the engine."""

    claim: ledger.Claim
    claimed_s: float  # perf_counter when its claim started
    page: Future[PreparedJob]
    handed_over: bool = False


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
        self._steps = StepLog(process.ledger_threads, loaded)
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
                        self._steps.write()
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
            except Exception as exc:  # its result could not be built: this job alone fails, the batch goes on
                log.exception("job %s: its result could not be built", job.claim.job_id)
                self._fail_alone(job, exc)
        self._steps.write(when_full=True)

    def _fail_batch(self, exc: Exception) -> None:
        """(The engine's thread.) Every job in flight fails (an attempt each; a new message for each one
        retried: their own were acknowledged) and the batch is over."""
        with self._changed:
            jobs = list(self.jobs.values())
            self.jobs.clear()
            self.failed = exc
            self._changed.notify_all()
        again = [job_id for job in jobs if (job_id := self._fail(job, exc)) is not None]
        self._steps.write()  # those taken; the rest go with the engine
        self._pages.shutdown(wait=False, cancel_futures=True)
        self.process.send_again(again)

    def _take_steps(self, events: StepEvents) -> None:
        """The engine's steps read back in the call that returned `events`, each with the runs it served."""
        records = list(self.engine.steps)
        self.engine.steps.clear()  # so that it does not grow with the batch's life
        with self._changed:
            run_of = {job_id: job.claim.run_id for job_id, job in self.jobs.items()}
        self._steps.take(records, events, run_of)

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
        """Its result, built here (a result that cannot be built fails this job alone), written on the
        results thread. Its TTFT runs from its claim, on the same perf_counter clock as its tokens."""
        from dsocr_workers.engine.session import DeviceRun

        loaded = self.loaded
        result = DeviceRun.batched(loaded.session, job.page.result(), output, ttft_from_s=job.claimed_s).finish()
        ran = Ran(result, loaded.worker_id, loaded.worker_session_id, device=self.process.device)
        self.process.ledger_threads.complete(job.claim, partial(result_row, ran, job.claim, job.claimed_s), utcnow())
        log.info("job %s: decoded in the batch (%d tokens, %s, mean occupancy %.1f)", job.claim.job_id,
                 len(output.token_ids), output.stop_reason, output.metrics.mean_occupancy or 1.0)  # fmt: skip
