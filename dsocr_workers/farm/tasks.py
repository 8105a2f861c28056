"""The Celery task: a job id in, `execute_job`, and the retry it asks for. Thin on purpose.

Each prefork child takes its device from its pool index (`DSOCR_WORKER_DEVICES`, set by `dsocr worker`),
so the parent never touches CUDA; a replacement child gets the index, and the device, of the one it
replaces.
"""

from __future__ import annotations

import logging
import os

from billiard.process import current_process
from celery import shared_task
from celery.signals import worker_process_init, worker_process_shutdown

from dsocr_workers.errors import TransientError
from dsocr_workers.farm.child import JobProcess, devices_from_env
from dsocr_workers.farm.execute import execute_job, retry_backoff_s
from dsocr_workers.settings import Settings

RUN_JOB = "dsocr.run_job"
log = logging.getLogger("dsocr.worker")

_process: JobProcess | None = None


@worker_process_init.connect
def _open_child(**_: object) -> None:
    global _process
    devices = devices_from_env()
    index = getattr(current_process(), "index", 0) or 0
    device = devices[index % len(devices)]
    cpu_children = sum(d == "cpu" for d in devices)
    threads = max(1, (os.cpu_count() or 1) // cpu_children) if cpu_children else None
    _process = JobProcess.open(Settings.from_env(), device, cpu_threads=threads)
    log.info("child %s (pid %d) on %s", index, os.getpid(), device)


@worker_process_shutdown.connect
def _close_child(**_: object) -> None:
    if _process is not None:
        _process.db.dispose()


@shared_task(bind=True, name=RUN_JOB, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def run_job(self, job_id: str) -> str:  # type: ignore[no-untyped-def]
    if _process is None:
        raise RuntimeError("dsocr.run_job runs only in a `dsocr worker` child")
    try:
        outcome = execute_job(
            _process.db, job_id, owner=_process.owner, settings=_process.settings, infer=_process.infer
        )
    except TransientError as exc:
        delay = retry_backoff_s(self.request.retries, _process.settings)
        log.warning("job %s: %s; retrying in %.0f s", job_id, exc, delay)
        raise self.retry(countdown=delay, exc=exc) from exc
    log.info("job %s: %s %s", job_id, outcome.status, outcome.detail)
    if outcome.retry_in_s is not None:
        raise self.retry(countdown=outcome.retry_in_s)
    return outcome.status
