"""What a warm-up compiles, as data: the plan (`CompilePlan`: the session's settings, the modes, the jobs'
budget and decode options, the concurrency a batched worker serves), which keys the artifacts built for
it (artifacts.py), and where torch keeps them (`cache_root`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dsocr_workers import settings
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants.base import InductorGraphs
from dsocr_workers.model.config import dtype_name
from dsocr_workers.model.families import FAMILIES


@dataclass(frozen=True)
class CompilePlan:
    """One warm-up (coldstart/warmup.py `warm`) as its graphs depend on it: the session's settings, the
    modes, the jobs' token budget and decode options (the decode step is compiled per cache bucket and
    per n-gram ban), and `concurrency`: above 1, the batched engine's step for that many slots (a
    package per bucket kind) and its admission path are part of the plan too."""

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
    concurrency: int = 1
    family: str = next(iter(FAMILIES))  # the model family whose modes `modes` are


def cache_root() -> Path:
    """inductor's cache directory, as this process uses it."""
    explicit = settings.read(settings.TORCH_CACHE_DIR)
    if explicit is not None:
        return explicit
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


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
    concurrency: int = 1,
    family: str,
) -> CompilePlan | None:
    """What a warm-up's graphs depend on, or None when inductor compiles none. `kernels`: the model's
    attention and expert implementations (`Engine.kernels()`); `graphs`: what its engine compiles
    (`Engine.compiled()`); `concurrency`: the batched engine's slots a worker serves (1: batch-1 only);
    `family`: the model family's name, never assumed (its modes and view encoder shape the graphs)."""
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
        concurrency=concurrency,
        family=family,
    )
