"""Starting workers: `dsocr worker` (Celery prefork, one child per device) and `dsocr run`'s in-process loop.

The parent process never imports torch or touches CUDA: GPUs are counted with `nvidia-smi`, and each
child opens its own device, ledger connection and model after fork.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable

from dsocr_workers.errors import InputError
from dsocr_workers.farm.job.process import DEVICES_ENV, QUEUES_ENV
from dsocr_workers.farm.job.warm import WARMUP_ENV, ModelKey, plan_warmup
from dsocr_workers.settings import Settings, check_queue_name
from dsocr_workers.store.db import check_schema, open_database

# How long a child may load and warm up before it reports itself up (Celery's default is 4 s, after
# which it kills the child). The fast engine compiles every shape of a mode: minutes, not seconds.
WARMUP_TIMEOUT_S = 3600
DEFAULT_MODEL = ModelKey("tiny")


def check_ledger(
    settings: Settings, queues: list[str], warmup: str, fallback: ModelKey, fallback_budget: int | None
) -> str | None:
    """Refuse to start against a database that is down or has an old schema; returns the children's
    start-up warm-up plan (farm/job/warm.py) for the runs open on `queues`. Leaves no connection open."""
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
    Flower (task events, event heartbeats, inspection; farm/celery/app.py)."""
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

    from dsocr_workers.farm.celery.app import create_app

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
