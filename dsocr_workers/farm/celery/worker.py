"""Starting `dsocr worker`: Celery prefork, one child per device slot.

The parent process never imports torch or touches CUDA (GPUs are counted with `nvidia-smi`,
farm/devices.py); each child opens its own device, ledger connection and model after fork. What a child
needs to know comes in one `WorkerSpec`, set in the parent before the pool starts and inherited by every
child it forks (replacements too: billiard forks them from the same parent), never through the
environment.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray
from typing import Any, NoReturn

from dsocr_workers.errors import InputError
from dsocr_workers.farm.job.warm import ModelKey, Warmup, plan_warmup
from dsocr_workers.settings import Settings, check_queue_name
from dsocr_workers.store.db import open_ledger

# How long a child may load and warm up before it reports itself up (Celery's default is 4 s, after
# which it kills the child). The fast engine compiles every shape of a mode: minutes, not seconds.
WARMUP_TIMEOUT_S = 3600
DEFAULT_MODEL = ModelKey("tiny")
REFUSAL_BYTES = 2048
EXIT_REFUSED = 2  # a child's exit status when it cannot work (billiard logs it)

log = logging.getLogger("dsocr.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """What `dsocr worker` hands each of its children: the settings it read, one device per pool index
    (a device repeats with --concurrency-per-device), the queues it consumes (the ones its children
    sweep) and the start-up warm-up (None: `--warmup none`)."""

    settings: Settings
    slots: tuple[str, ...]
    queues: tuple[str, ...]
    warmup: Warmup | None
    # Where a child that cannot work says why (`refuse_to_work`): memory shared with the parent, which
    # reads it once Celery has stopped.
    refusal: Any = field(default_factory=lambda: RawArray(ctypes.c_char, REFUSAL_BYTES), compare=False, repr=False)

    def device_of(self, index: int) -> str:
        """The device of pool index `index` (a replacement child gets the index of the one it replaces)."""
        return self.slots[index % len(self.slots)]


_handed: WorkerSpec | None = None


def handed_spec() -> WorkerSpec:
    """The spec of the worker this process belongs to (its parent or itself)."""
    if _handed is None:
        raise RuntimeError("no WorkerSpec: this process was not started by `dsocr worker`")
    return _handed


def refuse_to_work(reason: str) -> NoReturn:
    """In a child that cannot run jobs (its device does not open): record why for the parent, ask the
    parent to stop (a warm shutdown: the other children finish their jobs), and exit before this child
    takes a message. `dsocr worker` then exits with an input error (2) saying `reason` (start_worker)."""
    handed_spec().refusal.value = reason.encode()[: REFUSAL_BYTES - 1]
    log.error("%s; stopping the worker", reason)
    os.kill(os.getppid(), signal.SIGTERM)
    os._exit(EXIT_REFUSED)


def check_ledger(
    settings: Settings, queues: list[str], warmup: str, fallback: ModelKey, fallback_budget: int | None
) -> Warmup | None:
    """Refuse to start against a database that is down or has an old schema; returns the children's
    start-up warm-up plan (farm/job/warm.py) for the runs open on `queues`. Leaves no connection open."""
    db = open_ledger(settings.database_url)
    try:
        plan = plan_warmup(db, queues, warmup, fallback, fallback_budget)
    finally:
        db.dispose()
    return plan


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
    global _handed
    slots = tuple(device for device in devices for _ in range(concurrency_per_device))
    _handed = WorkerSpec(settings, slots, tuple(queue_names), plan)

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
    if refused := _handed.refusal.value.decode(errors="replace"):
        raise InputError(refused)
