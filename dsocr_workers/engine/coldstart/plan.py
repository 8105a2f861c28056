"""What a warm-up compiles, as data shared by the worker and its compile helpers: the plan (`CompilePlan`:
the session's settings, the modes, the jobs' budget and decode options), its shares (`CompileShare`: a
helper's part), and the lock by which one helper per host compiles a share (`ShareLock`); the manifest
a completed warm-up leaves in the compile cache is artifacts.py's. helpers.py starts the processes,
helper_process.py is one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Literal

import torch

from dsocr_workers import settings
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants.base import InductorGraphs
from dsocr_workers.model.config import ModeSpec, dtype_name
from dsocr_workers.model.families import FAMILIES, ModelFamily

log = logging.getLogger(__name__)

PROCESSES_ENV = settings.COMPILE_PROCESSES.name
# Far past a helper's usual compile time (docs/benchmarks.md, cold start): it is stuck, and the worker
# compiles without it.
HELPER_TIMEOUT_S = 300.0
_PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass(frozen=True)
class VisionShapes:
    """The vision graphs of one view size: the global view of `mode` (SAM's two kinds of block at batch
    1, then CLIP), or the tiles of a crop mode (SAM's two kinds of block with the tile batch dynamic, run
    at every tile count, then CLIP over the global view and the tiles together, as a page runs it)."""

    mode: str  # a mode whose warm-up pages hold these views
    tiles: bool
    family: str = "deepseek-ocr"  # the model family whose mode it is (model/families.py)

    @property
    def spec(self) -> ModeSpec:
        return FAMILIES[self.family].mode(self.mode)

    @property
    def size(self) -> int:
        # A crop mode's tiles are its `image_size` square.
        return self.spec.image_size if self.tiles else self.spec.global_size

    @property
    def label(self) -> str:
        return f"tiles {self.size} px" if self.tiles else f"global {self.size} px"

    @property
    def cost(self) -> float:
        """Compile time, relative: a global view's grows with its size, the tiles' (SAM and CLIP over a
        dynamic tile batch) cost about as much as the largest global view's."""
        return 3.0 if self.tiles else 1.0 + self.size / 640


def vision_shapes(family: ModelFamily, modes: Sequence[str]) -> list[VisionShapes]:
    """Every view size `modes` of `family` run through the vision encoders, once (gundam's global view
    is base's)."""
    found: dict[tuple[bool, int], VisionShapes] = {}
    for name in modes:
        mode = family.mode(name)
        found.setdefault((False, mode.global_size), VisionShapes(name, tiles=False, family=family.name))
        if mode.crop_mode:
            found.setdefault((True, mode.image_size), VisionShapes(name, tiles=True, family=family.name))
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
    """One warm-up (coldstart/warmup.py `warm`) as its graphs depend on it: the session's settings, the
    modes, and the jobs' token budget and decode options (the decode step is compiled per cache bucket
    and per n-gram ban). Helpers compile for it; its manifest (artifacts.py) says its graphs are in the
    cache."""

    source: str  # preset name or checkpoint directory: its architecture only
    engine: str  # the engine's registry name
    device: str
    dtype: str  # "bfloat16", ...
    attn_implementation: str
    experts_implementation: str
    backend: str
    dynamic_tiles: bool
    max_crops: int
    modes: tuple[str, ...]
    max_new_tokens: int | None
    options: DecodeOptions = DecodeOptions()
    family: str = next(iter(FAMILIES))  # the model family whose modes `modes` are

    def shares(self, processes: int) -> list[CompileShare]:
        """The language model's two shares (the decode step, the longest to compile; the LM prefill),
        then the vision view sizes in `processes` shares."""
        vision = [
            CompileShare("vision", tuple(group)) for group in share(vision_shapes(FAMILIES[self.family], self.modes), processes)
        ]
        return [CompileShare("decode"), CompileShare("prefill"), *vision]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict) -> CompilePlan:
        options = fields["options"]
        return cls(
            **{
                **fields,
                "modes": tuple(fields["modes"]),
                "options": DecodeOptions(**{**options, "ngram_whitelist": tuple(options["ngram_whitelist"])}),
            }
        )


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
    # "compiled"; "warm" (the plan's manifest was there); "shared" (another process's helper compiled
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
    explicit = settings.read(settings.TORCH_CACHE_DIR)
    if explicit is not None:
        return explicit
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def exit_with_the_worker(worker: int) -> None:
    """A helper outlives no worker: the kernel kills it when the process that started it (`worker`, its
    pid) dies (Linux's parent-death signal), and one whose worker died while it started exits now.
    Otherwise a worker child killed during its warm-up (a hard time limit, an OOM kill) left its helpers
    compiling on its GPU."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != worker:
        os._exit(1)


class ShareLock:
    """One helper compiles a share on a host at a time: an flock on `<manifest>.<share>.lock` in the shared
    cache, and a `.done` file beside it once the share is compiled. The kernel releases the lock of a
    process that dies (and that process left no done file: the next one compiles)."""

    def __init__(self, file: IO[bytes] | None) -> None:
        self._file = file  # None: no lock could be made (an unwritable cache); nothing is shared

    @staticmethod
    def paths(manifest: Path, share: CompileShare) -> tuple[Path, Path]:
        key = hashlib.sha256(share.label.encode()).hexdigest()[:12]
        return manifest.with_name(f"{manifest.name}.{key}.lock"), manifest.with_name(
            f"{manifest.name}.{key}.done"
        )

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




def compile_plan(
    source: str,
    device: torch.device,
    dtype: torch.dtype,
    kernels: dict[str, str],
    graphs: InductorGraphs | None,
    modes: Sequence[str],
    max_new_tokens: int | None,
    infer: DecodeOptions | None,
    max_crops: int,
    *,
    engine: str,
    family: str = next(iter(FAMILIES)),
) -> CompilePlan | None:
    """What a warm-up's graphs depend on, or None when inductor compiles none. `kernels`: the model's
    attention and expert implementations (`Engine.kernels()`); `graphs`: what its engine compiles
    (`Engine.compiled()`)."""
    if graphs is None or not modes:
        return None
    return CompilePlan(
        source=source,
        engine=engine,
        device=str(device),
        dtype=dtype_name(dtype),
        **kernels,
        backend=graphs.backend,
        dynamic_tiles=graphs.dynamic_tiles,
        max_crops=max_crops,
        modes=tuple(modes),
        max_new_tokens=max_new_tokens,
        options=infer or DecodeOptions(),
        family=family,
    )
