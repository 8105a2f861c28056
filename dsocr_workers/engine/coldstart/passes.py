"""A warm-up's pages and passes: the synthetic pages that reach every compiled shape of some modes, and one
pass of jobs over them (`warm_pass`), as the worker's warm-up runs it and the build step records it
(warmup.py, build.py): the packages built are exactly the regions the warm-up meets.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from PIL import Image

from dsocr_workers.engine.regions import PREFILL_BUCKET, padded_length
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession, force_eos_at, met_once
from dsocr_workers.model import preprocess
from dsocr_workers.model.families import ModelFamily

# A warm-up's jobs end at this decode step: decode only has to be compiled and captured, in the bucket
# jobs will use. Passes repeat until one meets no cold path but those running once resolves (a process's
# first job, a cache bucket's first use): CUDA graph trees run a new graph once before they capture it,
# at its second call (measured: the capture grows the allocator by ~1 GiB).
WARMUP_EOS_STEP = 2


def warmup_pages(
    family: ModelFamily, modes: Sequence[str], max_crops: int
) -> list[tuple[str, Image.Image]]:
    """Synthetic pages that reach every compiled vision shape of `family`'s `modes`: one page per fixed
    mode; for crop modes one page without tiles and one per tile count (a `n x 1` strip of tiles, each
    the mode's `image_size` square)."""
    pages = []
    for name in modes:
        mode = family.mode(name)
        if not mode.crop_mode:
            pages.append((name, Image.new("RGB", (mode.image_size, mode.image_size), "white")))
            continue
        side = mode.image_size
        pages.append((name, Image.new("RGB", (side, side), "white")))
        pages.extend((name, Image.new("RGB", (side * n, side), "white")) for n in range(2, max_crops + 1))
    return pages


def warm_options(infer: DecodeOptions | None) -> DecodeOptions:
    """A warm-up's decode options: the jobs' (`infer`) with the EOS watch on (a job that ignores EOS runs
    the same compiled step, without it), so that the forced EOS ends decode early."""
    return replace(infer or DecodeOptions(), ignore_eos=False)


# A warm-up job's parts (stages.py `StageTimings`), its prefill by stage: its page is prepared before.
PASS_PARTS = (
    "setup", "sam", "clip", "qwen2", "projector", "lm_prefill", "first_token", "decode", "wasted_decode",
    "readback", "host_gap",
)


@dataclass(frozen=True)
class WarmPass:
    """One pass of a warm-up: the shapes its jobs met, the cold paths they met ("shape: reason") that
    running once does not resolve (`met_once`), the prompt lengths whose prefill it readied, each job's
    time (host clock: a warm-up job ends reading its tokens back), the jobs' parts summed (`PASS_PARTS`:
    where a cold pass's time goes), and the time its LM prefill captures took after its jobs."""

    shapes: list[str]
    lasting: list[str]
    prompt_lengths: tuple[int, int]
    prefill_graphs_ms: float
    jobs_ms: dict[str, float]  # by shape
    parts_ms: dict[str, float]  # by part, over the pass's jobs


def shape_name(mode: str, page: preprocess.PreparedPage) -> str:
    """A warm-up page's shape as the passes' logs name it: "mode", or "mode:colsxrows" with tiles."""
    cols, rows = page.crop_grid
    return mode if (cols, rows) == (1, 1) else f"{mode}:{cols}x{rows}"


def warm_pass(
    session: DeepSeekOCRSession,
    prepared: Iterable[tuple[str, preprocess.PreparedPage]],
    max_new_tokens: int | None,
    options: DecodeOptions,
    max_crops: int,
) -> WarmPass:
    """Every prepared page's job once, then the prefill captures."""
    shapes: list[str] = []
    lasting: list[str] = []
    jobs_ms: dict[str, float] = {}
    parts_ms: dict[str, float] = {}
    shortest, longest = session.max_positions, 0
    end_early = force_eos_at(WARMUP_EOS_STEP)
    for name, page in prepared:
        shape = shape_name(name, page)
        shapes += [shape] if shape not in shapes else []
        began = time.perf_counter()
        result = session.run_on_device(
            page, max_new_tokens, options, return_text=False, after_step=end_early
        ).finish()
        jobs_ms[shape] = jobs_ms.get(shape, 0.0) + (time.perf_counter() - began) * 1e3
        figures = result.timings.columns()
        for part in PASS_PARTS:
            ms = figures.get(f"{part}_ms")
            if ms is not None:
                parts_ms[part] = parts_ms.get(part, 0.0) + ms
        lasting += [f"{shape}: {reason}" for reason in result.cold_reasons if not met_once(reason)]
        shortest = min(shortest, page.prompt_tokens)
        text = page.prompt_tokens - page.image_tokens
        longest = max(longest, text + session.code.most_image_tokens(session.family.mode(name), max_crops))
    session.synchronize()
    captures_began = time.perf_counter()
    capture_prefills(session, shortest, longest, max_new_tokens)
    session.synchronize()
    captures_ms = (time.perf_counter() - captures_began) * 1e3
    return WarmPass(shapes, lasting, (shortest, longest), captures_ms, jobs_ms, parts_ms)


def capture_prefills(
    session: DeepSeekOCRSession, shortest: int, longest: int, max_new_tokens: int | None
) -> None:
    """Capture the LM prefill graph of every padded prompt length from `shortest` to `longest`, in the
    cache bucket a prompt of that length will use. A grid's prompt length depends on its rows (a newline
    per row of tiles), not only on the tile count the warm-up's pages meet: every length between, not
    only theirs."""
    for padded in range(
        padded_length(shortest, session.max_positions), longest + PREFILL_BUCKET, PREFILL_BUCKET
    ):
        # The bucket's shortest and longest prompts: their cache buckets may differ.
        for length in {max(shortest, padded - PREFILL_BUCKET + 1), min(longest, padded)}:
            if not session.capture_prefill(length, max_new_tokens):
                return
