"""A batched worker's pages prepared in processes of their own (farm/job/batched.py).

The batched engine's thread launches a prefill's kernels layer by layer and pays for every wait for the
GIL; decoding a page, resizing and cutting it, copying its pixels out of PIL and tokenizing its prompt
hold that GIL (docs/benchmarks.md, "The farm's prefill stretch"). `PageProcesses` runs the family's
preprocessing (`ModelFamily.prepare_page`, what `DeepSeekOCRSession.prepare` runs) in processes instead,
one page at a time each; the job process starts them with its first batched engine on a model and keeps
them for the next ones on it (farm/job/process.py `pages_for`).

Each is a fresh interpreter (helper_processes.py) that imports the family's preprocessing and is handed
the tokenizer: never CUDA nor the weights. They ignore Ctrl-C (the pool stops them) and die with the
job's process, killed or not (a SIGKILL at their parent's death; their parent is the pool's thread, which
outlives them).

A page comes back through shared memory (torch.multiprocessing's reductions: each tensor's storage
crosses as a file descriptor) and leaves it at once in the job's process, pinned on CUDA as
`prepare_job` pins it, copied on a CPU: /dev/shm holds only the pages in transit. An error crosses with
its class and message, so a bad image fails its page alone; a process that dies fails the pages it held
(`ORDERS_PER_PROCESS` at most), and another takes its place.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from dsocr_workers import settings
from dsocr_workers.farm.job.helper_processes import helper_connection, start_helper
from dsocr_workers.model.families import FAMILIES
from dsocr_workers.model.tokenizer import OCRTokenizer

if TYPE_CHECKING:  # the lane's parent imports this module (farm/job/batched.py) and never torch
    import torch

    from dsocr_workers.engine.clock import StageClock
    from dsocr_workers.engine.session import DeepSeekOCRSession, PreparedJob
    from dsocr_workers.model.preprocess import PreparedPage

log = logging.getLogger("dsocr.worker")


class PagesUnavailable(RuntimeError):
    """A page failed for want of a process to prepare it (the pool stopped, broke or lost the process
    holding it), not for anything of its own: its job may prepare it another way."""


# How long a process whose pipe ended may take to exit.
END_WAIT_S = 10.0
# How long the processes may take to import torch and the preprocessing and say they are ready: a
# hung start fails the batch's start rather than hanging it.
START_TIMEOUT_S = 300.0
# Pages handed to a process at once: its next one waits in its pipe while it prepares one, so that it
# never idles until this process's thread, which may wait for the GIL, has read a page and sent another.
ORDERS_PER_PROCESS = 2


def default_processes() -> int:
    """`DSOCR_PAGE_PROCESSES`, or half the CPUs, 1 to 4."""
    return settings.read(settings.PAGE_PROCESSES) or max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class _Order:
    """A page to prepare, as `DeepSeekOCRSession.prepare` takes it."""

    image: str
    prompt: str | None
    mode: str | None
    max_crops: int | None


@dataclass(frozen=True)
class _Start:
    """What a process is told first: the family whose pages it prepares, the tokenizer, and the job
    process's multiprocessing key, with which that process fetches a page's tensors from this one."""

    family: str
    tokenizer: OCRTokenizer
    authkey: bytes


@dataclass(frozen=True)
class _Ready:
    """What a process says first: its imports done and its tokenizer loaded."""


@dataclass
class _Page:
    """A page handed over (`submitted_s`, perf_counter), until it is back in this process."""

    order: _Order
    clock: StageClock
    submitted_s: float
    future: Future[PreparedJob]


@dataclass
class _Preparer:
    """One process, this process's end of its pipe, and the pages handed to it, in order."""

    process: subprocess.Popen[bytes]
    connection: Connection
    ready: bool = False
    holds: deque[_Page] = field(default_factory=deque)


def serve(fd: int, parent: int) -> None:
    """A page-preparing process (`start_helper`): told what to prepare with (`_Start`) through its end of the
    pipe, `fd`, then each `_Order` received prepared, the page or the error it raised sent back, until
    None or the end of the pipe."""
    connection = helper_connection(fd, parent)
    if connection is None:
        return
    try:
        start: _Start = connection.recv()
    except EOFError:  # the pool stopped before it was told
        return
    multiprocessing.current_process().authkey = start.authkey
    import torch
    import torch.multiprocessing  # noqa: F401  (its reductions: a page's tensors go back through shared memory)

    torch.set_num_threads(1)  # one page at a time: this process's share of the host's cores
    preparing, tokenizer = FAMILIES[start.family], start.tokenizer
    preparing.preprocessing()  # imported before it says it is ready
    connection.send(_Ready())
    while True:
        try:
            order = connection.recv()
        except EOFError:  # the job's process closed its end
            return
        if order is None:
            return
        reply: PreparedPage | Exception
        try:
            reply = preparing.prepare_page(
                order.image, tokenizer.encode, order.prompt, order.mode, order.max_crops
            )
        except Exception as exc:
            reply = exc
        try:
            connection.send(reply)
        except Exception as exc:  # a page that finds no shared memory, an error that does not pickle
            what = f"{type(reply).__name__}: {reply}" if isinstance(reply, Exception) else "the page"
            connection.send(
                RuntimeError(f"{what} (not sent back from its process: {type(exc).__name__}: {exc})")
            )


class PageProcesses:
    """`processes` processes preparing pages of `session`'s family with its tokenizer, for this process,
    where `session` runs. Their start begins here (the pool's thread starts them); `wait_ready` waits for
    it to end. A page's future follows concurrent.futures: cancelled before a process takes it, it is
    dropped."""

    def __init__(self, session: DeepSeekOCRSession, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"page processes: at least 1, got {processes}")
        self.processes = processes
        self._family, self._tokenizer = session.family.name, session.tokenizer
        self._pin = session.device.type == "cuda"
        self._preparers: list[_Preparer] = []
        self._waiting: deque[_Page] = deque()
        # Guards the fields below and the pipes' sending ends once a process is ready (before, the pool's
        # thread alone sends to it).
        self._changed = threading.Condition()
        self._stopping = False
        self._broken: str | None = None  # why every page fails: a process that could not start
        self._started_s = time.perf_counter()
        self.ready_ms: float | None = None  # from the pool's start to its last process ready
        self._thread = threading.Thread(target=self._serve, name="dsocr-page-processes", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Wait until every process is ready to prepare pages: milliseconds since the pool started. Raises
        if one could not start, or not within `timeout_s` (the pool then fails every page)."""
        with self._changed:
            started = self._changed.wait_for(
                lambda: self.ready_ms is not None or self._broken is not None, timeout=timeout_s
            )
        if not started:
            self._break(f"the page-preparing processes were not ready within {timeout_s:.0f} s")
        with self._changed:
            if self._broken is not None:
                raise PagesUnavailable(self._broken)
            assert self.ready_ms is not None
            return self.ready_ms

    @property
    def ready(self) -> bool:
        """Every process started, none broken, none stopping: a page submitted now waits for no start."""
        return self.ready_ms is not None and self._broken is None and not self._stopping

    def serves(self, session: DeepSeekOCRSession) -> bool:
        """Whether these processes prepare `session`'s pages: its tokenizer's, and still running."""
        return session.tokenizer is self._tokenizer and self._broken is None and not self._stopping

    def describe(self) -> str:
        """The pool's start, in words."""
        ready = "not ready" if self.ready_ms is None else f"ready in {self.ready_ms / 1e3:.2f} s"
        return f"{self.processes} page-preparing process{'es' if self.processes > 1 else ''} {ready}"

    def submit(
        self,
        image: str,
        prompt: str | None,
        mode: str | None,
        clock: StageClock,
        max_crops: int | None = None,
    ) -> Future[PreparedJob]:
        """`image`'s page, prepared in a process as `DeepSeekOCRSession.prepare` prepares it, with `clock`,
        which holds its `preprocess` stage: from here to the page back in this process (its wait for a
        free process included)."""
        page = _Page(_Order(image, prompt, mode, max_crops), clock, time.perf_counter(), Future())
        with self._changed:
            refused = self._broken or ("page preparation stopped" if self._stopping else None)
            if refused is None:
                self._waiting.append(page)
                self._dispatch()
        if refused is not None:
            _fail(page, PagesUnavailable(refused))
        return page.future

    def close(self) -> None:
        """Stop: every process ends once the pages it holds are back, a page not handed to one fails; wait
        for them to end."""
        self._stop(kill=False)

    def kill(self) -> None:
        """Stop at once: every process is killed, each page not back yet fails."""
        self._stop(kill=True)

    def _stop(self, kill: bool) -> None:
        with self._changed:
            kill = kill or self._broken is not None  # a broken pool's processes may never say they are ready
            self._stopping = True
            waiting = list(self._waiting)
            self._waiting.clear()
            for preparer in self._preparers:
                if kill:
                    preparer.process.kill()
                elif preparer.ready and not preparer.holds:  # else once it is ready or its last page back
                    _send_quietly(preparer.connection, None)
            self._changed.notify_all()
        for page in waiting:
            _fail(page, PagesUnavailable("page preparation stopped"))
        self._thread.join()

    # --- the pool's thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        """Start the processes, then read what they send until every one has ended. Should this thread
        fail, its processes die with it (their parent-death signal) and every page not back fails."""
        try:
            for preparer in [self._start_one() for _ in range(self.processes)]:  # all at once, then told
                if preparer is not None and self._broken is not None:  # another did not start
                    preparer.process.kill()
                elif preparer is not None:
                    _send_quietly(preparer.connection, self._start_message())
            while True:
                with self._changed:
                    reading = {preparer.connection: preparer for preparer in self._preparers}
                if not reading:
                    return
                for connection in wait(list(reading)):
                    self._read(reading[connection])  # type: ignore[index]
        except Exception as exc:
            log.exception("the page processes' thread failed")
            with self._changed:
                held = [page for preparer in self._preparers for page in preparer.holds]
            self._break(f"page preparation failed: {type(exc).__name__}: {exc}", held)

    def _start_one(self) -> _Preparer | None:
        """A new process (to be sent its `_Start`), killed at once if the pool is stopping; None when it
        could not be started."""
        try:
            process, ours = start_helper(__name__)
        except Exception as exc:
            log.exception("a page-preparing process did not start")
            self._break(f"a page-preparing process did not start: {type(exc).__name__}: {exc}")
            return None
        preparer = _Preparer(process, ours)
        with self._changed:
            self._preparers.append(preparer)
            if self._stopping:
                process.kill()
        return preparer

    def _start_message(self) -> _Start:
        return _Start(self._family, self._tokenizer, bytes(multiprocessing.current_process().authkey))

    def _read(self, preparer: _Preparer) -> None:
        """What `preparer` sent: that it is ready, or the first page it holds (or its error). A page's
        tensors are fetched from the process as it is read, so only then may it be told to stop."""
        try:
            message = preparer.connection.recv()
        except (EOFError, ConnectionError):  # it died, or its page's tensors died with it
            self._ended(preparer)
            return
        except Exception as exc:  # a reply that does not unpickle here, its tensors that do not arrive
            message = RuntimeError(f"the prepared page could not be read: {type(exc).__name__}: {exc}")
        received_s = time.perf_counter()
        with self._changed:
            page = None
            if isinstance(message, _Ready):
                preparer.ready = True
                if self.ready_ms is None and sum(p.ready for p in self._preparers) == self.processes:
                    self.ready_ms = (received_s - self._started_s) * 1e3
                    self._changed.notify_all()
            elif preparer.holds:
                page = preparer.holds.popleft()
            if self._stopping and not preparer.holds:
                _send_quietly(preparer.connection, None)
            self._dispatch()
        if page is not None:
            self._deliver(page, message)

    def _deliver(self, page: _Page, message: object) -> None:
        """The page, out of shared memory, to its future, its `preprocess` stage on its clock."""
        from dsocr_workers.engine.session import PreparedJob  # the processes never import the engine

        if isinstance(message, Exception):
            _fail(page, message)
            return
        try:
            prepared = _out_of_shared_memory(message, self._pin)  # type: ignore[arg-type]
            page.clock.record_host_stage("preprocess", page.submitted_s, time.perf_counter())
        except Exception as exc:
            _fail(page, exc)
            return
        page.future.set_result(PreparedJob(prepared, page.clock))

    def _ended(self, preparer: _Preparer) -> None:
        """A process's pipe ended or broke: it exited or was killed (or is, if it still runs). Its pages
        fail; another takes its place unless the pool is stopping; one that ended before it was ready
        breaks the pool."""
        preparer.process.kill()
        try:
            status: int | None = preparer.process.wait(END_WAIT_S)
        except subprocess.TimeoutExpired:
            status = None
        with self._changed:
            self._preparers.remove(preparer)
            preparer.connection.close()
            held = list(preparer.holds)
            preparer.holds.clear()
            stopping = self._stopping
        for page in held:
            _fail(page, PagesUnavailable(f"the process preparing this page ended (exit status {status})"))
        if stopping:
            return
        if not preparer.ready:
            self._break(f"a page-preparing process ended before it was ready (exit status {status})")
            return
        log.warning("a page-preparing process ended (exit status %s); starting another", status)
        if (replacement := self._start_one()) is not None:
            _send_quietly(replacement.connection, self._start_message())

    def _break(self, reason: str, held: list[_Page] | None = None) -> None:
        """Every page waiting (and those `held` by processes), and every later one, fails with `reason`."""
        with self._changed:
            self._broken = self._broken or reason
            waiting = list(self._waiting)
            self._waiting.clear()
            self._changed.notify_all()
        for page in [*(held or []), *waiting]:
            _fail(page, PagesUnavailable(reason))

    def _dispatch(self) -> None:
        """(Under `_changed`.) Waiting pages, in order, to the ready processes that hold fewest (up to
        `ORDERS_PER_PROCESS`); a cancelled one is dropped."""
        for held in range(ORDERS_PER_PROCESS):
            for preparer in self._preparers:
                while self._waiting and preparer.ready and len(preparer.holds) == held:
                    page = self._waiting.popleft()
                    if not (page.future.running() or page.future.set_running_or_notify_cancel()):
                        continue
                    if not _send_quietly(preparer.connection, page.order):  # it ended: the pool's thread
                        self._waiting.appendleft(page)  # finds its pipe's end
                        break
                    preparer.holds.append(page)


def _fail(page: _Page, error: Exception) -> None:
    """The page's future fails with `error`, unless it was cancelled."""
    if page.future.running() or page.future.set_running_or_notify_cancel():
        page.future.set_exception(error)


def _send_quietly(connection: Connection, message: object) -> bool:
    """Whether `message` went; not to a process that ended."""
    try:
        connection.send(message)
    except OSError:
        return False
    return True


def _out_of_shared_memory(page: PreparedPage, pin: bool) -> PreparedPage:
    """The page's tensors in this process's own memory: pinned (CUDA) or copied."""
    import torch

    move: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.pin_memory if pin else torch.Tensor.clone
    tiles = None if page.tile_pixels is None else move(page.tile_pixels)
    return replace(
        page,
        input_ids=move(page.input_ids),
        images_seq_mask=move(page.images_seq_mask),
        image_positions=move(page.image_positions),
        global_pixels=move(page.global_pixels),
        tile_pixels=tiles,
    )
