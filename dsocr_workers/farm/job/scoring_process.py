"""A Celery child's accuracy scoring in a process of its own.

Scoring a page against its reference (quality/scoring.py) is Python that may run for seconds: the
matching alone may take DSOCR_MATCH_TIME_LIMIT. On the child's results thread it would hold the GIL
that the next jobs' launches wait for, and their stages' CUDA events would time that wait. So the
results thread hands each scored page to one process and waits for its columns, holding no GIL. The
scorer's own imports (rapidfuzz, apted, lxml, BeautifulSoup, pylatexenc) are that process's, never
the child's start.

The process is a fresh interpreter (helper_processes.py, as the page-preparing processes), started at
the first page that has a reference: a run without ground truth never starts it. It ignores Ctrl-C and
dies with the child. A process that dies is started again for the next page; a page that kills two in a
row fails its job, as an error raised by the scorer does.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
from multiprocessing.connection import Connection
from typing import Any

from dsocr_workers.farm.job.columns import NO_ACCURACY, accuracy_columns
from dsocr_workers.farm.job.helper_processes import helper_connection, start_helper

log = logging.getLogger("dsocr.worker")

# How long a process told to stop may take to exit before it is killed.
END_WAIT_S = 10.0

Columns = dict[str, float | str | None]


class ProcessDied(RuntimeError):
    """The scoring process ended while it held a page."""


def serve(fd: int, parent: int) -> None:
    """The scoring process (`start_helper`): each (markup, reference) received on `fd` scored, its columns or
    the error it raised sent back, until None or the end of the pipe."""
    connection = helper_connection(fd, parent)
    if connection is None:
        return
    while True:
        try:
            order = connection.recv()
        except EOFError:
            return
        if order is None:
            return
        reply: Columns | Exception
        try:
            reply = accuracy_columns(*order)
        except Exception as exc:
            reply = exc
        try:
            connection.send(reply)
        except Exception as exc:  # an error that does not pickle
            connection.send(RuntimeError(f"{type(reply).__name__}: {reply} (not sent back: {exc})"))


class ScoringProcess:
    """`accuracy_columns` run in a process of its own, started at the first page with a reference; one
    page at a time (callers wait their turn)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self.started = 0  # processes started so far

    def __call__(self, markup: str, reference: dict[str, Any] | None) -> Columns:
        if reference is None:
            return dict(NO_ACCURACY)
        with self._lock:
            try:
                return self._ask((markup, reference))
            except ProcessDied:  # started again for this page, once
                return self._ask((markup, reference))

    def _ask(self, order: tuple[str, dict[str, Any]]) -> Columns:
        connection = self._connection or self._start()
        try:
            connection.send(order)
            reply = connection.recv()
        except (EOFError, OSError) as exc:  # it died: killed, or a crash in the scorer's C code
            code = self._end(kill=True)
            log.warning("the scoring process ended (exit status %s) while scoring a page", code)
            raise ProcessDied(f"the scoring process died on this page (exit status {code})") from exc
        if isinstance(reply, Exception):
            raise reply
        return reply  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the process, if one runs."""
        with self._lock:
            self._end(kill=False)

    def _start(self) -> Connection:
        self._process, ours = start_helper(__name__)
        self._connection = ours
        self.started += 1
        return ours

    def _end(self, kill: bool) -> int | None:
        """Stop the process (told to, or killed) and forget it: its exit status."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if process is None or connection is None:
            return None
        if not kill:
            with contextlib.suppress(OSError):
                connection.send(None)
        connection.close()
        if kill:
            return _killed(process)
        try:
            return process.wait(timeout=END_WAIT_S)
        except subprocess.TimeoutExpired:
            return _killed(process)


def _killed(process: subprocess.Popen[bytes]) -> int:
    process.kill()
    return process.wait()
