"""What a cold start finds ready: the artifacts built for a plan, the manifest that lists them, and the
refusal of those built for something else.

`dsocr precompile` (coldstart/build.py) writes, in the compile cache (DSOCR_COMPILE_CACHE_DIR):

    <cache>/dsocr-artifacts/<plan key>/<environment key>.json      the manifest
    <cache>/dsocr-artifacts/<batch-1 plan key>/<environment key>/*.pt2     its packages

A batched plan's packages sit with its batch-1 form's (`packages_folder`), so that the second of the two
builds compiles only what the first did not (a package is named by its region key).

The plan key (`plan_key`): the warm-up's plan (with the concurrency a batched worker serves), the model's
configuration and the engine. The environment
(`Environment`): the GPU (name and compute capability), torch, Triton, transformers, this package's version
and code fingerprint. A worker's `lookup` uses a manifest of its environment and never one of another,
saying why ("built for <GPU>, this is <GPU>", "torch A vs B"). The C++ compiler is recorded, not matched.
A manifest lists its artifacts by kind: "aoti-package" (noted by `aoti.region_key`), "python-bytecode"
(cache.py). `FORMAT` changes when an entry's meaning does; another format is refused like any mismatch.
`host_lock`: one process of a host compiles a plan at a time, the build or a worker with nothing built.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

import dsocr_workers
from dsocr_workers.engine.coldstart.plan import CompilePlan, cache_root
from dsocr_workers.settings import CXX, read

log = logging.getLogger(__name__)

FORMAT = 3
MANIFESTS = "dsocr-artifacts"


@functools.cache
def code_fingerprint() -> str:
    """This package's sources: a change to any of them may change a compiled graph."""
    digest = hashlib.sha256()
    package = Path(dsocr_workers.__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def gpu_name(device: torch.device) -> str:
    """The device's name with its compute capability ("<name> (sm_90)"), or "cpu". Initialises CUDA."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


Device = torch.device  # named outside `Environment`, whose field `torch` shadows the module in its body


@dataclass(frozen=True)
class Environment:
    """What, beside the plan, changes the code a plan compiles to."""

    gpu: str
    torch: str
    triton: str
    transformers: str
    project: str
    code: str  # code_fingerprint()

    @classmethod
    def here(cls, device: Device, gpu: str | None = None) -> Environment:
        """This process's; `gpu` given: without asking CUDA (a process that must not initialise it yet)."""
        return cls(
            gpu if gpu is not None else gpu_name(device),
            torch.__version__,
            _version("triton"),
            _version("transformers"),
            dsocr_workers.__version__,
            code_fingerprint(),
        )

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, here: Environment, *, gpu: bool = True) -> list[str]:
        """Why artifacts built in `self` are not for `here`, one phrase per field that differs."""
        found = []
        for name in (f.name for f in fields(self)):
            built, this = getattr(self, name), getattr(here, name)
            if built == this or (name == "gpu" and not gpu):
                continue
            if name == "gpu":
                found.append(f"built for {built}, this is {this}")
            elif name == "code":
                found.append("built by other code of this package (its sources changed)")
            else:
                found.append(f"{name} {built} vs {this}")
        return found


def compiler_version() -> str:
    """The C++ compiler AOTInductor builds with here (`CXX`, else `c++`): its path and version line."""
    cxx = read(CXX) or "c++"
    try:
        line = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        line = "version unknown"
    return f"{cxx}: {line}"


@dataclass(frozen=True)
class Artifact:
    kind: str  # "aoti-package", "python-bytecode"
    path: str  # a directory or file
    note: str = ""  # an aoti-package's region key


@dataclass(frozen=True)
class Manifest:
    plan: dict
    environment: Environment
    artifacts: tuple[Artifact, ...]
    built_by: str  # "dsocr precompile"
    built_at: str  # UTC, ISO 8601
    seconds: float = 0.0  # what the build took
    compiler: str = ""  # what compiled the packages (`compiler_version`): recorded, not matched
    format: int = FORMAT

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        try:
            data = json.loads(path.read_text())
            return cls(
                data["plan"],
                Environment(**data["environment"]),
                tuple(Artifact(**entry) for entry in data["artifacts"]),
                data["built_by"],
                data["built_at"],
                data.get("seconds", 0.0),
                data.get("compiler", ""),
                data.get("format", 0),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable artifact manifest %s (%s): ignored", path, exc)
            return None

    def kinds(self) -> set[str]:
        return {artifact.kind for artifact in self.artifacts}

    def packages(self) -> dict[str, Path]:
        """The AOTInductor packages, by region key."""
        return {
            artifact.note: Path(artifact.path)
            for artifact in self.artifacts
            if artifact.kind == "aoti-package"
        }


def plan_fields(plan: CompilePlan, config: Any) -> dict:
    return {**asdict(plan), "config": hashlib.sha256(repr(config).encode()).hexdigest()[:16]}


def plan_key(plan: CompilePlan, config: Any) -> str:
    return hashlib.sha256(
        json.dumps(plan_fields(plan, config), sort_keys=True, default=str).encode()
    ).hexdigest()[:16]


def manifest_path(plan: CompilePlan, config: Any, environment: Environment) -> Path:
    return cache_root() / MANIFESTS / plan_key(plan, config) / f"{environment.key}.json"


def packages_folder(plan: CompilePlan, config: Any, environment: Environment) -> Path:
    """Where the build puts the plan's packages for `environment`: beside the manifest of the plan's
    batch-1 form, shared by the plans that differ only in their concurrency (a batched plan's regions
    are its batch-1 plan's and its engine's step: a package of one is a package of the other)."""
    return manifest_path(replace(plan, concurrency=1), config, environment).with_suffix("")


def describe(plan: CompilePlan) -> str:
    budget = f"{plan.max_new_tokens} tokens" if plan.max_new_tokens else "the model's positions"
    batched = f", concurrency {plan.concurrency}" if plan.concurrency > 1 else ""
    return f"{plan.source}, {plan.engine} engine, {plan.dtype}, modes {','.join(plan.modes)}, {budget}{batched}"


@dataclass(frozen=True)
class Lookup:
    """A plan's artifacts for this environment (`manifest`), or why there are none (`reason`)."""

    manifest: Manifest | None
    path: Path
    reason: str = ""
    refused: tuple[str, ...] = field(default=())  # manifests of this plan built elsewhere: their differences

    @property
    def summary(self) -> str:
        """One line for the log and the worker session's record."""
        if self.manifest is not None:
            return f"prebuilt artifacts ({self.manifest.built_by}, {self.manifest.built_at}): {self.path}"
        return f"no artifacts: {self.reason}; compiled at start"


def lookup(plan: CompilePlan, config: Any, environment: Environment | None = None) -> Lookup:
    """This plan's manifest for this environment (`Environment.here`, which initialises CUDA, unless
    given), or why none is used: none built, or built elsewhere (each such manifest's differences)."""
    here = environment or Environment.here(torch.device(plan.device))
    path = manifest_path(plan, config, here)
    if path.exists():
        manifest = Manifest.read(path)
        if manifest is not None and manifest.format == FORMAT and manifest.environment == here:
            return Lookup(manifest, path)
    refused = []
    for other in sorted(path.parent.glob("*.json")):
        manifest = Manifest.read(other)
        if manifest is None:
            continue
        why = manifest.environment.differences(here)
        if manifest.format != FORMAT:
            why.insert(0, f"manifest format {manifest.format}, this reads {FORMAT}")
        refused.append("; ".join(why) or "unreadable")
    if refused:
        return Lookup(None, path, f"artifacts refused ({refused[0]})", tuple(refused))
    return Lookup(None, path, f"none built for this plan ({describe(plan)})")


def listed_without_gpu(plan: CompilePlan, config: Any, environment: Environment | None = None) -> bool:
    """Whether a manifest of this plan matches this process (or `environment`) in all but the GPU, asked
    without initialising CUDA: the build then asks `lookup`, GPU included, before it loads anything."""
    here = environment or Environment.here(torch.device(plan.device), gpu="")
    folder = cache_root() / MANIFESTS / plan_key(plan, config)
    for path in folder.glob("*.json"):
        manifest = Manifest.read(path)
        if (
            manifest is not None
            and manifest.format == FORMAT
            and not manifest.environment.differences(here, gpu=False)
        ):
            return True
    return False


def manifest(
    plan: CompilePlan,
    config: Any,
    built: tuple[Artifact, ...],
    seconds: float,
    environment: Environment,
    built_by: str = "dsocr precompile",
) -> Manifest:
    """The manifest of `plan`'s artifacts `built` in `environment`, by the compiler here."""
    return Manifest(
        plan_fields(plan, config),
        environment,
        built,
        built_by,
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        round(seconds, 1),
        compiler_version(),
    )


def write(manifest: Manifest, path: Path) -> None:
    """Write `manifest` at `path` atomically: a reader sees the old one or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
    partial.replace(path)


@contextmanager
def host_lock(
    plan: CompilePlan, config: Any, waiting: Callable[[str], None] = log.info, shared_wait: bool = False
) -> Iterator[bool]:
    """One process of this host compiles `plan` at a time (an flock in the shared cache: the kernel frees
    a dead holder's). Yields whether this process holds it. `shared_wait`: a process that finds it held
    waits for the holder to finish, then goes on beside the other waiters without holding it (a worker's
    dynamo then finds the holder's graphs in inductor's cache); otherwise it waits its turn (a build)."""
    path = cache_root() / MANIFESTS / f"{plan_key(plan, config)}.build.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a")  # noqa: SIM115
    except OSError as exc:
        log.warning("no host lock for this plan (%s): %s; compiled unshared", path, exc)
        yield False
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting("another process of this host compiles this plan: waiting for it")
            fcntl.flock(lock, fcntl.LOCK_SH if shared_wait else fcntl.LOCK_EX)
            if shared_wait:
                yield False
                return
        yield True
