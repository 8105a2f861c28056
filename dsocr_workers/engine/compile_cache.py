"""Where the fast engine's compilations persist between process starts.

torch keeps what inductor builds (FX graphs, AOTAutograd graphs, Triton kernels and their autotuning
choices) in an on-disk cache keyed by the graph, the device and the versions, so a process that compiles
the same model again loads kernels instead of building them. By default that cache sits in /tmp, which a
container or a rebooted host loses: every worker start then compiles from nothing. DSOCR_COMPILE_CACHE_DIR
names a directory that outlives the process (a volume per host in docker-compose.yml and Kubernetes,
deploy/README.md); the fast engine points torch's cache there before its first compilation.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

COMPILE_CACHE_ENV = "DSOCR_COMPILE_CACHE_DIR"
# torch's own variable: inductor's cache root, with Triton's kernel cache beneath it.
TORCH_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

log = logging.getLogger(__name__)


def use_compile_cache(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path | None:
    """Point torch's compile cache at DSOCR_COMPILE_CACHE_DIR (created if missing) when it is set;
    the directory in use, or None when torch keeps its default. A directory that cannot be used costs
    a warning and the default, not the worker: it only makes the next start slower."""
    raw = environ.get(COMPILE_CACHE_ENV)
    if not raw:
        return None
    directory = Path(raw).expanduser().resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(directory, os.W_OK) else "is not writable by this process"
    except OSError as exc:
        problem = f"cannot be created ({exc.strerror})"
    if problem:
        log.warning("%s=%s %s: compiled kernels stay in torch's default cache (%s)", COMPILE_CACHE_ENV, raw,
                    problem, environ.get(TORCH_CACHE_ENV, "under /tmp"))  # fmt: skip
        return None
    environ[TORCH_CACHE_ENV] = str(directory)
    return directory
