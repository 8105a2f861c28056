"""Starting `dsocr worker`: one Celery worker per device slot (a lane), each a prefork parent with one
child. The parents never touch CUDA; each child opens its own device, ledger connection and model after
fork, from the one `WorkerSpec` its lane inherits. Before it starts the lanes, this process imports what
the children need (torch, transformers, the engine: farm/celery/preimport.py), so that every lane and
child forks with those imports done and a child's start goes straight to its model. The ledger check runs
beside those imports, in a process forked before them (`LedgerCheck`): a refused start stops at the
import after the refusal.

A worker per device, rather than one parent with a child per device: a lane fetches one message beyond
the one its child runs, and with one child that message is surely the child's next job, so the child
can prepare its page while the current job has the device (`NextMessage`, farm/job/prefetch.py).

With several slots this process forks one lane per slot, passes SIGTERM and SIGQUIT on to them (SIGINT
as SIGTERM), and when one lane ends it stops the others; a lane dies with this process.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.sharedctypes import RawArray
from typing import TYPE_CHECKING, Any, NoReturn

from celery.platforms import set_pdeathsig

from dsocr_workers.errors import DsocrError, InputError
from dsocr_workers.farm.celery.preimport import Imported, import_for_jobs
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.settings import Settings, check_queue_name

if TYPE_CHECKING:  # the ledger's modules (SQLAlchemy, alembic) are imported by the check's process
    from dsocr_workers.farm.job.warm import Warmup

# How long a child may load and warm up before it reports itself up (Celery's default kills it after
# seconds): the fast engine compiles every shape of a mode.
WARMUP_TIMEOUT_S = 3600
DEFAULT_RUNS = RunOptions()  # the tiny preset, batch-1
REFUSAL_BYTES = 2048
EXIT_REFUSED = 2  # a child's exit status when it cannot work (billiard logs it)
# Room in `NextMessage` for the ids (36 characters each, comma-separated) of the messages a lane lists:
# two at most (prefetch 2), eight to spare.
LISTED_BYTES = 8 * 37
# How long a child's prefetch thread waits for its lane's next message to show: the lane fetches it
# right after handing over the current one, when the queue has one.
NEXT_MESSAGE_WAIT_S = 0.5
NEXT_MESSAGE_POLL_S = 0.002

log = logging.getLogger("dsocr.worker")


@dataclass(frozen=True)
class NextMessage:
    """The jobs a lane has fetched and its child has not started, in the order the child gets them, as
    the lane's parent writes them to memory shared with the child. In the child, one thread reserves each
    in the ledger as soon as it shows (`follow`: a lane killed with it loses it to a sweep, not to the
    visibility timeout), and the prefetch thread takes the next one (`after`). The child reads without a
    lock (a child killed mid-read must not leave one held): a torn read is an id no job has."""

    slot: Any = field(default_factory=lambda: RawArray(ctypes.c_char, LISTED_BYTES), repr=False)
    changed: Any = field(default_factory=lambda: multiprocessing.get_context("fork").Semaphore(0), repr=False)
    _listed: deque[str] = field(default_factory=deque, repr=False)  # the parent's own, not shared

    def fetched(self, job_id: str) -> None:
        """In the parent: a job's message came in, to run after those listed."""
        self._listed.append(job_id)
        self._show()

    def gone(self, job_id: str) -> None:
        """In the parent: the child started the job, or its message was acknowledged or given back."""
        if job_id in self._listed:
            self._listed.remove(job_id)
            self._show()

    def follow(self, reserve: Callable[[str], None], stopping: threading.Event) -> None:
        """In the child, on a thread of its own until `stopping`: `reserve(job_id)` for each job shown,
        once (tried again every second while it fails: a ledger outage)."""
        reserved: set[str] = set()
        while not stopping.is_set():
            self.changed.acquire(timeout=1.0)  # blocks without the GIL: no cost to the running job
            listed = self._read()
            reserved &= set(listed)
            for job_id in listed:
                if job_id in reserved:
                    continue
                try:
                    reserve(job_id)
                except Exception:
                    log.warning("could not reserve job %s, fetched next", job_id, exc_info=True)
                else:
                    reserved.add(job_id)

    def after(self, job_id: str, wait_s: float = NEXT_MESSAGE_WAIT_S) -> str | None:
        """In the child running `job_id`: the job it runs next, if its lane has fetched one within
        `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            if following := [listed for listed in self._read() if listed != job_id]:
                return following[0]
            if time.monotonic() >= deadline:
                return None
            time.sleep(NEXT_MESSAGE_POLL_S)

    def _show(self) -> None:
        shown = ""
        for job_id in self._listed:  # as many whole ids as fit
            if len(joined := f"{shown},{job_id}" if shown else job_id) >= LISTED_BYTES:
                break
            shown = joined
        self.slot.value = shown.encode()
        self.changed.release()

    def _read(self) -> list[str]:
        return [job_id for job_id in bytes(self.slot.value).decode(errors="replace").split(",") if job_id]


@dataclass(frozen=True)
class WorkerSpec:
    """What `dsocr worker` hands the child of each lane: its settings, the worker's device slots and the
    lane's index among them, the queues it consumes, the start-up warm-up (None: `--warmup none`) and
    what `dsocr worker` imported for it before starting the lanes."""

    settings: Settings
    slots: tuple[str, ...]
    lane: int
    queues: tuple[str, ...]
    warmup: Warmup | None
    preimported: Imported
    # Where a child that cannot work says why (`refuse_to_work`), read once Celery has stopped.
    refusal: Any = field(
        default_factory=lambda: RawArray(ctypes.c_char, REFUSAL_BYTES), compare=False, repr=False
    )
    next_message: NextMessage = field(default_factory=NextMessage, compare=False, repr=False)

    @property
    def device(self) -> str:
        """The lane's device (a replacement child gets it too)."""
        return self.slots[self.lane]

    @property
    def refused(self) -> str:
        return bytes(self.refusal.value).decode(errors="replace")


_handed: WorkerSpec | None = None


def handed_spec() -> WorkerSpec:
    """The spec of the worker this process belongs to (its parent or itself)."""
    if _handed is None:
        raise RuntimeError("no WorkerSpec: this process was not started by `dsocr worker`")
    return _handed


def refuse_to_work(reason: str) -> NoReturn:
    """In a child that cannot run jobs (its device does not open): record why, ask its lane to stop (a
    warm shutdown) and exit before this child takes a message; `dsocr worker` then exits with an input
    error saying `reason`."""
    handed_spec().refusal.value = reason.encode()[: REFUSAL_BYTES - 1]
    log.error("%s; stopping the worker", reason)
    os.kill(os.getppid(), signal.SIGTERM)
    os._exit(EXIT_REFUSED)


def check_ledger(
    settings: Settings,
    queues: list[str],
    warmup: str,
    fallback: RunOptions,
) -> Warmup | None:
    """Refuse to start against a database that is down or has an old schema; returns the children's
    start-up warm-up plan (farm/job/warm.py) for the runs open on `queues`. Leaves no connection open."""
    from dsocr_workers.farm.job.warm import plan_warmup
    from dsocr_workers.store.db import open_ledger

    db = open_ledger(settings.database_url)
    try:
        plan = plan_warmup(db, queues, warmup, fallback)
    finally:
        db.dispose()
    return plan


@dataclass(frozen=True)
class LedgerCheck:
    """`check_ledger` in a process forked for it, so that its imports and its round trips to the database
    run beside the parent's imports; its outcome comes back through a pipe."""

    process: multiprocessing.process.BaseProcess
    outcome: Connection

    @classmethod
    def start(cls, settings: Settings, queues: list[str], warmup: str, fallback: RunOptions) -> LedgerCheck:
        context = multiprocessing.get_context("fork")
        outcome, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=_check_and_send, args=(sender, settings, queues, warmup, fallback), name="dsocr-ledger-check"
        )
        process.start()
        sender.close()
        return cls(process, outcome)

    def refused(self) -> bool:
        """Whether the check has ended and refused (or died)."""
        return not self.process.is_alive() and self.process.exitcode != 0

    def result(self) -> Warmup | None:
        """The plan, once the check is done; raises what refused it."""
        try:
            passed, value = self.outcome.recv()
        except EOFError:  # the process died before it could say
            passed, value = False, RuntimeError(f"the ledger check died (exit status {self.process.exitcode})")
        except Exception as exc:  # an answer that does not unpickle here
            passed, value = False, RuntimeError(f"the ledger check's answer could not be read: {exc!r}")
        finally:
            self.outcome.close()
            self.process.join()
        if not passed:
            raise value
        return value


def _check_and_send(
    sender: Connection, settings: Settings, queues: list[str], warmup: str, fallback: RunOptions
) -> None:
    try:
        sender.send((True, check_ledger(settings, queues, warmup, fallback)))
    except Exception as exc:
        if not isinstance(exc, DsocrError):  # a fault, not a refusal: its traceback, which stays here
            log.exception("the ledger check failed")
        try:
            sender.send((False, exc))
        except Exception:  # an exception that does not pickle: its message
            sender.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
        sys.exit(1)


def start_worker(
    settings: Settings,
    devices: list[str],
    *,
    queues: Iterable[str] = (),
    loglevel: str = "INFO",
    warmup: str = "auto",
    fallback: RunOptions = DEFAULT_RUNS,
    events: bool = False,
) -> None:
    """Run a Celery worker per device slot until shut down (SIGTERM: warm shutdown). Each child loads and
    warms a model before it takes a message: `warmup` names the modes (`auto`: those of the runs open on
    its queues; `none`), `fallback`'s model is loaded when no run is, warmed for the runs it describes
    (their token budget, ban and concurrency: above 1, their batched engine started too). `events`:
    visible in Flower."""
    queue_names = [check_queue_name(queue) for queue in queues] or [settings.queue]
    check = LedgerCheck.start(settings, queue_names, warmup, fallback)
    imported = import_for_jobs(stop=check.refused)
    plan = check.result()
    # Frozen, the imported objects are never scanned by a lane's collections nor copied by them into
    # the lane's or the child's own pages (gc.freeze's documented use before fork).
    gc.freeze()
    slots = tuple(devices)
    specs = [
        WorkerSpec(settings, slots, lane, tuple(queue_names), plan, imported) for lane in range(len(slots))
    ]
    try:
        if len(specs) == 1:
            run_lane(specs[0], loglevel, events)
        else:
            failed = supervise_lanes(specs, loglevel, events)
            if failed and not any(spec.refused for spec in specs):
                raise RuntimeError(f"dsocr worker stopped: {failed}")
    finally:
        # Frozen objects outlive the interpreter's teardown: nanobind (Triton's bindings) would report
        # each of its still-referenced functions as a leak on stderr at exit.
        gc.unfreeze()
    if refused := "; ".join(spec.refused for spec in specs if spec.refused):
        raise InputError(refused)


def run_lane(spec: WorkerSpec, loglevel: str, events: bool) -> None:
    """One lane in this process: a Celery prefork worker with one child for `spec.device`, started
    through the app's Worker class rather than Celery's command line (which imports its plugins and an
    interactive shell's modules at every start)."""
    global _handed
    _handed = spec
    from celery.utils.nodenames import host_format

    from dsocr_workers.farm.celery.app import create_app

    app = create_app(spec.settings, events=events)
    app.conf.worker_proc_alive_timeout = WARMUP_TIMEOUT_S
    app.Worker(
        hostname=host_format(f"dsocr-{uuid.uuid4().hex[:6]}-{spec.lane}@%h"),
        pool_cls="prefork",
        concurrency=1,
        queues=list(spec.queues),
        without_gossip=True,
        without_mingle=True,
        # Celery's event heartbeats (not the ledger's) only serve a monitor.
        without_heartbeat=not events,
        loglevel=loglevel,
    ).start()


def _lane_process(spec: WorkerSpec, loglevel: str, events: bool) -> None:
    set_pdeathsig("SIGKILL")  # dies with `dsocr worker`, even killed (its own child dies with it likewise)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)  # Celery installs its own
    run_lane(spec, loglevel, events)


def supervise_lanes(specs: list[WorkerSpec], loglevel: str, events: bool) -> str:
    """Fork a lane per spec and wait for all of them; returns how the first lane to end on its own ended,
    if it failed ("" when every lane stopped cleanly or was asked to)."""
    context = multiprocessing.get_context("fork")
    lanes = [
        context.Process(target=_lane_process, args=(spec, loglevel, events), name=f"dsocr-lane-{spec.lane}")
        for spec in specs
    ]
    stopping: list[int] = []

    def pass_on(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for lane in lanes:
            if lane.pid is not None and lane.exitcode is None:
                os.kill(lane.pid, signal.SIGQUIT if signum == signal.SIGQUIT else signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, pass_on)
    for lane in lanes:
        lane.start()
    failed = ""
    while running := [lane for lane in lanes if lane.exitcode is None]:
        wait([lane.sentinel for lane in running])
        ended = [
            (lane, spec)
            for lane, spec in zip(lanes, specs, strict=True)
            if lane in running and lane.exitcode is not None
        ]
        if ended and not stopping:  # a lane ended by itself: the worker stops, saying why
            lane, spec = ended[0]
            if lane.exitcode:
                failed = f"the lane of {spec.device} exited with status {lane.exitcode}"
                log.error("%s; stopping the other lanes", failed)
            pass_on(signal.SIGTERM, None)
    return failed
