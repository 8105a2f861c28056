"""Starting workers: `dsocr worker` (Celery prefork, one child per device) and `dsocr run`'s in-process loop.

The parent process never imports torch or touches CUDA: GPUs are counted with `nvidia-smi`, and each
child opens its own device, ledger connection and model after fork.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterable
from functools import partial

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.child import DEVICES_ENV, QUEUES_ENV, JobProcess
from dsocr_workers.farm.execute import BACK_IN_LINE, Outcome, execute_job
from dsocr_workers.farm.warm import WARMUP_ENV, ModelKey, plan_warmup
from dsocr_workers.settings import Settings, check_queue_name
from dsocr_workers.store import ledger
from dsocr_workers.store.db import check_schema, open_database

# How long a child may load and warm up before it reports itself up (Celery's default is 4 s, after
# which it kills the child). The fast engine compiles every shape of a mode: minutes, not seconds.
WARMUP_TIMEOUT_S = 3600
DEFAULT_MODEL = ModelKey("tiny")
IN_PROCESS_QUEUE = "in-process"  # the queue `dsocr run` records its runs under by default (no worker reads it)


def count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def parse_devices(gpus: str) -> list[str]:
    """`auto` → every GPU, or the CPU where there is none; `all` → every GPU (none found: an error);
    `0,1` → those GPUs; `cpu` → the CPU."""
    text = gpus.strip().lower()
    if text == "cpu":
        return ["cpu"]
    if text == "auto":
        count = count_gpus()
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    if text == "all":
        count = count_gpus()
        if count == 0:
            raise InputError("--gpus all: nvidia-smi finds no GPU; use --gpus cpu on a machine without one")
        return [f"cuda:{i}" for i in range(count)]
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--gpus {gpus!r}: expected auto, all, cpu, or GPU indices like 0,1") from None
    if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
        raise InputError(f"--gpus {gpus!r}: expected distinct GPU indices like 0,1")
    return [f"cuda:{i}" for i in indices]


def check_ledger(
    settings: Settings, queues: list[str], warmup: str, fallback: ModelKey, fallback_budget: int | None
) -> str | None:
    """Refuse to start against a database that is down or has an old schema; returns the children's
    start-up warm-up plan (farm/warm.py) for the runs open on `queues`. Leaves no connection open."""
    db = open_database(settings.database_url)
    try:
        check_schema(db)
        plan = plan_warmup(db, queues, warmup, fallback, fallback_budget)
    finally:
        db.dispose()
    return plan.to_env() if plan else None


def start_worker(
    settings: Settings,
    devices: list[str],
    *,
    concurrency_per_device: int = 1,
    queues: Iterable[str] = (),
    loglevel: str = "INFO",
    warmup: str = "auto",
    fallback_model: ModelKey = DEFAULT_MODEL,
    fallback_budget: int | None = None,
    events: bool = False,
) -> None:
    """Run a Celery worker until it is shut down (SIGTERM: warm shutdown, the current jobs finish).
    Each child loads and warms a model before it takes a message: `warmup` names the modes (or
    `auto`: those of the runs open on its queues; `none`), `fallback_model` is loaded when no run is,
    warmed for jobs of `fallback_budget` new tokens (None: the model's positions). `events`: visible in
    Flower (task events, event heartbeats, inspection; farm/celery_app.py)."""
    if concurrency_per_device < 1:
        raise InputError("--concurrency-per-device must be at least 1")
    queue_names = [check_queue_name(queue) for queue in queues] or [settings.queue]
    plan = check_ledger(settings, queue_names, warmup, fallback_model, fallback_budget)
    slots = [device for device in devices for _ in range(concurrency_per_device)]
    os.environ[DEVICES_ENV] = ",".join(slots)
    os.environ[QUEUES_ENV] = ",".join(queue_names)
    if plan:
        os.environ[WARMUP_ENV] = plan
    else:
        os.environ.pop(WARMUP_ENV, None)

    from dsocr_workers.farm.celery_app import create_app

    app = create_app(settings, events=events)
    app.conf.worker_proc_alive_timeout = WARMUP_TIMEOUT_S
    app.worker_main(
        [
            "worker",
            "--pool=prefork",
            f"--concurrency={len(slots)}",
            f"--queues={','.join(queue_names)}",
            "--prefetch-multiplier=1",
            f"--hostname=dsocr-{uuid.uuid4().hex[:6]}@%h",
            "--without-gossip",
            "--without-mingle",
            # Celery's event heartbeats (not the ledger's, farm/liveness.py) tell a monitor that the
            # worker is alive; without one they go nowhere.
            *([] if events else ["--without-heartbeat"]),
            f"--loglevel={loglevel}",
        ]
    )


def run_in_process(
    settings: Settings,
    device: str,
    job_ids: list[str],
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    max_transient_retries: int = 5,
    queue: str = IN_PROCESS_QUEUE,
) -> list[Outcome]:
    """Run jobs here, one after the other (`dsocr run`). Failed attempts go to the back of the line until
    they are final; the ledger decides, exactly as for Celery workers. Each job's model is loaded and
    warmed before its claim (the first job's: before any claim). This process beats like a worker on
    `queue` (its run's), renewing its leases, but sweeps nothing: it has no broker to send messages to."""
    process = JobProcess.open(settings, device, queues=(queue,))
    try:
        return _run_line(process, settings, job_ids, on_outcome, max_transient_retries)
    finally:
        process.close()


def _ledger_retries(retries: int) -> Retrying:
    """Calls again after a TransientError (the ledger out of reach: the job is unchanged, or still held
    under this process's lease and continued by the next call), `retries` times at most, 2 s later, then
    4, 8, 16 and 30 s at most; the last error is raised."""
    return Retrying(
        retry=retry_if_exception_type(TransientError),
        wait=wait_exponential(multiplier=2, max=30),
        stop=stop_after_attempt(retries + 1),
        reraise=True,
    )


def _run_line(
    process: JobProcess, settings: Settings, job_ids: list[str], on_outcome: Callable[[Outcome], None],
    max_transient_retries: int,
) -> list[Outcome]:  # fmt: skip
    line = list(job_ids)
    finals: list[Outcome] = []
    while line:
        job_id = line.pop(0)
        process.prepare_for(job_id)
        # The next job of the line is known: its page is prepared while this one runs (farm/prefetch.py).
        upcoming = partial(ledger.waiting_job, job_id=line[0], owner=process.owner) if line else None
        infer = partial(process.infer, upcoming=upcoming)
        outcome = _ledger_retries(max_transient_retries)(
            execute_job, process.db, job_id, owner=process.owner, settings=settings, infer=infer
        )
        on_outcome(outcome)
        if outcome.status in BACK_IN_LINE:
            line.append(job_id)
        else:
            finals.append(outcome)
    return finals
