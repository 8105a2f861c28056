"""Jobs of a run with `--concurrency N` above 1, up to N in flight on the batched engine (engine/batched/).
A job's task claims it, hands its page to the page-preparing processes (farm/job/page_processes.py: off
this process's GIL, which the engine's thread launches under), waits while N jobs are in flight and
returns, so the lane's next message joins the batch. The engine's own thread (`_serve`), the only one on
the device, steps while it has work; each result is written on the results thread, as a batch-1 job's.
A `--profile N` run's engine samples its steps under torch.profiler (engine/profiling.py `StepSample`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from dsocr_workers.engine.stopping import StopRule
from dsocr_workers.farm.job.batch_steps import StepLog
from dsocr_workers.farm.job.claims import job_failed
from dsocr_workers.farm.job.execute import Ran, result_row
from dsocr_workers.farm.job.loaded import JobHost, OpenModel
from dsocr_workers.farm.job.page_processes import PageProcesses
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.store import ledger
from dsocr_workers.store.models import utcnow

if TYPE_CHECKING:  # the engine imports torch: the lane's parent imports this module and never torch
    from dsocr_workers.engine.batched import BatchedEngine, BatchedOutput
    from dsocr_workers.engine.coldstart.warmup import BatchedStart
    from dsocr_workers.engine.profiling import StepProfiler
    from dsocr_workers.engine.session import PreparedJob

log = logging.getLogger("dsocr.worker")

# An interrupted task's wait for the engine's thread to fail the batch: a step or two.
ABORT_WAIT_S = 10.0


@dataclass
class InFlight:
    """A claimed job (its claim began at `claimed_s`): its page being prepared, then in the engine."""

    claim: ledger.Claim
    claimed_s: float
    page: Future[PreparedJob]
    stop: StopRule  # its run's: how its page stops before the budget
    handed_over: bool = False


def engine_side(options: RunOptions) -> RunOptions:
    """What of a run's options its batched engine computes: not its repeats, nor its pages' stop rule
    (each page brings its own: `PageRequest.stop`)."""
    return replace(options, repeats=1, ignore_eos=False, stop_on_repetition=False)


class BatchedJobs:
    """The batched engine of one run's settings in a job process, and the jobs it holds."""

    def __init__(
        self,
        process: JobHost,
        loaded: OpenModel,
        options: RunOptions,
        engine: BatchedEngine,
        started: BatchedStart,
        pages: PageProcesses,
        pages_started: bool,
    ) -> None:
        """`engine`: started for `options`, as `started` says; `pages`: the process's page-preparing
        processes, ready, started with this batch or (`pages_started` False) an earlier one (`start`)."""
        self.process, self.loaded, self.options, self.engine, self.started = process, loaded, options, engine, started
        self.jobs: dict[str, InFlight] = {}  # in claim order
        self._pages, self._pages_started = pages, pages_started
        self._steps = StepLog(process.ledger_threads, loaded, self._profiler(options))
        # The ledger threads start no claim or write while the engine launches prefills (`LedgerThreads.hold`).
        engine.around_prefills(process.ledger_threads.hold, process.ledger_threads.release)
        # Guards `jobs` and the flags below; notified when one changes or a page is prepared.
        self._changed = threading.Condition()
        self.failed: Exception | None = None  # what failed every job in flight: the batch is over
        self._idle = True  # the engine's thread found nothing to do (its steps read back and handed over)
        self._stopping = False
        self._abandoned = False  # stop between two steps, the jobs in flight left unfinished
        self._aborted: Exception | None = None  # met by a waiting task (its soft time limit): fail the batch
        self._engine_thread = threading.Thread(target=self._serve, name="dsocr-batch-engine", daemon=True)
        self._engine_thread.start()

    @classmethod
    def start(cls, process: JobHost, loaded: OpenModel, options: RunOptions) -> BatchedJobs:
        """The batched engine for a run with `options`, started on its warm model (its step per bucket
        captured, from the packages built for its concurrency where there are), with the process's
        page-preparing processes (`JobHost.pages_for`), started meanwhile unless an earlier batch on the
        model did: ready before the batch is."""
        from dsocr_workers.engine.coldstart.warmup import start_batched

        pages = process.pages_for(loaded.session)
        pages_started = pages.ready_ms is None
        engine, started = start_batched(
            loaded.session, options.concurrency, options.mode_name, options.max_new_tokens, options.decode_options,
            options.prompt, split_prefill=options.split_prefill,
        )  # fmt: skip
        pages.wait_ready()
        return cls(process, loaded, options, engine, started, pages, pages_started)

    def _profiler(self, options: RunOptions) -> StepProfiler | None:
        """A `--profile N` run's: every N-th step of each kind under torch.profiler (`StepSample`)."""
        if options.profile_every is None:
            return None
        from dsocr_workers.engine.profiling import StepProfiler, StepSample

        profiler = StepProfiler(self.loaded.session.device, StepSample(options.profile_every))
        self.engine.profile_steps(profiler)
        return profiler

    def describe(self) -> str:
        """Its start, for the worker session that records it."""
        pages = self._pages.describe() + ("" if self._pages_started else " (started earlier on this model)")
        return f"{self.started.describe()}; {pages}"

    def serves(self, options: RunOptions) -> bool:
        """Whether a job of a run with `options` can join this batch (not one that a failed step ended):
        what the engine computes is the same (a run's repeats and its page's stop rule are not)."""
        return engine_side(options) == engine_side(self.options) and self.failed is None

    def add(self, claim: ledger.Claim, claimed_s: float, options: RunOptions) -> None:
        """Hand the job (of a run with `options`, which this batch `serves`) to the page-preparing
        processes; it joins the engine once its page is back."""
        session = self.loaded.session
        page = self._pages.submit(str(claim.image_path), options.prompt, options.mode_name,
                                  session.new_clock(claim.job_id, marks_steps=False))
        stop = StopRule.of(options.decode_options)
        with self._changed:
            self.jobs[claim.job_id] = InFlight(claim, claimed_s, page, stop)
            self._idle = False
            self._changed.notify_all()
            log.info("job %s: in the batch, %d in flight", claim.job_id, len(self.jobs))
        page.add_done_callback(lambda _: self._notify())

    def wait_for_room(self) -> None:
        """Wait until fewer than the run's concurrency are in flight: room for the lane's next job."""
        self._wait(lambda: len(self.jobs) < self.options.concurrency)

    def drain(self) -> None:
        """Wait until every job in flight is finished and every step launched read back and handed over."""
        self._wait(lambda: not self.jobs and self._idle)

    def _wait(self, done: Callable[[], bool]) -> None:
        """Wait until `done()` or the batch failed; interrupted (a soft time limit), fail the batch first."""
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
        """Finish the jobs in flight and stop the engine's thread (the page-preparing processes are the
        job process's: the next batch on the model takes them over)."""
        self.drain()
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._engine_thread.join()

    def abandon(self) -> None:
        """Stop the engine's thread between two steps: its jobs stay this process's to hand back, their
        pages not prepared yet are dropped."""
        with self._changed:
            self._abandoned = True
            self._changed.notify_all()
            pages = [job.page for job in self.jobs.values()]
        for page in pages:
            page.cancel()
        self._engine_thread.join(timeout=ABORT_WAIT_S)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _serve(self) -> None:
        """The engine's thread: steps while the engine has work or a prepared page waits, else waits."""
        while True:
            with self._changed:
                while not (self._stopping or self._abandoned or self._aborted or self._has_work()):
                    if not self._idle:
                        self._fail_lost()
                        self._steps.write()
                        self._idle = True
                        self._changed.notify_all()
                    self._changed.wait()
                aborted = self._aborted
                if self._abandoned or (aborted is None and not self._has_work()):  # stopping, nothing left
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
        """(The engine's thread.) Prepared pages in, one step, results out; a step that raises ends all."""
        self._hand_over()
        if not self.engine.busy:
            return
        try:
            events = self.engine.step()
            with self._changed:  # before the finished jobs leave `jobs`: their runs name the steps
                run_of = {job_id: job.claim.run_id for job_id, job in self.jobs.items()}
            self._steps.take(self.engine.steps, events, run_of)
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
        """(The engine's thread.) Every job in flight fails, an attempt each, and the batch is over."""
        with self._changed:
            jobs = list(self.jobs.values())
            self.jobs.clear()
            self.failed = exc
            self._changed.notify_all()
        again = [job_id for job in jobs if (job_id := self._fail(job, exc)) is not None]
        self._steps.write()  # those taken; the rest go with the engine
        for job in jobs:
            job.page.cancel()  # dropped unless a process has it already
        self.process.send_again(again)

    def _fail_lost(self) -> None:
        """(Under `_changed`, idle.) Jobs an engine with nothing left still holds fail: `drain` must end."""
        for job_id, job in [(job_id, job) for job_id, job in self.jobs.items() if job.handed_over]:
            self.jobs.pop(job_id)
            log.error("job %s: the batched engine finished without its output", job_id)
            self._fail_alone(job, RuntimeError("the batched engine finished without this job's output"))

    def _fail(self, job: InFlight, exc: Exception) -> str | None:
        """Record the job's failure; its id if it is queued again and so needs a new message."""
        outcome = job_failed(self.process.db, job.claim, exc, self.process.settings)
        log.info("job %s: %s %s", outcome.job_id, outcome.status, outcome.detail)
        return outcome.job_id if outcome.retry_in_s is not None else None

    def _fail_alone(self, job: InFlight, exc: Exception) -> None:
        self.process.send_again([again] if (again := self._fail(job, exc)) else [])

    def _hand_over(self) -> None:
        """Prepared pages into the engine; a page not prepared or fitting no slot fails its job alone."""
        from dsocr_workers.engine.batched import PageRequest

        with self._changed:
            ready = [(i, job) for i, job in self.jobs.items() if not job.handed_over and job.page.done()]
        for job_id, job in ready:
            try:
                self.engine.submit(PageRequest(job_id, job.page.result().page, self.options.max_new_tokens,
                                               stop=job.stop))  # fmt: skip
            except Exception as exc:
                with self._changed:
                    self.jobs.pop(job_id)
                    self._changed.notify_all()
                self._fail_alone(job, exc)
            else:
                job.handed_over = True

    def _finished(self, job: InFlight, output: BatchedOutput) -> None:
        """Its result, built here (or its job alone fails), written on the results thread."""
        from dsocr_workers.engine.session import DeviceRun

        loaded = self.loaded
        run = DeviceRun.batched(loaded.session, job.page.result(), output, ttft_from_s=job.claimed_s)
        ran = Ran(run.finish(), loaded.worker_id, loaded.worker_session_id, device=self.process.device)
        build_row = partial(result_row, ran, job.claim, job.claimed_s, self.process.score)
        self.process.ledger_threads.complete(job.claim, build_row, utcnow())
        log.info("job %s: decoded in the batch (%d tokens, %s, mean occupancy %.1f)", job.claim.job_id,
                 len(output.token_ids), output.stop_reason, output.metrics.mean_occupancy or 1.0)
