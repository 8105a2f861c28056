"""A cold start's vision graphs, compiled by helper processes while the worker compiles its language model.

With an empty compile cache, a fast worker spent most of its start in torch.compile, one graph after
another: on an H200, 88 s from launch to ready, 60 of them compiling (SAM 30.6 s in 10 graphs, two kinds
of block × five view sizes; the decode step 16.3; the LM layers 7.2; CLIP 5.8: docs/benchmarks.md).
Dynamo, AOTAutograd and inductor's lowering are Python, on one core of a host that has many. A vision
graph depends on its view size only, and inductor's on-disk cache (engine/compile_cache.py) is shared by
every process of the host. So the warm-up starts helper processes (`python -m
dsocr_workers.engine.vision_helper`), each compiling the SAM and CLIP graphs of some view sizes into the
cache, while the worker compiles its language model (a page's LM prefill and decode, without the image).
Then the worker's own passes trace the vision graphs again and load what the helpers compiled instead of
compiling it.

A helper builds the vision encoders only, with zeros for weights (`checkpoint.build_vision_only`; the
language model stays on the meta device): it reads no checkpoint and holds no language model in GPU
memory. It runs the warm-up's pages of its view sizes as the worker will (same modules, dtype, compile
settings, inference mode), or the cache misses and the worker compiles those graphs itself: slower, never
wrong. A helper that fails or overruns costs a warning and the same.

A warm-up that completed leaves a marker in the compile cache for its configuration (the torch version,
the device, the model's architecture, the modes, this package's code), and later starts, whose cache is
warm, skip the helpers: they would spend seconds importing torch to load what the worker loads itself.
A host runs one set of helpers per configuration (`HelpersLock`: a worker's other GPUs wait for them),
and a helper dies with the process that started it (`exit_with_the_worker`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch

import dsocr_workers
from dsocr_workers.engine.compile_cache import TORCH_CACHE_ENV
from dsocr_workers.errors import InputError
from dsocr_workers.model.config import OCRConfig, get_mode
from dsocr_workers.model.preprocess import TILE_SIZE

log = logging.getLogger(__name__)

PROCESSES_ENV = "DSOCR_COMPILE_PROCESSES"
DEFAULT_PROCESSES = 4  # five vision view sizes in all; the two smallest share a helper
# A helper's start (python, torch, a CUDA context) and its graphs took 32-38 s on an H200 beside a
# worker compiling its language model (docs/benchmarks.md); far past that it is stuck, and the worker
# compiles without it.
HELPER_TIMEOUT_S = 300.0
WORKER_PID_ENV = "DSOCR_HELPER_OF"  # the process whose warm-up started a helper
_PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass(frozen=True)
class VisionShapes:
    """The vision graphs of one view size: the global view of `mode` (SAM's two kinds of block at batch
    1, then CLIP), or the tiles of a crop mode (SAM's two kinds of block with the tile batch dynamic, run
    at every tile count; CLIP over the tiles runs with the global view in one graph, left to the worker)."""

    mode: str  # a mode whose warm-up pages hold these views
    tiles: bool

    @property
    def size(self) -> int:
        return TILE_SIZE if self.tiles else get_mode(self.mode).global_size

    @property
    def label(self) -> str:
        return f"tiles {self.size} px" if self.tiles else f"global {self.size} px"

    @property
    def cost(self) -> float:
        """Compile time, relative: on an H200 (2026-11-26) the global views of 512 / 640 / 1024 / 1280
        px took 3.7 / 4.2 / 9.0 (the process's first graphs) / 7.8 s with CLIP, the tiles 6.0."""
        return 3.0 if self.tiles else 1.0 + self.size / TILE_SIZE


def vision_shapes(modes: Sequence[str]) -> list[VisionShapes]:
    """Every view size `modes` run through the vision encoders, once (gundam's global view is base's)."""
    found: dict[tuple[bool, int], VisionShapes] = {}
    for name in modes:
        mode = get_mode(name)
        found.setdefault((False, mode.global_size), VisionShapes(name, tiles=False))
        if mode.crop_mode:
            found.setdefault((True, TILE_SIZE), VisionShapes(name, tiles=True))
    return list(found.values())


def share(shapes: Sequence[VisionShapes], processes: int) -> list[list[VisionShapes]]:
    """At most `processes` groups of about equal cost: the costliest first, each to the least loaded."""
    groups: list[list[VisionShapes]] = [[] for _ in range(min(processes, len(shapes)))]
    for shape in sorted(shapes, key=lambda s: -s.cost):
        min(groups, key=lambda g: sum(s.cost for s in g)).append(shape)
    return groups


def helper_processes(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    raw = environ.get(PROCESSES_ENV, "").strip()
    if not raw:
        return DEFAULT_PROCESSES
    if not raw.isdigit():
        raise InputError(
            f"{PROCESSES_ENV}={raw!r}: expected a count of processes, 0 to compile in the worker only"
        )
    return int(raw)


@dataclass(frozen=True)
class HelperTask:
    """What one helper compiles, and the session settings its graphs must share with the worker's."""

    source: str  # preset name or checkpoint directory: its architecture only
    device: str
    dtype: str  # "bfloat16", ...
    attn_implementation: str
    backend: str
    dynamic_tiles: bool
    max_crops: int
    shapes: tuple[VisionShapes, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HelperTask:
        fields = json.loads(text)
        fields["shapes"] = tuple(VisionShapes(**shape) for shape in fields["shapes"])
        return cls(**fields)


@dataclass(frozen=True)
class HelperResult:
    """A helper's report (its last line of standard output)."""

    shapes: list[str]
    graphs: int  # compiled in the helper (dynamo's count)
    cache_hits: int  # inductor's FX graph cache: found there instead (a cache someone filled before)
    seconds: float  # building the encoders and running them (compiling), after the imports
    peak_memory_bytes: int  # on its GPU (the caching allocator's peak); 0 on a CPU


@dataclass(frozen=True)
class PrecompileReport:
    processes: int
    seconds: float  # from the first helper's start to the last one's end
    results: tuple[HelperResult, ...]
    failures: tuple[str, ...]  # "<shapes>: <why>"


def cache_root() -> Path:
    """inductor's cache directory, as this process (and its helpers) use it."""
    explicit = os.environ.get(TORCH_CACHE_ENV)
    if explicit:
        return Path(explicit)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    package = Path(dsocr_workers.__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def warm_marker(task: HelperTask, config: OCRConfig, modes: Sequence[str]) -> Path:
    """The file a completed warm-up of this configuration leaves in the compile cache."""
    device = torch.device(task.device)
    # The GPU's index too: compiled graphs name it, so a cache warmed on cuda:0 is cold for cuda:1.
    gpu = f"{torch.cuda.get_device_name(device)} as {device}" if device.type == "cuda" else "cpu"
    fields = {**asdict(task), "device": gpu, "shapes": None, "modes": sorted(modes), "config": repr(config),
              "torch": torch.__version__, "code": _code_fingerprint()}  # fmt: skip
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    return cache_root() / "dsocr-warm" / key


def exit_with_the_worker() -> None:
    """A helper outlives no worker: the kernel kills it when the process that started it dies (Linux's
    parent-death signal), and one whose worker died while it started exits now. Otherwise a worker child
    killed during its warm-up (a hard time limit, an OOM kill) left its helpers compiling on its GPU."""
    worker = int(os.environ.get(WORKER_PID_ENV) or 0)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if worker and os.getppid() != worker:
        os._exit(1)


class HelpersLock:
    """One set of helpers per configuration on a host: the warm-up that takes this lock (an flock on
    `<marker>.lock` beside the warm marker, in the shared cache) starts them; another process warming
    the same configuration meanwhile (a worker's other GPUs: every child's graphs are cuda:0's,
    farm/child.py) compiles its language model and then waits for the lock instead of starting helpers
    of its own, which would compile the same graphs. The kernel releases the lock of a process that dies."""

    def __init__(self, file: IO[bytes] | None) -> None:
        self._file = file  # None: no lock could be made (an unwritable cache); nothing is shared

    @staticmethod
    def path(marker: Path) -> Path:
        return marker.with_name(marker.name + ".lock")

    @classmethod
    def take(cls, marker: Path) -> HelpersLock | None:
        """The lock, or None while another process holds it."""
        path = cls.path(marker)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = path.open("ab")
        except OSError as exc:
            log.warning("no lock for the vision compile helpers (%s): %s; they run unshared", path, exc)
            return cls(None)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            return None
        return cls(file)

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases its flock

    @classmethod
    def wait(cls, marker: Path, timeout_s: float = HELPER_TIMEOUT_S) -> bool:
        """Until no process holds the lock (its helpers are done, or it died); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while (lock := cls.take(marker)) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        lock.release()
        return True


@dataclass
class _Running:
    shapes: tuple[VisionShapes, ...]
    process: subprocess.Popen
    stdout: IO[bytes]
    stderr: IO[bytes]


class VisionHelpers:
    """Helper processes compiling vision graphs into the shared cache; `wait()` for their report."""

    def __init__(self, running: list[_Running], began: float) -> None:
        self._running = running
        self._began = began

    @classmethod
    def start(cls, template: HelperTask, processes: int) -> VisionHelpers:
        """A helper per share of `template.shapes`. Each gets an equal share of the host's cores for
        inductor's Triton compile pool unless TORCHINDUCTOR_COMPILE_THREADS says otherwise (a setting
        outside the cache key)."""
        groups = share(template.shapes, processes)
        env = dict(os.environ)
        env.setdefault(
            "TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // (len(groups) + 1)))
        )
        env[WORKER_PID_ENV] = str(os.getpid())
        running = []
        for group in groups:
            task = HelperTask(**{**asdict(template), "shapes": tuple(group)})
            # Files, not pipes: a helper's output can fill a pipe nobody reads until `wait`, which closes them.
            stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
            process = subprocess.Popen(
                [sys.executable, "-m", "dsocr_workers.engine.vision_helper", task.to_json()],
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
            )  # fmt: skip
            running.append(_Running(task.shapes, process, stdout, stderr))
        return cls(running, time.perf_counter())

    def wait(self, timeout_s: float = HELPER_TIMEOUT_S) -> PrecompileReport:
        """Every helper's result, or why it has none; a helper still running at the timeout is killed."""
        deadline = time.monotonic() + timeout_s
        results, failures = [], []
        for helper in self._running:
            label = ", ".join(shape.label for shape in helper.shapes)
            try:
                code = helper.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                helper.process.kill()
                helper.process.wait()
                code = None
            helper.stdout.seek(0)
            helper.stderr.seek(0)
            out, err = (
                helper.stdout.read().decode(errors="replace"),
                helper.stderr.read().decode(errors="replace"),
            )
            helper.stdout.close()
            helper.stderr.close()
            if code == 0 and out.strip():
                results.append(HelperResult(**json.loads(out.strip().splitlines()[-1])))
                continue
            why = f"no result in {timeout_s:.0f} s, killed" if code is None else f"exit code {code}"
            failures.append(f"{label}: {why}")
            log.warning("vision compile helper (%s) failed, %s; the worker compiles its graphs itself:\n%s",
                        label, why, err[-2000:])  # fmt: skip
        return PrecompileReport(
            len(self._running), time.perf_counter() - self._began, tuple(results), tuple(failures)
        )
