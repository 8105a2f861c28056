"""A job process's helpers (page preparation, scoring) as fresh interpreters on a pipe: never a fork (the
job's process has initialised CUDA and OpenMP), nor multiprocessing's Process (which a Celery child,
daemonic to multiprocessing, may not start). A helper dies with the job's process and ignores Ctrl-C."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection

from celery.platforms import set_pdeathsig

# The helper: this process's module path (as multiprocessing's spawn hands it over), then `module.serve`
# on the end of the pipe it inherits, its parent's pid to check.
COMMAND = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from {module} import serve; serve(*map(int, sys.argv[2:]))"
)


def start_helper(module: str) -> tuple[subprocess.Popen[bytes], Connection]:
    """`module.serve(fd, parent)` in a fresh interpreter, and this process's end of its pipe."""
    ours, theirs = multiprocessing.Pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", COMMAND.format(module=module), json.dumps(sys.path), str(theirs.fileno()),
             str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


def helper_connection(fd: int, parent: int) -> Connection | None:
    """In a helper: die with `parent` (SIGKILL), ignore Ctrl-C (it reaches the whole process group); its
    end of the pipe, or None when its parent died before the signal was set."""
    set_pdeathsig("SIGKILL")
    if os.getppid() != parent:
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return Connection(fd)
