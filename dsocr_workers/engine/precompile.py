"""A cold start's graphs, compiled by helper processes while the worker starts.

With an empty compile cache, a fast worker spent most of its start in torch.compile, one graph after
another: on an H200, 88 s from launch to ready, 60 of them compiling (SAM 30.6 s in 10 graphs, two kinds
of block × five view sizes; the decode step 16.3; the LM layers 7.2; CLIP 5.8: docs/benchmarks.md).
Dynamo, AOTAutograd and inductor's lowering are Python, on one core of a host that has many, and
inductor's on-disk cache (engine/compile_cache.py) is shared by every process of the host. So helper
processes compile the graphs into the cache, each a share of them (`CompileShare`): the SAM and CLIP
graphs of some view sizes (a vision share), or the language model's (the LM prefill's layers and the
decode step, over the warm-up's prompts: the language share). The worker then traces each graph once
and loads what the helpers compiled instead of compiling it.

A helper compiles from zeros, not the checkpoint (`checkpoint.build_vision_only`, `build_zeroed`): a
graph depends on the weights' shapes, dtypes and devices, never their values. It runs the warm-up's
pages as the worker will (same modules, dtype, compile settings, inference mode, order), or the cache
misses and the worker compiles those graphs itself: slower, never wrong. A helper that fails or overruns
costs a warning and the same.

Started before the worker loads its checkpoint (`CompileHelpers.start(..., fork=True)`, while CUDA is not
yet initialised in the worker), helpers are forked: they begin with the worker's imports done (a spawned
helper spent ~15 s of an H200 host's start importing torch and transformers). A warm-up that starts
them itself, with CUDA initialised, spawns them instead.

A warm-up that completed leaves a marker in the compile cache for its plan (`CompilePlan`: the torch
version, the GPU, the model's architecture, the modes, the jobs' budget and decode options, this
package's code); a helper that finds it compiles nothing, and a warm-up that finds it starts no helper.
Each share is compiled once per host: a helper holds its share's lock while compiling and leaves a done
file; another process's helper of the same share waits for the lock and takes the done file as its
answer (a worker's other GPUs, which see their GPU as cuda:0 too: farm/job/process.py). A helper dies with the
process that started it (`exit_with_the_worker`).
"""

from __future__ import annotations

import contextlib
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
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Literal, Protocol

import torch

import dsocr_workers
from dsocr_workers import settings
from dsocr_workers.engine.compile_cache import TORCH_CACHE_ENV
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.model.config import OCRConfig, get_mode
from dsocr_workers.model.preprocess import TILE_SIZE

log = logging.getLogger(__name__)

PROCESSES_ENV = settings.COMPILE_PROCESSES.name
# A helper's graphs took 18-28 s on an H100, forked beside five others (docs/benchmarks.md); far past
# that it is stuck, and the worker compiles without it.
HELPER_TIMEOUT_S = 300.0
WORKER_PID_ENV = "DSOCR_HELPER_OF"  # the process whose warm-up started a helper
_PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass(frozen=True)
class VisionShapes:
    """The vision graphs of one view size: the global view of `mode` (SAM's two kinds of block at batch
    1, then CLIP), or the tiles of a crop mode (SAM's two kinds of block with the tile batch dynamic, run
    at every tile count, then CLIP over the global view and the tiles together, as a page runs it)."""

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
    """How many vision helpers (the two language helpers come with them); 0: the worker compiles alone."""
    return settings.read(settings.COMPILE_PROCESSES, environ)


@dataclass(frozen=True)
class CompilePlan:
    """One warm-up (`DeepSeekOCRSession.warmup`) as its graphs depend on it: the session's settings, the
    modes, and the jobs' token budget and decode options (the decode step is compiled per cache bucket
    and per n-gram ban). Helpers compile for it; its marker says a warm-up of it completed."""

    source: str  # preset name or checkpoint directory: its architecture only
    device: str
    dtype: str  # "bfloat16", ...
    attn_implementation: str
    experts_implementation: str
    backend: str
    dynamic_tiles: bool
    cuda_graphs: bool
    max_crops: int
    modes: tuple[str, ...]
    max_new_tokens: int | None
    options: DecodeOptions = DecodeOptions()

    def shares(self, processes: int) -> list[CompileShare]:
        """The language model's two shares (the decode step, the longest to compile; the LM prefill),
        then the vision view sizes in `processes` shares."""
        vision = [CompileShare("vision", tuple(group)) for group in share(vision_shapes(self.modes), processes)]
        return [CompileShare("decode"), CompileShare("prefill"), *vision]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict) -> CompilePlan:
        options = fields["options"]
        return cls(**{**fields, "modes": tuple(fields["modes"]),
                      "options": DecodeOptions(**{**options, "ngram_whitelist": tuple(options["ngram_whitelist"])})})  # fmt: skip


@dataclass(frozen=True)
class CompileShare:
    """A helper's part of a plan: the SAM and CLIP graphs of some view sizes ("vision"), the LM
    prefill's layers ("prefill") or the decode step ("decode")."""

    kind: Literal["vision", "prefill", "decode"]
    shapes: tuple[VisionShapes, ...] = ()  # vision: its view sizes

    @property
    def label(self) -> str:
        if self.kind == "vision":
            return ", ".join(shape.label for shape in self.shapes)
        return "LM prefill" if self.kind == "prefill" else "decode step"


@dataclass(frozen=True)
class HelperTask:
    plan: CompilePlan
    share: CompileShare

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan.to_json(), "share": asdict(self.share)})

    @classmethod
    def from_json(cls, text: str) -> HelperTask:
        fields = json.loads(text)
        shapes = tuple(VisionShapes(**shape) for shape in fields["share"]["shapes"])
        return cls(CompilePlan.from_json(fields["plan"]), CompileShare(fields["share"]["kind"], shapes))


@dataclass(frozen=True)
class HelperResult:
    """A helper's report (its last line of standard output)."""

    share: str
    # "compiled"; "warm" (the plan's marker was there); "shared" (another process's helper compiled
    # this share: its done file)
    outcome: str
    graphs: int  # compiled in the helper (dynamo's count)
    cache_hits: int  # inductor's FX graph cache: found there instead (a cache someone filled before)
    seconds: float  # from the helper's start (after the imports) to its report
    peak_memory_bytes: int  # on its GPU (the caching allocator's peak); 0 on a CPU


@dataclass(frozen=True)
class PrecompileReport:
    processes: int
    how: str  # "forked" or "spawned"
    seconds: float  # from the first helper's start to the last one's end
    results: tuple[HelperResult, ...]
    failures: tuple[str, ...]  # "<share>: <why>"


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


def warm_marker(plan: CompilePlan, config: OCRConfig) -> Path:
    """The file a completed warm-up of `plan` leaves in the compile cache. Initialises CUDA (the GPU's
    name is part of it)."""
    device = torch.device(plan.device)
    # The GPU's index too: compiled graphs name it, so a cache warmed on cuda:0 is cold for cuda:1.
    gpu = f"{torch.cuda.get_device_name(device)} as {device}" if device.type == "cuda" else "cpu"
    fields = {**asdict(plan), "device": gpu, "config": repr(config), "torch": torch.__version__,
              "code": _code_fingerprint()}  # fmt: skip
    key = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]
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


class ShareLock:
    """One helper compiles a share on a host at a time: an flock on `<marker>.<share>.lock` in the shared
    cache, and a `.done` file beside it once the share is compiled. The kernel releases the lock of a
    process that dies (and that process left no done file: the next one compiles)."""

    def __init__(self, file: IO[bytes] | None) -> None:
        self._file = file  # None: no lock could be made (an unwritable cache); nothing is shared

    @staticmethod
    def paths(marker: Path, share: CompileShare) -> tuple[Path, Path]:
        key = hashlib.sha256(share.label.encode()).hexdigest()[:12]
        return marker.with_name(f"{marker.name}.{key}.lock"), marker.with_name(f"{marker.name}.{key}.done")

    @classmethod
    def take(cls, path: Path) -> ShareLock | None:
        """The lock, or None while another process holds it."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = path.open("ab")
        except OSError as exc:
            log.warning("no lock for the compile helpers (%s): %s; they run unshared", path, exc)
            return cls(None)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            return None
        return cls(file)

    @classmethod
    def hold(cls, path: Path, timeout_s: float = HELPER_TIMEOUT_S) -> ShareLock | None:
        """The lock once no other process holds it; None at the timeout."""
        deadline = time.monotonic() + timeout_s
        while (lock := cls.take(path)) is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return lock

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases its flock


class _Process(Protocol):
    pid: int

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass
class _Forked:
    """A forked helper, waited for as a `subprocess.Popen` is."""

    pid: int
    returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            else:
                time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


@dataclass
class _Running:
    share: CompileShare
    process: _Process
    stdout: IO[bytes]
    stderr: IO[bytes]


@dataclass
class CompileHelpers:
    """Helper processes compiling a plan's shares into the shared cache; `wait()` for their report."""

    plan: CompilePlan
    how: str
    _running: list[_Running]
    _began: float
    _results: list[HelperResult] = field(default_factory=list)
    _failures: list[str] = field(default_factory=list)
    _ended: float = 0.0

    @classmethod
    def start(cls, plan: CompilePlan, processes: int, *, fork: bool = False) -> CompileHelpers:
        """A helper per share of `plan` (`processes` vision helpers; the decode step's and the LM
        prefill's). `fork`: fork them from this process, which has imported the engine and must not have
        initialised CUDA (a forked child cannot use it then) nor started threads; otherwise spawn them
        (each imports torch).
        Each gets an equal share of the host's cores for inductor's Triton compile pool, the language
        helpers twice that, unless TORCHINDUCTOR_COMPILE_THREADS says otherwise (a setting outside the
        cache key)."""
        shares = plan.shares(processes)
        cores = os.cpu_count() or 1
        threads = max(1, cores // (len(shares) + 2))
        running = []
        for compile_share in shares:
            task = HelperTask(plan, compile_share)
            env = {WORKER_PID_ENV: str(os.getpid())}
            if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
                count = threads * (1 if compile_share.kind == "vision" else 2)
                env["TORCHINDUCTOR_COMPILE_THREADS"] = str(count)
            # Files, not pipes: a helper's output can fill a pipe nobody reads until `wait`, which closes them.
            stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
            process: _Process
            if fork:
                process = _fork(task, env, stdout, stderr)
            else:
                process = subprocess.Popen(
                    [sys.executable, "-m", "dsocr_workers.engine.compile_helper", task.to_json()],
                    stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env={**os.environ, **env},
                )  # fmt: skip
            running.append(_Running(compile_share, process, stdout, stderr))
        return cls(plan, "forked" if fork else "spawned", running, time.perf_counter())

    def wait(self, kind: str | None = None, timeout_s: float = HELPER_TIMEOUT_S) -> PrecompileReport:
        """Every helper's result (of `kind` only, if given), or why it has none; a helper still running
        at the timeout is killed. The report holds every helper waited for so far."""
        deadline = time.monotonic() + timeout_s
        for helper in [h for h in self._running if kind is None or h.share.kind == kind]:
            self._running.remove(helper)
            try:
                code = helper.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                helper.process.kill()
                helper.process.wait()
                code = None
            self._ended = time.perf_counter()
            helper.stdout.seek(0)
            helper.stderr.seek(0)
            out, err = (
                helper.stdout.read().decode(errors="replace"),
                helper.stderr.read().decode(errors="replace"),
            )
            helper.stdout.close()
            helper.stderr.close()
            if code == 0 and out.strip():
                self._results.append(HelperResult(**json.loads(out.strip().splitlines()[-1])))
                continue
            why = f"no result in {timeout_s:.0f} s, killed" if code is None else f"exit code {code}"
            self._failures.append(f"{helper.share.label}: {why}")
            log.warning("compile helper (%s) failed, %s; the worker compiles its graphs itself:\n%s",
                        helper.share.label, why, err[-2000:])  # fmt: skip
        return self.report()

    def stop(self) -> None:
        """Kill the helpers still running (a failed warm-up)."""
        for helper in self._running:
            helper.process.kill()
            helper.process.wait()
            helper.stdout.close()
            helper.stderr.close()
        self._running.clear()

    def report(self) -> PrecompileReport:
        processes = len(self._results) + len(self._failures) + len(self._running)
        return PrecompileReport(processes, self.how, max(0.0, self._ended - self._began), tuple(self._results),
                                tuple(self._failures))  # fmt: skip


def _fork(task: HelperTask, env: dict[str, str], stdout: IO[bytes], stderr: IO[bytes]) -> _Forked:
    """`task`'s helper in a forked child, its output in the files given; the child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    code = 1
    try:  # the helper: nothing of the worker's below runs in it
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        # Python's streams onto them too: the worker's may be another object (Celery can redirect them).
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.update(env)
        from dsocr_workers.engine.compile_helper import run

        code = run(task)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # No atexit, no finalizer of the worker's objects (its ledger's connections, its files).
            os._exit(code)
