"""Where the fast engine's compilations persist between process starts.

torch keeps what inductor builds (FX graphs, AOTAutograd graphs, Triton kernels and their autotuning
choices) in an on-disk cache, by default in /tmp, which a container or a rebooted host loses.
DSOCR_COMPILE_CACHE_DIR names a directory that outlives the process (a volume per host,
deploy/README.md); the fast engine points torch's cache there before its first compilation.

Python's own bytecode is the other cost of every start where the installation ships none and may not
write it (PYTHONDONTWRITEBYTECODE, a read-only image): the build step (`dsocr precompile`) writes the
bytecode of every module a worker imports into the same directory (`write_bytecode`), and every start
reads it (`use_bytecode_cache`). An image build covers its own sources with `python -m compileall`.
"""

from __future__ import annotations

import compileall
import fcntl
import importlib.util
import logging
import os
import py_compile
import sys
from pathlib import Path
from types import ModuleType

from dsocr_workers import settings

# torch's own variable: inductor's cache root, with Triton's kernel cache beneath it.
TORCH_CACHE_ENV = settings.TORCH_CACHE_DIR.name
# Python's: where bytecode is read and written instead of each source's __pycache__.
BYTECODE_PREFIX_ENV = settings.BYTECODE_PREFIX.name
BYTECODE_DIR = "python-bytecode"
# Left by a writer that wrote every source it was given: imports may read from the directory.
BYTECODE_WRITTEN = "written"
# Held by the writer at work: two builds on one host write one after the other (an flock: released when
# its holder exits, however it exits).
BYTECODE_LOCK = "writing.lock"
# Bytecode checked against its source's hash, not its modification time: a reinstall of the same
# packages or a copy of the tree changes the times and would make every file's bytecode stale.
CHECKED = py_compile.PycInvalidationMode.CHECKED_HASH
CHECKED_FLAGS = 0b11  # the header's flags of such bytecode (PEP 552): hash-based, checked
# Where `write_bytecode` writes: set by `use_bytecode_cache` in this process.
_writes_to: Path | None = None

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
    default = settings.read(settings.TORCH_CACHE_DIR, environ) or "under /tmp"
    directory = _cache_directory(raw, f"compiled kernels stay in torch's default cache ({default})")
    if directory is not None:
        environ[TORCH_CACHE_ENV] = str(directory)
    return directory


def use_bytecode_cache(
    environ: dict[str, str] | os._Environ[str] = os.environ, probe: str = "torch"
) -> Path | None:
    """Keep Python's bytecode in DSOCR_COMPILE_CACHE_DIR/python-bytecode when the installation has none
    for `probe` (the largest import of a worker) and this process may not write it beside the sources:
    the build step writes there (`write_bytecode`), and from then on, imports read from there. The
    directory, or None where Python's own behaviour stands (bytecode present or writable, no
    DSOCR_COMPILE_CACHE_DIR, or PYTHONPYCACHEPREFIX chosen by the user). Called before the heavy
    imports; processes this one starts inherit the reading (the environment).

    Nothing changes before a build has written it: reading from a directory Python would also ignore
    the bytecode the system ships for the standard library, and writing as the imports go is slower
    still."""
    global _writes_to
    raw = settings.read(settings.COMPILE_CACHE_DIR, environ)
    if raw is None or settings.read(settings.BYTECODE_PREFIX, environ) or sys.pycache_prefix:
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


def bytecode_directory() -> Path | None:
    """Where this process keeps bytecode (`use_bytecode_cache` chose it), or None: the installation's
    serves."""
    return _writes_to


def write_bytecode(modules: list[ModuleType] | None = None) -> int | None:
    """The build step's: the bytecode of `modules` (default: every module imported) written into the
    directory `use_bytecode_cache` chose, then the directory marked written (imports read from it from
    the next start on); only sources whose bytecode is missing or of other content (`_stale`), under the
    writers' lock. The count written, or None where there is no such directory (the installation's
    bytecode serves)."""
    if _writes_to is None:
        return None
    sources = [
        source
        for source in _sources(list(sys.modules.values()) if modules is None else modules)
        if _stale(source, _writes_to)
    ]
    _writes_to.mkdir(parents=True, exist_ok=True)
    before = sys.pycache_prefix
    with open(_writes_to / BYTECODE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sys.pycache_prefix = str(_writes_to)  # where compileall writes (cache_from_source reads it)
        try:
            # Every source tried, whichever fails: a list, not all()'s short circuit.
            failed = [source for source in sources if not compileall.compile_file(source, quiet=2, invalidation_mode=CHECKED)]
        finally:
            sys.pycache_prefix = before
        if failed:
            log.warning("no bytecode for %d of %d sources (first: %s)", len(failed), len(sources), failed[0])
        (_writes_to / BYTECODE_WRITTEN).touch()
    log.info("wrote the bytecode of %d modules into %s", len(sources) - len(failed), _writes_to)
    return len(sources) - len(failed)


def _sources(modules: list[ModuleType]) -> list[str]:
    found = (getattr(getattr(module, "__spec__", None), "origin", None) for module in modules)
    return sorted({origin for origin in found if isinstance(origin, str) and origin.endswith(".py")})


def _stale(source: str, prefix: Path) -> bool:
    """No bytecode under `prefix` for `source`, or not checked bytecode of this content: the source's
    hash in the header differs, as Python itself checks it on import."""
    before = sys.pycache_prefix
    sys.pycache_prefix = str(prefix)
    try:
        compiled = importlib.util.cache_from_source(source)
    finally:
        sys.pycache_prefix = before
    try:
        with open(compiled, "rb") as file:
            header = file.read(16)
        with open(source, "rb") as file:
            content = file.read()
    except OSError:
        return os.path.isfile(source)
    flags = int.from_bytes(header[4:8], "little")
    return flags != CHECKED_FLAGS or header[8:16] != importlib.util.source_hash(content)
