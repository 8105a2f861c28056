"""Starting workers: `dsocr worker` (Celery prefork, one child per device) and `dsocr run`'s in-process loop.

The parent process never imports torch or touches CUDA: GPUs are counted with `nvidia-smi`, and each
child opens its own device, ledger connection and model after fork.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.child import DEVICES_ENV, JobProcess
from dsocr_workers.farm.execute import Outcome, execute_job
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import check_schema, open_database


def count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def parse_devices(gpus: str) -> list[str]:
    """`all` → every GPU (none found: an error), `0,1` → those GPUs, `cpu` → the CPU."""
    text = gpus.strip().lower()
    if text == "cpu":
        return ["cpu"]
    if text == "all":
        count = count_gpus()
        if count == 0:
            raise InputError("--gpus all: nvidia-smi finds no GPU; use --gpus cpu on a machine without one")
        return [f"cuda:{i}" for i in range(count)]
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--gpus {gpus!r}: expected all, cpu, or GPU indices like 0,1") from None
    if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
        raise InputError(f"--gpus {gpus!r}: expected distinct GPU indices like 0,1")
    return [f"cuda:{i}" for i in indices]


def check_ledger(settings: Settings) -> None:
    """Refuse to start against a database that is down or has an old schema; leaves no connection open."""
    db = open_database(settings.database_url)
    try:
        check_schema(db)
    finally:
        db.dispose()


def start_worker(
    settings: Settings,
    devices: list[str],
    *,
    concurrency_per_device: int = 1,
    queues: Iterable[str] = (),
    loglevel: str = "INFO",
) -> None:
    """Run a Celery worker until it is shut down (SIGTERM: warm shutdown, the current jobs finish)."""
    if concurrency_per_device < 1:
        raise InputError("--concurrency-per-device must be at least 1")
    check_ledger(settings)
    slots = [device for device in devices for _ in range(concurrency_per_device)]
    os.environ[DEVICES_ENV] = ",".join(slots)

    from dsocr_workers.farm.celery_app import create_app

    app = create_app(settings)
    app.worker_main(
        [
            "worker",
            "--pool=prefork",
            f"--concurrency={len(slots)}",
            f"--queues={','.join(queues or [settings.queue])}",
            "--prefetch-multiplier=1",
            f"--hostname=dsocr-{uuid.uuid4().hex[:6]}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--loglevel={loglevel}",
        ]
    )


def run_in_process(
    settings: Settings,
    device: str,
    job_ids: list[str],
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    max_transient_retries: int = 5,
    preload: tuple[str, dict] | None = None,
) -> list[Outcome]:
    """Run jobs here, one after the other (`dsocr run`). Failed attempts go to the back of the line until
    they are final; the ledger decides, exactly as for Celery workers."""
    process = JobProcess.open(settings, device)
    if preload is not None:
        process.session_for(*preload)  # load the model before the first claim: its lease starts then
    line = list(job_ids)
    finals: list[Outcome] = []
    transient_failures = 0
    while line:
        job_id = line.pop(0)
        try:
            outcome = execute_job(
                process.db, job_id, owner=process.owner, settings=settings, infer=process.infer
            )
        except TransientError:
            transient_failures += 1
            if transient_failures > max_transient_retries:
                raise
            time.sleep(min(2**transient_failures, 30))
            line.append(job_id)
            continue
        on_outcome(outcome)
        if outcome.status in ("queued", "released"):
            line.append(job_id)
        else:
            finals.append(outcome)
    return finals
