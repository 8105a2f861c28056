"""A cold start's graphs, compiled by helper processes while the worker starts.

Compiling is Python on one core of a host that has many, and inductor's on-disk cache (cache.py) is shared
by every process of the host: so helper processes compile the warm-up's graphs into the cache, each a
share (`CompileShare`: some vision view sizes, the LM prefill, or the decode step), and the worker then
traces each graph once and loads it. A helper compiles from zeros (`checkpoint.build_vision_only`,
`build_zeroed`: a graph depends on shapes, dtypes and devices, never values) and runs the warm-up's pages
as the worker will, or the cache misses and the worker compiles: slower, never wrong. A helper that fails
or overruns costs a warning and the same. Started before the worker's load, while CUDA is not yet
initialised, helpers are forked with the worker's imports done; a warm-up with CUDA up spawns them.
A completed warm-up's marker (`CompilePlan`) stops helpers; each share is compiled once per host
(`ShareLock` and a done file: a worker's other GPUs see theirs as cuda:0 too, farm/devices.py). A
helper dies with the process that started it (`exit_with_the_worker`).
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import torch

from dsocr_workers.engine.coldstart.artifacts import listed_without_gpu
from dsocr_workers.engine.coldstart.helper_process import run
from dsocr_workers.engine.coldstart.plan import (
    HELPER_TIMEOUT_S,
    CompilePlan,
    CompileShare,
    HelperResult,
    HelperTask,
    PrecompileReport,
    compile_plan,
    helper_processes,
)
from dsocr_workers.engine.device import resolve_dtype
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants import make_engine
from dsocr_workers.engine.variants.base import Engine
from dsocr_workers.model.checkpoint import model_config
from dsocr_workers.model.families import all_presets, family_of_model

log = logging.getLogger(__name__)


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
            env = {}
            if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
                count = threads * (1 if compile_share.kind == "vision" else 2)
                env["TORCHINDUCTOR_COMPILE_THREADS"] = str(count)
            # Files, not pipes: a helper's output can fill a pipe nobody reads until `wait`, which
            # closes them.
            stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
            process: _Process
            if fork:
                process = _fork(task, env, stdout, stderr)
            else:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "dsocr_workers.engine.coldstart.helper_process",
                        task.to_json(),
                        str(os.getpid()),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    env={**os.environ, **env},
                )
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
            log.warning(
                "compile helper (%s) failed, %s; the worker compiles its graphs itself:\n%s",
                helper.share.label,
                why,
                err[-2000:],
            )
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
        return PrecompileReport(
            processes,
            self.how,
            max(0.0, self._ended - self._began),
            tuple(self._results),
            tuple(self._failures),
        )


def _fork(task: HelperTask, env: dict[str, str], stdout: IO[bytes], stderr: IO[bytes]) -> _Forked:
    """`task`'s helper in a forked child, its output in the files given; the child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    worker = os.getpid()
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
        code = run(task, worker)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # No atexit, no finalizer of the worker's objects (its ledger's connections, its files).
            os._exit(code)


def start_helpers(
    source: str | os.PathLike,
    device: str,
    dtype: str | None,
    engine: str | Engine,
    modes: Sequence[str],
    max_new_tokens: int | None = None,
    infer: DecodeOptions | None = None,
    max_crops: int | None = None,
) -> CompileHelpers | None:
    """Fork the compile helpers of a warm-up before its model is loaded: call after the imports, before
    anything initialises CUDA or starts a thread in this process; hand them to `warm(helpers=...)`. They
    begin compiling at once, with the imports done, while this process loads its checkpoint. None where
    the engine compiles nothing, no helper is wanted (DSOCR_COMPILE_PROCESSES=0), or CUDA is initialised
    here already (the warm-up then spawns them if the cache is cold), or artifacts are listed for this
    plan (artifacts.py: the warm-up checks them against this GPU once CUDA is up). A helper that finds
    them exits at once. `engine`: a registered name or an engine object, as
    `DeepSeekOCRSession.from_local` takes it."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", 0)  # as resolve_device names it; asking CUDA here would initialise it
    variant = engine if isinstance(engine, Engine) else make_engine(engine, resolved.type)[0]
    path = os.fspath(source)
    path = path if path in all_presets() else str(Path(path).resolve())  # as from_local names a checkpoint
    family = family_of_model(path)
    plan = compile_plan(
        path,
        resolved,
        resolve_dtype(dtype, resolved),
        variant.kernels(),
        variant.compiled(),
        modes,
        max_new_tokens,
        infer,
        family.max_crops if max_crops is None else max_crops,
        engine=variant.name,
        family=family.name,
    )
    processes = helper_processes()
    if plan is None or processes == 0 or torch.cuda.is_initialized():
        return None
    if listed_without_gpu(plan, model_config(path)):
        log.info(
            "artifacts are listed for this warm-up; no compile helper forked (the warm-up checks the GPU)"
        )
        return None
    return CompileHelpers.start(plan, processes, fork=True)
