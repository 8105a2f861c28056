"""Where the fast engine's compilations persist between process starts.

torch keeps what inductor builds (FX graphs, AOTAutograd graphs, Triton kernels and their autotuning
choices) in an on-disk cache keyed by the graph, the device and the versions, so a process that compiles
the same model again loads kernels instead of building them. By default that cache sits in /tmp, which a
container or a rebooted host loses: every worker start then compiles from nothing. DSOCR_COMPILE_CACHE_DIR
names a directory that outlives the process (a volume per host in docker-compose.yml and Kubernetes,
deploy/README.md); the fast engine points torch's cache there before its first compilation.

Python's own compilation is the other cost of every start: an installation that ships no bytecode and
may not write it (PYTHONDONTWRITEBYTECODE, as many container images set, or a read-only image) compiles
torch's, transformers' and this package's sources again in every process. On the H100 host's image that
was half of a worker's imports (10.4–10.9 s against 5.1–5.6 s with a bytecode cache) and half of its
checkpoint load (4.7–5.3 s against 2.6–2.8 s: inductor's modules imported on first use). There the
bytecode is kept beside the compiled kernels, in the same directory: a ready process writes what it
compiled in memory (`write_bytecode`), and later starts read it (`use_bytecode_cache`).
"""

from __future__ import annotations

import compileall
import fcntl
import importlib.util
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

from dsocr_workers import settings

# torch's own variable: inductor's cache root, with Triton's kernel cache beneath it.
TORCH_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Python's: where bytecode is read and written instead of each source's __pycache__.
BYTECODE_PREFIX_ENV = "PYTHONPYCACHEPREFIX"
BYTECODE_DIR = "python-bytecode"
# Left by a writer that wrote every source it was given: imports may read from the directory.
BYTECODE_WRITTEN = "written"
# Held by the writer at work: the other worker children of a host, ready at the same time with the same
# modules, leave the writing to it (an flock: released when its holder exits, however it exits).
BYTECODE_LOCK = "writing.lock"
# Where `write_bytecode` writes: set by `use_bytecode_cache` in this process or the one it was forked from.
_writes_to: Path | None = None
# The sources this process handed to a writer: a later warm-up's call hands only what is new since.
_handed: set[str] = set()

log = logging.getLogger(__name__)


def _cache_directory(raw: Path, what: str) -> Path | None:
    """DSOCR_COMPILE_CACHE_DIR's value resolved and created, or None (and a warning saying where `what`
    stays instead) when this process cannot write there."""
    directory = raw.resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(directory, os.W_OK) else "is not writable by this process"
    except OSError as exc:
        problem = f"cannot be created ({exc.strerror})"
    if problem:
        log.warning("%s=%s %s: %s", settings.COMPILE_CACHE_DIR.name, raw, problem, what)
        return None
    return directory


def use_compile_cache(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path | None:
    """Point torch's compile cache at DSOCR_COMPILE_CACHE_DIR (created if missing) when it is set;
    the directory in use, or None when torch keeps its default. A directory that cannot be used costs
    a warning and the default, not the worker: it only makes the next start slower."""
    raw = settings.read(settings.COMPILE_CACHE_DIR, environ)
    if raw is None:
        return None
    default = environ.get(TORCH_CACHE_ENV, "under /tmp")
    directory = _cache_directory(raw, f"compiled kernels stay in torch's default cache ({default})")
    if directory is not None:
        environ[TORCH_CACHE_ENV] = str(directory)
    return directory


def use_bytecode_cache(environ: dict[str, str] | os._Environ[str] = os.environ, probe: str = "torch") -> Path | None:
    """Keep Python's bytecode in DSOCR_COMPILE_CACHE_DIR/python-bytecode when the installation has none
    for `probe` (the largest import of a worker) and this process may not write it beside the sources:
    `write_bytecode` writes there once the process is ready, and from the next start on, imports read
    from there. The directory, or None where Python's own behaviour stands (bytecode present or writable,
    no DSOCR_COMPILE_CACHE_DIR, or PYTHONPYCACHEPREFIX chosen by the user). Called before the heavy
    imports; processes this one starts inherit the reading (the environment), those it forks the writing.

    Nothing changes for the first start, whose writer has not finished: reading from a directory Python
    would also ignore the bytecode the system ships for the standard library (+5 s of a cold start's
    imports on the GPU host), and writing as the imports go added 8–12 s there."""
    global _writes_to
    raw = settings.read(settings.COMPILE_CACHE_DIR, environ)
    if raw is None or environ.get(BYTECODE_PREFIX_ENV) or sys.pycache_prefix:
        return None
    spec = importlib.util.find_spec(probe)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    if not sys.dont_write_bytecode and os.access(os.path.dirname(spec.origin), os.W_OK):
        return None  # Python writes it beside the sources on the first import
    directory = _cache_directory(raw, "Python compiles every source again in each process")
    if directory is None:
        return None
    _writes_to = directory / BYTECODE_DIR
    if (_writes_to / BYTECODE_WRITTEN).exists():
        sys.pycache_prefix = environ[BYTECODE_PREFIX_ENV] = str(_writes_to)
    return _writes_to


def write_bytecode(modules: list[ModuleType] | None = None) -> subprocess.Popen[bytes] | None:
    """Once the process is ready (loaded and warm): the bytecode of the modules it imported (`modules`,
    default all) written into the directory `use_bytecode_cache` chose, by a background process; every
    module on a first start, those whose bytecode is missing or older than their source once imports
    read from there; never twice the same source in one process. None when there is no such directory or
    nothing to write."""
    if _writes_to is None:
        return None
    sources = [source for source in _sources(list(sys.modules.values()) if modules is None else modules)
               if source not in _handed]  # fmt: skip
    if sys.pycache_prefix == str(_writes_to):
        sources = [source for source in sources if _stale(source)]
    if not sources:
        return None
    _handed.update(sources)
    writer = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, BYTECODE_PREFIX_ENV: str(_writes_to)})  # fmt: skip
    # Fed and reaped by a thread: the list outgrows a pipe's buffer, and nothing here waits for it.
    threading.Thread(target=writer.communicate, args=("\n".join(sources).encode(),), daemon=True,
                     name="bytecode-writer").start()  # fmt: skip
    log.info("writing the bytecode of %d modules into %s (pid %d)", len(sources), _writes_to, writer.pid)
    return writer


def _sources(modules: list[ModuleType]) -> list[str]:
    found = (getattr(getattr(module, "__spec__", None), "origin", None) for module in modules)
    return sorted({origin for origin in found if isinstance(origin, str) and origin.endswith(".py")})


def _stale(source: str) -> bool:
    try:
        written = os.stat(importlib.util.cache_from_source(source)).st_mtime
    except OSError:
        return os.path.isfile(source)
    return written < os.stat(source).st_mtime


def _write() -> int:
    """The writer process (`python -m dsocr_workers.engine.compile_cache`, PYTHONPYCACHEPREFIX set, one
    source per line on stdin): niced, so that it takes no core from the worker's jobs; compileall's
    freshness check and atomic writes; the directory marked written once every source is. Exits at once
    where another writer holds the lock."""
    os.nice(10)
    prefix = Path(sys.pycache_prefix or "")
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / BYTECODE_LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        # Every source tried, whichever fails: a list, not all()'s short circuit.
        if not all([compileall.compile_file(source, quiet=2) for source in sys.stdin.read().splitlines()]):
            return 1
        (prefix / BYTECODE_WRITTEN).touch()
    return 0


if __name__ == "__main__":
    sys.exit(_write() if sys.pycache_prefix else 2)
