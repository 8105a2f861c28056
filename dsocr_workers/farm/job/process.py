"""The process that runs jobs: a Celery prefork child (one per device) or `dsocr run` itself.

It owns one device, one ledger connection (opened in this process, after fork) and one loaded model,
kept while consecutive jobs ask for the same model settings (model, dtype, engine, seed). The model is
loaded and warmed before a job is claimed (farm/job/warm.py), and each time that happens a
`worker_sessions` row records what it cost; the jobs run afterwards point at that row. While a job has
the device, the page of the job that comes next is prepared on a thread (farm/job/prefetch.py); a
Celery child's claims and results are written on another, off the path between two jobs
(farm/job/ledger_threads.py).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.farm.job.execute import Claiming, Ran
from dsocr_workers.farm.job.fingerprint import environment_fingerprint
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.job.loaded import LoadedSession
from dsocr_workers.farm.job.prefetch import PageRequest, Prefetcher, Upcoming
from dsocr_workers.farm.job.warm import DEFAULT_NGRAM, Warmup
from dsocr_workers.farm.liveness import Heartbeat, Sweep
from dsocr_workers.farm.owners import process_owner
from dsocr_workers.farm.run_options import ModelKey, NGram, RunOptions
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, database_for
from dsocr_workers.store.models import Job, Run, Worker, WorkerSession, utcnow
from dsocr_workers.store.upsert import upsert

if TYPE_CHECKING:
    from dsocr_workers.engine.coldstart.helpers import CompileHelpers
    from dsocr_workers.farm.job.batched import BatchedJobs

log = logging.getLogger("dsocr.worker")


def ngram_options(ngram: NGram) -> DecodeOptions:
    """The decode options a warm-up of jobs with this n-gram ban runs with: the same in the helpers'
    plan and in the warm-up, or the helpers compile another decode step."""
    return DecodeOptions(no_repeat_ngram_size=ngram[0], ngram_window=ngram[1])


def fork_compile_helpers(warmup: Warmup, runs_on: str) -> CompileHelpers | None:
    """The compile helpers of the start-up warm-up's first part (its modes at its first token budget and
    n-gram ban: what `JobProcess.warm` warms first), forked before this child loads its model, opens its
    ledger or starts a thread (engine/coldstart/helpers.py): they compile while it loads. None where the
    engine compiles nothing or this child cannot fork them; its warm-up then decides for itself."""
    from dsocr_workers.engine.coldstart.helpers import start_helpers

    try:
        return start_helpers(warmup.key.model, runs_on, warmup.key.dtype, warmup.key.engine, warmup.modes,
                             warmup.budgets[0], ngram_options(warmup.ngrams[0]))  # fmt: skip
    except Exception:  # a bad model or setting: the warm-up meets it again and says so
        log.warning("could not start the compile helpers before the load", exc_info=True)
        return None


def settle_heap() -> None:
    """Once the model is loaded and warm: collect, then freeze what survives, so that no later collection
    scans it again. A load and a warm-up leave about a million long-lived objects (dynamo's and
    inductor's caches, compiled graphs, the model); the first full collection after them came a dozen
    jobs into a run and held the child for ~0.6 s (an H200: a run's one device idle gap over 10 ms, and
    a full collection after ready 0.4-0.7 s, docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()


def unwarmed(loaded: LoadedSession, warmup: Warmup) -> list[tuple[str, int | None, NGram]]:
    """The (mode, budget, n-gram ban) combinations of `warmup` that `loaded` has not warmed yet."""
    return [(mode, budget, ngram) for budget in warmup.budgets for ngram in warmup.ngrams
            for mode in warmup.modes if (mode, budget, ngram) not in loaded.warmed]  # fmt: skip


@dataclass
class JobProcess:
    settings: Settings
    device: str  # as the ledger names it (heartbeats, worker sessions, results): the worker's --gpus index
    db: Database
    heartbeat: Heartbeat
    owner: str
    prefetcher: Prefetcher
    ledger_threads: LedgerThreads
    runs_on: str = ""  # the device in this process (see_only_this_gpu); `device` where empty
    loaded: LoadedSession | None = None
    batch: BatchedJobs | None = None  # jobs of a run with concurrency above 1 in flight (farm/job/batched.py)

    @classmethod
    def open(
        cls, settings: Settings, device: str, *, queues: tuple[str, ...], sweep: Sweep | None = None,
        cpu_threads: int | None = None, runs_on: str = "",
    ) -> JobProcess:  # fmt: skip
        """Open the ledger and start beating (farm/liveness.py): from here on this process renews the
        leases it holds and, given a `sweep`, requeues the jobs of dead workers on its queues. `runs_on`:
        the device as this process sees it, where that is not `device` (see_only_this_gpu)."""
        if cpu_threads:
            import torch

            torch.set_num_threads(cpu_threads)
        db, owner = database_for(settings.database_url), process_owner()
        heartbeat = Heartbeat(db, owner, settings, device=device, queues=queues, sweep=sweep)
        heartbeat.start()
        return cls(settings=settings, device=device, db=db, heartbeat=heartbeat, owner=owner,
                   prefetcher=Prefetcher(db), ledger_threads=LedgerThreads(db, let_go=heartbeat.let_go),
                   runs_on=runs_on or device)  # fmt: skip

    def close(self) -> None:
        self.end_batch()  # its jobs finish and their results are written before the threads stop
        self.ledger_threads.close()  # before the heartbeat stops: the leases of the results it writes stay renewed
        self.prefetcher.close()
        try:  # a clean stop: the reserved jobs' messages go back with this process's worker (kombu restores them)
            with self.db.transaction() as tx:
                ledger.drop_reservations(tx, self.owner)
        except Exception:  # the ledger is down: the reservation runs out and a sweep brings the job back
            log.warning("could not drop the reservation of %s", self.owner, exc_info=True)
        self.heartbeat.stop()
        self.db.dispose()
        gc.unfreeze()

    def is_warm(self, warmup: Warmup) -> bool:
        """Whether `warm(warmup)` would do nothing: its model loaded, every mode and budget warmed."""
        loaded = self.loaded
        return loaded is not None and loaded.key == warmup.key and not unwarmed(loaded, warmup)

    def warm(self, warmup: Warmup, helpers: CompileHelpers | None = None) -> LoadedSession:
        """Load `warmup.key` unless it is loaded, run the warm-up of whatever mode and budget it has not
        met yet, and record the cost as a new worker session. A no-op when all is warm already.
        `helpers`: the compile helpers forked for this warm-up (`fork_compile_helpers`), handed to its
        first part; stopped if the load fails."""
        from dsocr_workers.engine.coldstart.warmup import warm as run_warmup

        began_at, began = utcnow(), time.perf_counter()
        load_ms = 0.0
        if self.loaded is None or self.loaded.key != warmup.key:
            gc.unfreeze()  # the previous model's objects may be collected again (settle_heap)
            self.loaded = None  # free the previous model before loading the next one
            try:
                self.loaded = self._load(warmup.key)
            except BaseException:
                if helpers is not None:
                    helpers.stop()
                raise
            load_ms = (time.perf_counter() - began) * 1e3
        loaded = self.loaded
        missing = unwarmed(loaded, warmup)
        if not missing and not load_ms:
            return loaded
        warmup_ms, shapes, cold_start = 0.0, [], []
        for budget, ngram in dict.fromkeys((budget, ngram) for _, budget, ngram in missing):
            modes = [mode for mode, b, n in missing if (b, n) == (budget, ngram)]
            report = run_warmup(loaded.session, modes, max_new_tokens=budget, infer=ngram_options(ngram), helpers=helpers)
            helpers = None
            warmup_ms += report.ms
            if report.artifacts:  # prebuilt artifacts used, or why not (logged by the warm-up)
                cold_start.append(report.artifacts)
            if report.still_cold:  # the first jobs may be stored cold: say why here, once
                log.warning("warm-up of %s stopped after %d passes still meeting: %s", ", ".join(modes),
                            report.passes, "; ".join(report.still_cold))  # fmt: skip
            ban = "" if ngram == DEFAULT_NGRAM else f", no-repeat {ngram[0]}-grams" + (f" in {ngram[1]}" if ngram[1] else "")
            shapes += [f"{shape} ({budget or 'max'} tokens{ban})" for shape in report.shapes]
            loaded.warmed.update((mode, budget, ngram) for mode in modes)
        settling = time.perf_counter()
        settle_heap()
        warmup_ms += (time.perf_counter() - settling) * 1e3
        self._new_session(loaded, "; ".join([", ".join(shapes), *cold_start]), began_at, load_ms, warmup_ms)
        return loaded

    def _new_session(self, loaded: LoadedSession, warmup: str, began_at: datetime, load_ms: float,
                     warmup_ms: float) -> None:  # fmt: skip
        """Record what was just loaded or warmed as a new worker session, ready now: the jobs after it
        point at it, and the report counts them from its `ready_at` on."""
        if not self.heartbeat.registered:  # its first beat met a ledger outage
            self.heartbeat.beat()
        row = WorkerSession(
            id=uuid.uuid4().hex, worker_id=loaded.worker_id, worker_process_id=self.owner,
            host=socket.gethostname(), pid=os.getpid(),
            device=self.device, model=loaded.key.model, engine=loaded.session.engine,
            dtype=str(loaded.session.dtype).removeprefix("torch."), warmup=warmup,
            started_at=began_at, load_ms=load_ms, warmup_ms=warmup_ms, ready_at=utcnow(), last_seen_at=utcnow(),
        )  # fmt: skip
        with self.db.transaction() as tx:
            tx.add(row)
        loaded.worker_session_id = row.id

    def _load(self, key: ModelKey) -> LoadedSession:
        from dsocr_workers.engine.session import DeepSeekOCRSession

        session = DeepSeekOCRSession.from_local(
            key.model, device=self.runs_on or self.device, dtype=key.dtype, engine=key.engine, seed=key.seed
        )
        fingerprint = environment_fingerprint(self.device, session.source, runs_on=self.runs_on)
        with self.db.transaction() as tx:
            upsert(tx, Worker, {**fingerprint, "last_seen": utcnow()}, ["id"], ["last_seen"])
        return LoadedSession(key, session, fingerprint["id"], worker_session_id="")

    def reserve(self, job_id: str) -> None:
        """Name this process on `job_id`, which its worker fetched for it next (store/ledger.py `reserve_job`)."""
        with self.db.transaction() as tx:
            ledger.reserve_job(tx, job_id, self.owner, lease_s=self.settings.lease_s)

    def prepare_for(self, job_id: str) -> RunOptions | None:
        """Before the claim: load and warm what this job's run needs, so the job does not pay for it;
        jobs in flight in a batch its run cannot join finish first. Returns the run's options; None for
        a job that is gone or unknown (left to the claim to refuse) or whose run could not be read. The
        run of a job whose page was prefetched was read with it: no ledger round trip between two jobs."""
        try:
            run: Any = self.prefetcher.job(job_id)  # a WaitingJob or a row: both have .model, .parameters
            if run is None:
                with self.db.transaction() as tx:
                    run = tx.execute(select(Run.model, Run.parameters).join(Job).where(Job.id == job_id)).first()
            options = None if run is None else RunOptions.from_parameters(run.model, run.parameters)
        except Exception:  # a ledger outage, a run's bad options: the job's own path meets it again and records it
            log.warning("job %s: could not read its run before the claim", job_id, exc_info=True)
            return None
        if options is None:
            return None
        warmup = job_warmup(options)
        new_batch = options.concurrency > 1 and (self.batch is None or not self.batch.serves(options))
        if new_batch or not self.is_warm(warmup):
            # Minutes of loading or compiling before the claim: the job is named on, or a sweep would
            # take its message back as one a dead worker held (farm/liveness.py).
            try:
                self.reserve(job_id)
            except Exception:
                log.warning("job %s: could not reserve it before its warm-up", job_id, exc_info=True)
        try:
            if self.batch is not None and not self.batch.serves(options):
                self.end_batch()
            self.warm(warmup)
            if options.concurrency > 1:  # its slots (and on a GPU its graphs per bucket) before the claim too
                self.batch_for(options)
        except Exception:  # a bad model or mode, a KV cache that cannot fit: the job's own path meets it again
            log.warning("job %s: could not prepare its model before the claim", job_id, exc_info=True)
        return options

    def batch_for(self, options: RunOptions) -> BatchedJobs:
        """The batched engine for jobs of a run with `options` (concurrency above 1), started on its model.
        Starting it (its KV cache; on a GPU its step compiled and captured per bucket: a minute or more)
        is a warm-up: recorded as a new worker session, so no job's time and no throughput holds it."""
        from dsocr_workers.farm.job.batched import BatchedJobs

        if self.batch is not None and self.batch.serves(options):
            return self.batch
        self.end_batch()
        loaded = self.loaded
        if loaded is None or loaded.key != options.model_key:
            loaded = self.warm(Warmup(options.model_key, ()))
        began_at, began = utcnow(), time.perf_counter()
        batch = self.batch = BatchedJobs(self, loaded, options)
        self._new_session(loaded, f"batched engine: {batch.describe()}", began_at, 0.0,
                          (time.perf_counter() - began) * 1e3)  # fmt: skip
        return batch

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

    def infer(self, claiming: Claiming, upcoming: Upcoming | None = None) -> Ran:
        """Run a job once its claim is written: on the page prefetched for it, if there is one, else on a
        page prepared here. `upcoming` names the job that comes next, whose page is prepared while
        this one runs. A prefetched job whose claim is still under way (farm/job/ledger_threads.py) starts on
        the device at once, from what the prefetch read of its job (a run's settings and a job's image
        never change), and waits for its claim once its prefill is queued: a refused claim (Refused)
        drops the prefill, and nothing of it is recorded."""
        import torch  # the worker's parent imports this module and never torch

        from dsocr_workers.engine.profiling import JobProfiler

        prefetched = self.prefetcher.take_job(claiming.job_id)
        early = (prefetched is not None and not claiming.claim.done() and not isinstance(prefetched.outcome, Exception)
                 and self.loaded is not None and self.loaded.key == prefetched.request.model)  # fmt: skip
        if prefetched is not None and early:
            options = RunOptions.from_parameters(prefetched.job.model, prefetched.job.parameters)
            profile = prefetched.job.profile
        else:
            claim = claiming.result()
            options = RunOptions.from_parameters(claim.model, claim.parameters)
            profile = claim.profile
            request = PageRequest.of_job(claim.job_id, claim.image_path, options)
            if prefetched is not None and prefetched.request != request:
                prefetched = None
        loaded = self.loaded
        if loaded is None or loaded.key != options.model_key:
            # Warmed before the claim (`prepare_for`); a run that changed its mind since is loaded here
            # and not warmed: the job runs cold and is stored with its reasons, the job path never warms.
            loaded = self.warm(Warmup(options.model_key, ()))

        def prefetch_next() -> None:
            if upcoming is not None:
                self.prefetcher.start(upcoming, loaded.key, loaded.session)

        try:
            prepared = prefetched.page() if prefetched is not None else loaded.session.prepare_job(
                str(claim.image_path), request.prompt, request.mode, job_id=claim.job_id
            )  # fmt: skip
        except Exception:
            prefetch_next()  # while this job's failure is recorded
            raise
        # The device's part only, step by step: the host's part (the text, the timings) is done where the
        # result row is built, on a Celery child's results thread while the device runs the next job.
        session = loaded.session
        # A profiled job (submit's --profile) runs under torch.profiler from its setup to its readback; the
        # trace and the kernels per stage are made with its result, off the device's path.
        profiler = JobProfiler(session.device) if profile else None
        running = session.start_on_device(prepared.page, options.max_new_tokens, options.decode_options,
                                          prepared.clock, profiler=profiler)  # fmt: skip
        with running.stopping_profiler_on_error(), torch.inference_mode():
            session.prefill(running.job, running.clock)
            # Once the prefill is queued, the next page's preparation starts: its thread's start must not
            # hold the GIL between this job's claim and its start on the device. A job started before its
            # claim was written waits for it here, before its first decode step (the decode runs under
            # the job's lease); refused or not, the next page is prepared meanwhile.
            try:
                claiming.result()
            finally:
                prefetch_next()
            session.decode(running.job, running.clock)
        return Ran(session.finish_on_device(running), loaded.worker_id, loaded.worker_session_id,
                   prefetched=prefetched is not None, device=self.device)  # fmt: skip


def job_warmup(options: RunOptions) -> Warmup:
    """What one job needs warm: its run's model, mode, token budget and n-gram ban."""
    return Warmup(options.model_key, (options.mode,), (options.max_new_tokens,), (options.ngram,))
