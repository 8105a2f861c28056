"""The process that runs jobs: a Celery prefork child (one per device) or `dsocr run` itself.

It owns one device, one ledger connection (opened in this process, after fork) and one open model
(`models`, farm/job/opening.py), opened before a job's claim and never by a job. While a job has the
device, the page of the job that comes next is prepared ahead (farm/job/prefetch.py); a Celery child's
claims and results are written on threads (farm/job/ledger_threads.py). On a GPU, pages are prepared in
processes of their own (farm/job/page_processes.py): batched jobs' pages and batch-1 jobs' prefetched
ones, the processes started with the first batched engine or prefetch on a model and kept for the next
ones on it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dsocr_workers.errors import TransientError
from dsocr_workers.farm.job.batched import BatchedJobs
from dsocr_workers.farm.job.execute import Claiming, Ran
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.job.loaded import OpenModel
from dsocr_workers.farm.job.opening import ModelOpener, NotOpen
from dsocr_workers.farm.job.page_processes import PageProcesses, default_processes
from dsocr_workers.farm.job.prefetch import PagePlan, Prefetcher, Upcoming
from dsocr_workers.farm.job.scoring_process import ScoringProcess
from dsocr_workers.farm.job.warm import Warmup
from dsocr_workers.farm.liveness import Heartbeat, Sweep
from dsocr_workers.farm.owners import process_owner
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, database_for

log = logging.getLogger("dsocr.worker")


@dataclass
class JobProcess:
    settings: Settings
    device: str  # as the ledger names it (heartbeats, worker sessions, results): the worker's --gpus index
    db: Database
    heartbeat: Heartbeat
    owner: str
    prefetcher: Prefetcher
    ledger_threads: LedgerThreads
    models: ModelOpener
    batch: BatchedJobs | None = None  # jobs of a run with concurrency above 1 in flight (farm/job/batched.py)
    # The page-preparing processes (`pages_for`) of the open model: a batch's start takes them over from
    # the batch or prefetches before it on the same model, so it pays no second start of theirs.
    pages: PageProcesses | None = None
    # Accuracy against a job's reference, in a process started at the first one (scoring_process.py).
    score: ScoringProcess = field(default_factory=ScoringProcess)

    @classmethod
    def open(
        cls,
        settings: Settings,
        device: str,
        *,
        queues: tuple[str, ...],
        sweep: Sweep | None = None,
        cpu_threads: int | None = None,
        runs_on: str = "",
        import_ms: float | None = None,
    ) -> JobProcess:
        """Open the ledger and start beating (farm/liveness.py): from here on this process renews the
        leases it holds and, given a `sweep`, requeues the jobs of dead workers on its queues. `runs_on`:
        the device as this process sees it, where that is not `device` (see_only_this_gpu); `import_ms`:
        what its start spent importing (farm/celery/preimport.py), recorded with its first model."""
        if cpu_threads:
            import torch

            torch.set_num_threads(cpu_threads)
        db, owner = database_for(settings.database_url), process_owner()
        heartbeat = Heartbeat(db, owner, settings, device=device, queues=queues, sweep=sweep)
        heartbeat.start()

        def register() -> None:  # its first beat may have met a ledger outage
            if not heartbeat.registered:
                heartbeat.beat()

        return cls(
            settings=settings,
            device=device,
            db=db,
            heartbeat=heartbeat,
            owner=owner,
            prefetcher=Prefetcher(db),
            ledger_threads=LedgerThreads(db, let_go=heartbeat.let_go, holds=device.startswith("cuda")),
            models=ModelOpener(db, owner, device, runs_on or device, register, import_ms=import_ms),
        )

    def close(self, *, hand_back: bool = False) -> None:
        """Stop: the batch's jobs finish first. `hand_back`: this process stops before its jobs end
        (`dsocr run` interrupted): the batch stops between two steps, and once the claims and results
        under way are written, every job it still holds goes back in line, its attempt not counted."""
        if hand_back and self.batch is not None:
            self.batch.abandon()
            self.batch = None
        self.end_batch()  # its jobs finish and their results are written before the threads stop
        # Before the heartbeat stops: the leases of the results it writes stay renewed.
        self.ledger_threads.close()
        self.score.close()  # after the results: their rows are scored
        self.prefetcher.close()  # before the processes: a prefetch waiting on them gets its page
        if self.pages is not None:
            self.pages.kill() if hand_back else self.pages.close()
            self.pages = None
        # A clean stop: the reserved jobs' messages go back with this process's worker (kombu restores them).
        try:
            with self.db.transaction() as tx:
                ledger.drop_reservations(tx, self.owner)
                if hand_back:
                    ledger.release_held(tx, self.owner)
        except Exception:  # the ledger is down: the reservation runs out and a sweep brings the job back
            log.warning("could not drop the reservation of %s (or hand back its jobs)", self.owner, exc_info=True)
        self.heartbeat.stop()
        self.db.dispose()
        gc.unfreeze()

    def reserve(self, job_id: str) -> None:
        """Name this process on `job_id`, which its worker fetched for it next (store/ledger.py
        `reserve_job`), once the ledger threads are not held: a lane fetches a message as its child starts
        the one before, so the reservation's Python would otherwise run beside that job's launches."""
        self.ledger_threads.wait_while_held()
        with self.db.transaction() as tx:
            ledger.reserve_job(tx, job_id, self.owner, lease_s=self.settings.lease_s)

    def prepare_for(self, job_id: str) -> RunOptions | None:
        """Before the claim: open the model (and batch) this job's run needs, so the job does not pay for
        it; jobs in flight in a batch its run cannot join finish first. Returns the run's options; None
        for a job that is gone or unknown (left to the claim to refuse) or whose run's options are bad.
        Raises TransientError when the ledger is out of reach."""
        try:
            options = self.prefetcher.run_of(job_id)
        except TransientError:  # the ledger out of reach: the task is retried, a batch in flight goes on
            raise
        except Exception:  # a run's bad options: the job's own path meets them again and records them
            log.warning("job %s: could not read its run before the claim", job_id, exc_info=True)
            return None
        if options is None or options.concurrency > 1 or not self.models.is_warm_for(options):
            # The previous job's held writes (`infer`) wait for a warm batch-1 job's launches alone.
            self.ledger_threads.release()
        if options is None:
            return None
        new_batch = options.concurrency > 1 and (self.batch is None or not self.batch.serves(options))
        if new_batch or not self.models.is_warm_for(options):
            # Minutes of loading or compiling before the claim: the job is named on, or a sweep would
            # take its message back as one a dead worker held (farm/liveness.py).
            try:
                self.reserve(job_id)
            except Exception:
                log.warning("job %s: could not reserve it before its warm-up", job_id, exc_info=True)
        try:
            if self.batch is not None and not self.batch.serves(options):
                self.end_batch()
            self.models.warm_for(options)
            if new_batch:  # its slots (and on a GPU its graphs per bucket) before the claim too
                self.start_batch(options)
        except Exception:  # a bad model or mode, a KV cache that cannot fit: the job fails with it
            log.warning("job %s: could not prepare its model before the claim", job_id, exc_info=True)
        return options

    def warm_at_start(self, warmup: Warmup) -> OpenModel:
        """The start-up warm-up (`warmup`), recorded as one worker session; a worker serving a concurrency
        (`warmup.concurrency` above 1) starts its batched engine in it too, so its first batched job is
        warm. A batched engine that does not start is logged and recorded: batch-1 jobs still run. The
        page-preparing processes (a batched engine's, a GPU's prefetches) start once the model is loaded,
        beside the warm-up, rather than after it."""

        def start_pages(loaded: OpenModel) -> None:
            if warmup.concurrency > 1 or loaded.session.device.type == "cuda":
                self.pages_for(loaded.session)

        if warmup.concurrency == 1:
            return self.models.warm(warmup, on_load=start_pages)
        options = warmup.batch_options()

        def start_batch(loaded: OpenModel) -> str:
            try:
                self.batch = BatchedJobs.start(self, loaded, options)
            except Exception as exc:
                self.models.failures[options] = exc
                log.exception("the batched engine for concurrency %d did not start", options.concurrency)
                return f"batched engine for concurrency {options.concurrency} not started: {exc}"
            return self.batch.describe()

        return self.models.warm(warmup, start_batch, on_load=start_pages)

    def start_batch(self, options: RunOptions) -> None:
        """Start the batched engine for jobs of a run with `options` on its open model (its KV cache; on a
        GPU its step per bucket captured), recorded as a worker session."""
        loaded = self.models.opened(options.model_key)
        self.end_batch()
        self.batch = self.models.warm_up(options, loaded, lambda: BatchedJobs.start(self, loaded, options))

    def joinable_batch(self, options: RunOptions) -> BatchedJobs:
        """The batch a claimed job of a run with `options` joins, started before its claim; raises
        NotOpen, or why starting it failed."""
        self.models.opened(options.model_key)
        if self.batch is None or not self.batch.serves(options):
            raise self.models.failures.get(options) or NotOpen(f"no batched engine open for {options.model}")
        return self.batch

    def pages_for(self, session: Any) -> PageProcesses:
        """The page-preparing processes of `session`'s pages: those an earlier batch or prefetch on it
        started, else new ones (those of another model closed first), starting meanwhile
        (`PageProcesses.wait_ready`)."""
        if self.pages is not None and self.pages.serves(session):
            return self.pages
        if self.pages is not None:
            self.pages.close()
        self.pages = PageProcesses(session, default_processes())
        return self.pages

    def send_again(self, job_ids: list[str]) -> None:
        """New messages for jobs of this process put back in line without one (a failed batch's: their
        tasks returned, their messages were acknowledged), through the sweep's way of sending."""
        sweep = self.heartbeat.sweep
        if not job_ids or sweep is None:
            return
        try:
            with self.db.transaction() as tx:
                sweep.publish(tx, ledger.waiting_on_queues(tx, job_ids))
        except Exception:
            log.exception("jobs %s are queued with no message until `dsocr reconcile`", ", ".join(job_ids))

    def end_batch(self) -> None:
        """Finish the jobs in flight in the batched engine, if any, and drop it."""
        if self.batch is not None:
            self.batch.close()
            self.batch = None

    def infer(
        self, claiming: Claiming, upcoming: Upcoming | None = None, next_job_known: Callable[[], bool] | None = None
    ) -> Ran:
        """Run a claimed job on its open model (NotOpen if it is not), on its page prefetched or prepared
        here. A job prefetched before its claim is written starts at once: its claim is written once its
        prefill is queued, and the job waits for it before reading its output back (a refused claim drops
        what ran); the held writes and the next job's page (`upcoming`) follow the claim. When
        `next_job_known()` says a job follows, the ledger threads stay held after this one
        (`LedgerThreads.hold`)."""
        from dsocr_workers.engine.profiling import JobProfiler  # the worker's parent never imports torch

        job, prefetched = self.prefetcher.job_to_run(
            claiming, self.models.loaded_key, before_claim_wait=self.ledger_threads.release
        )
        options = RunOptions.from_parameters(job.model, job.parameters)
        loaded = self.models.opened(options.model_key)
        session = loaded.session
        # On a GPU the next page is prepared in processes: on the prefetch thread it would hold the GIL
        # that this job's launches wait for. On a CPU the host is the device either way. While the
        # processes start (seconds), the thread prepares it: a page never waits for their start.
        pages = self.pages_for(session) if upcoming and session.device.type == "cuda" else None
        if pages is not None and not pages.ready:
            pages = None
        prefetch_next = (
            partial(self.prefetcher.start, upcoming, loaded.key, session, pages) if upcoming else lambda: None
        )
        try:
            prepared = prefetched.page() if prefetched is not None else PagePlan.of_job(job).prepare(session)
        except Exception:
            prefetch_next()  # while this job's failure is recorded
            raise
        # The ledger threads wait while the setup and prefill are launched (`LedgerThreads.hold`). Then
        # the claim is written beside the decode's launches, which the device runs behind the prefill.
        self.ledger_threads.hold()

        def claim_then_writes(_: object) -> None:
            self.ledger_threads.release()
            prefetch_next()

        def before_decode() -> None:
            self.ledger_threads.let_claims_go()
            claiming.claim.add_done_callback(claim_then_writes)

        def before_readback() -> None:
            claiming.result()

        try:
            run = session.run_on_device(
                prepared.page,
                options.max_new_tokens,
                options.decode_options,
                prepared.clock,
                before_decode=before_decode,
                before_readback=before_readback,
                profiler=JobProfiler(session.device) if job.profile else None,
            )
        finally:
            self.ledger_threads.release()
        if next_job_known is not None and next_job_known():
            # This job's row (its CUDA events resolved), the next one's claim and reservation: Python that
            # would otherwise run beside the next job's setup.
            self.ledger_threads.hold()
        # A profiled job's trace is read and summed up here, before the next job starts: on the results
        # thread it would hold the GIL for tens of milliseconds while the next job's stages launch.
        return Ran(
            run.finish() if job.profile else run,
            loaded.worker_id,
            loaded.worker_session_id,
            prefetched=prefetched is not None,
            device=self.device,
        )
