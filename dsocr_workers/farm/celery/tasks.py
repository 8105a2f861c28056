"""The Celery task: a job id in, `execute_job` (or `run_in_batch`), and the retry it asks for. Thin on
purpose.

Each lane's prefork child takes its device from the `WorkerSpec` handed down by `dsocr worker`, so the
parent never touches CUDA; a child sees only its own GPU (`see_only_this_gpu`) and inherits the parent's
imports (farm/celery/preimport.py). The lane's parent tells its child which job it fetched for it next
(`NextMessage`): the child reserves it in the ledger and prefetches its page while the current job runs.
A child killed at the hard time limit cannot record anything, so the parent does
(`JobRequest.on_timeout`): the attempt is recorded and the job sent again after the backoff (or poisoned
at the cap) at once, rather than after its lease expires.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import UTC, datetime
from functools import partial

from billiard.process import current_process
from celery import shared_task
from celery.signals import task_received, worker_process_init, worker_process_shutdown
from celery.worker.request import Request
from sqlalchemy.orm import Session

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.celery.broker import delivered_messages, job_ids_held, take_back_messages
from dsocr_workers.farm.celery.messages import RUN_JOB, bring_back_job_messages
from dsocr_workers.farm.celery.preimport import import_for_jobs
from dsocr_workers.farm.celery.worker import handed_spec, refuse_to_work
from dsocr_workers.farm.devices import open_device, see_only_this_gpu
from dsocr_workers.farm.job.execute import execute_job, run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.liveness import Sweep
from dsocr_workers.farm.owners import owner_prefix_of_pid
from dsocr_workers.farm.retries import job_retry_in_s
from dsocr_workers.settings import CPU_THREADS, Settings, read
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database

log = logging.getLogger("dsocr.worker")

_process: JobProcess | None = None
_stopping = threading.Event()  # ends the child's thread that reserves its next jobs


@worker_process_init.connect
def _open_child(**_: object) -> None:
    global _process
    imported = import_for_jobs()  # nothing, when this child forked from `dsocr worker`'s warm parent
    spec = handed_spec()
    index = getattr(current_process(), "index", 0) or 0
    device = spec.device
    # Each child gets its share of the host's cores for torch's CPU threads (preprocessing, CPU decode):
    # with every child spinning a thread per core, N children would oversubscribe the host N-fold.
    threads = max(1, (os.cpu_count() or 1) // len(spec.slots))
    if (chosen := read(CPU_THREADS)) is not None:
        # An explicit OMP_NUM_THREADS wins (several workers on one host: each would divide all the cores).
        threads = max(1, chosen)
    queues, settings, plan = spec.queues, spec.settings, spec.warmup

    def bring_back(tx: Session, jobs: list[tuple[str, str]]) -> None:
        # Jobs taken back from a dead worker: its messages, back at the head of their queues.
        bring_back_job_messages(run_job.app, tx, jobs)

    runs_on = see_only_this_gpu(device)  # before anything here initialises CUDA
    try:
        open_device(runs_on)
    except InputError as exc:  # a child that cannot run a job takes none: the worker stops, saying why
        refuse_to_work(f"child {spec.lane} on {device}: {exc}")
    _process = JobProcess.open(
        settings,
        device,
        queues=queues,
        cpu_threads=threads,
        runs_on=runs_on,
        import_ms=imported.ms,
        sweep=Sweep(
            queues,
            bring_back,
            delivered=partial(delivered_messages, run_job.app, queues),
            take_back=partial(take_back_messages, run_job.app),
            held=partial(job_ids_held, settings.broker_url, settings.broker_key_prefix),
        ),
    )
    threading.Thread(
        target=spec.next_message.follow,
        args=(_process.reserve, _stopping),
        daemon=True,
        name="dsocr-next-message",
    ).start()
    seen = (
        f" (seen as {runs_on}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
        if runs_on != device
        else ""
    )
    parent = spec.preimported
    began = datetime.fromtimestamp(parent.began_at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    inherited = f"imports inherited ({parent.ms:.0f} ms in the worker's parent, begun at {began} UTC)"
    imports = f"imported {imported.modules} modules in {imported.ms:.0f} ms" if imported.modules else inherited
    log.info("child %s (pid %d) on %s%s; %s", index, os.getpid(), device, seen, imports)
    if plan is not None:
        # Before this child reports itself up, so before it is given a message (the pool waits for
        # it: `worker_proc_alive_timeout`, set by `dsocr worker`).
        try:
            loaded = _process.warm_at_start(plan)
        except Exception:  # each model is then loaded and warmed before its first job instead
            log.exception("child %s: the start-up warm-up failed", index)
        else:
            log.info(
                "child %s: %s warm (%s)",
                index,
                plan.key.model,
                ", ".join(sorted({m for m, _, _ in loaded.warmed})),
            )


@worker_process_shutdown.connect
def _close_child(**_: object) -> None:
    _stopping.set()
    if _process is not None:
        _process.close()


@task_received.connect
def _fetched(request: Request, **_: object) -> None:
    # In the lane's parent. A retry held for its countdown is not next: it runs when due (NextMessage).
    if request.name == RUN_JOB and request.eta is None:
        handed_spec().next_message.fetched(request.id)


# A custom Request (Task.Request) is Celery's documented hook. Its signals do not serve: nothing in the
# parent fires when the pool accepts, acks or gives back a message, and task_failure on a hard time
# limit carries no child pid to check the lease against.
class JobRequest(Request):
    """A job's request as the lane's parent process sees it."""

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        handed_spec().next_message.gone(self.id)
        super().on_accepted(pid, time_accepted)

    def acknowledge(self) -> None:
        handed_spec().next_message.gone(self.id)
        super().acknowledge()

    def reject(self, requeue: bool = False) -> None:
        handed_spec().next_message.gone(self.id)
        super().reject(requeue)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        # Called in the parent before billiard kills the child, so the child's lease is still its own.
        if not soft and self.worker_pid:
            job_id, queue = str(self.args[0]), self.delivery_info.get("routing_key")
            try:
                _record_hard_timeout(self.task, job_id, self.worker_pid, timeout, self.kwargsrepr, queue)
            except Exception:
                # The ledger is down: a job whose claim was not written would stay queued with no message
                # (Celery acknowledges this one), so it is sent again: a delivery too many is refused by
                # the claim, one too few is a job lost until `dsocr reconcile`.
                log.exception(
                    "job %s: could not record the hard time limit; its message is sent again", job_id
                )
                _send_again(self.task, job_id, self.kwargsrepr, queue, handed_spec().settings)
        super().on_timeout(soft, timeout)


def _record_hard_timeout(
    task: object, job_id: str, child_pid: int, limit_s: float, label: str | None, queue: str | None
) -> None:
    settings = handed_spec().settings
    # A short-lived engine, disposed at once: the parent forks replacement children, which must not
    # inherit an open database connection.
    db = open_database(settings.database_url)
    try:
        with db.transaction() as tx:
            recorded = ledger.record_timeout(
                tx,
                job_id,
                owner_prefix_of_pid(child_pid),
                limit_s,
                max_attempts=settings.max_attempts,
            )
            unclaimed = recorded is None and ledger.job_state(tx, job_id) == "queued"
    finally:
        db.dispose()
    if recorded is not None:
        state, run_queue = recorded
        log.warning("job %s: killed at the hard time limit (%s s); %s", job_id, limit_s, state)
        if state == "queued":
            _send_again(task, job_id, label, run_queue, settings)
    elif unclaimed:
        # Killed before its claim was written: nothing ran, no attempt counts, and Celery acknowledges
        # the message of a task that timed out.
        log.warning(
            "job %s: not claimed when its process was killed at the hard time limit; sent again", job_id
        )
        _send_again(task, job_id, label, queue, settings)


def _send_again(task: object, job_id: str, label: str | None, queue: str | None, settings: Settings) -> None:
    task.apply_async(  # type: ignore[attr-defined]
        args=[job_id], kwargsrepr=label, task_id=job_id, queue=queue, countdown=job_retry_in_s(1, settings)
    )


@shared_task(
    bind=True, name=RUN_JOB, acks_late=True, reject_on_worker_lost=True, max_retries=None, Request=JobRequest
)
def run_job(self, job_id: str) -> str:  # type: ignore[no-untyped-def]
    if _process is None:
        raise RuntimeError("dsocr.run_job runs only in a `dsocr worker` child")
    # A retry is a new message: it keeps the job's label (farm/celery/messages.py `job_labels`) for monitors.
    label = getattr(self.request, "kwargsrepr", None)
    process, next_message = _process, handed_spec().next_message

    def upcoming(tx: Session) -> ledger.WaitingJob | None:
        # On the prefetch thread, while this job runs: the job the lane fetched for this child next
        # (reserved already by the child's `NextMessage.follow` thread).
        next_job = next_message.after(job_id)
        return None if next_job is None else ledger.waiting_job(tx, next_job, process.owner)

    infer = partial(
        process.infer, upcoming=upcoming, next_job_known=lambda: next_message.after(job_id, wait_s=0) is not None
    )
    try:
        options = process.prepare_for(job_id)  # the model is opened here, before the job's claim, never by it
        if options is not None and options.concurrency > 1:
            # Its result is written when the batched engine finishes it (farm/job/batched.py); the engine
            # runs to the end when the lane has no next message for this child.
            outcome = run_in_batch(
                process, job_id, options, more_coming=next_message.after(job_id) is not None
            )
        else:
            # A batch-1 job finishes the batch left in flight first: one engine on the device at a time.
            # A job the ledger does not know (or whose run's options are bad) never reaches the device: its
            # refusal or failure leaves the batch to the jobs that come next.
            if options is not None:
                process.end_batch()
            # The claim and the result are written on the child's ledger threads: the job starts on the
            # device while its claim is written, and its result while the parent hands over the next message.
            outcome = execute_job(
                process.db,
                job_id,
                owner=process.owner,
                settings=process.settings,
                infer=infer,
                ledger_threads=process.ledger_threads,
                score=process.score,
            )
    except TransientError as exc:
        delay = job_retry_in_s(self.request.retries, process.settings)
        log.warning("job %s: %s; retrying in %.0f s", job_id, exc, delay)
        raise self.retry(countdown=delay, exc=exc, kwargsrepr=label) from exc
    log.info("job %s: %s %s", job_id, outcome.status, outcome.detail)
    if outcome.retry_in_s is not None:
        raise self.retry(countdown=outcome.retry_in_s, kwargsrepr=label)
    return outcome.status
