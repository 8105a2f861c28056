"""A compile helper of the warm-up (coldstart/helpers.py):

    python -m dsocr_workers.engine.coldstart.helper_process '<HelperTask as JSON>' WORKER_PID

compiles its share of a warm-up's graphs into inductor's on-disk cache, as the worker's jobs will run
them, and prints its report (`HelperResult`) as the last line of standard output. A vision share: the SAM
and CLIP graphs of its view sizes. The language share: the LM prefill's layers and the decode step, over
the warm-up's prompts. A forked helper (`CompileHelpers.start(..., fork=True)`) calls `run` directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import torch

from dsocr_workers import settings
from dsocr_workers.engine.coldstart.artifacts import lookup
from dsocr_workers.engine.coldstart.cache import use_compile_cache
from dsocr_workers.engine.coldstart.passes import warm_language, warmup_pages
from dsocr_workers.engine.coldstart.plan import (
    CompilePlan,
    CompileShare,
    HelperResult,
    HelperTask,
    ShareLock,
    VisionShapes,
    exit_with_the_worker,
)
from dsocr_workers.engine.device import make_current, resolve_device, resolve_dtype, set_numerics
from dsocr_workers.engine.regions import RegionalVision, TorchCompiler, configure_dynamo
from dsocr_workers.engine.result import ModelSource
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.variants.fast import FastCompile, FastEngine, fast_vision_modules
from dsocr_workers.model import preprocess
from dsocr_workers.model.checkpoint import build_vision_only, build_zeroed, model_config
from dsocr_workers.model.families import FAMILIES

# The language shares take longest, with every helper compiling at once: vision runs at a lower priority.
VISION_NICENESS = 5


def _pixel_groups(
    shapes: VisionShapes, max_crops: int, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
    """From each of the warm-up's pages that has the view group of `shapes`: the page's global view
    when the group is its tiles (else None), and the group, on the device and normalised as
    `DeepSeekOCRSession.upload` leaves them. The prompt's tokens play no part: none are made."""
    family = FAMILIES[shapes.family]
    for mode, image in warmup_pages(family, [shapes.mode], max_crops):
        page = family.code().prepare_page(image, lambda _text: [], mode=mode, max_crops=max_crops)
        group = page.tile_pixels if shapes.tiles else page.global_pixels
        if group is not None and (shapes.tiles or page.tile_pixels is None):
            whole = (
                preprocess.normalize_pixels(page.global_pixels.to(device), dtype) if shapes.tiles else None
            )
            yield whole, preprocess.normalize_pixels(group.to(device), dtype)


def compile_vision(plan: CompilePlan, share: CompileShare, device: torch.device, dtype: torch.dtype) -> None:
    model = build_vision_only(
        model_config(plan.source), device=device, dtype=dtype, attn_implementation=plan.attn_implementation
    )
    fast_vision_modules(model)
    regions = RegionalVision(model, TorchCompiler(plan.backend), plan.dynamic_tiles)
    with torch.inference_mode():  # as jobs run: a compiled block guards on it
        for shapes in share.shapes:
            for whole, pixels in _pixel_groups(shapes, plan.max_crops, device, dtype):
                features = regions.encode_sam([pixels])
                if whole is None:
                    regions.encode_views(features)
                else:
                    # CLIP over the global view and the tiles together, as a tiled page runs it. The
                    # global view's SAM features come from the eager encoder: its graphs are another
                    # share's, and the features' shape and layout are all CLIP's graph depends on.
                    regions.encode_views([model.encode_sam(whole), *features])


def compile_language(
    plan: CompilePlan, share: CompileShare, device: torch.device, dtype: torch.dtype
) -> None:
    """The LM prefill's graphs (share "prefill"), or the decode step's (share "decode": the session
    compiles nothing else, its prefill runs eager)."""
    with torch.inference_mode():
        loaded = build_zeroed(
            plan.source,
            device=device,
            dtype=dtype,
            attn_implementation=plan.attn_implementation,
            experts_implementation=plan.experts_implementation,
        )
    decode = share.kind == "decode"
    engine = FastEngine(FastCompile(decode_only=decode, dynamic_tiles=plan.dynamic_tiles))
    with torch.inference_mode():
        engine.after_load(loaded.model)
    session = DeepSeekOCRSession(
        loaded, ModelSource("preset", "zeros", random_weights=True), device, dtype, engine
    )
    warm_language(session, plan.modes, plan.max_new_tokens, plan.max_crops, plan.options, decode=decode)


def compile_share(task: HelperTask) -> HelperResult:
    """The share's graphs, unless the plan's manifest (artifacts.py) says they are built for this
    environment already or another process's helper compiled this share (ShareLock)."""
    began = time.perf_counter()
    plan, share = task.plan, task.share
    # The worker's cache: a helper forked before the worker's session pointed torch at it has no
    # TORCHINDUCTOR_CACHE_DIR yet, and would fill torch's default cache, which the worker never reads.
    use_compile_cache()
    threads = settings.read(settings.TORCH_COMPILE_THREADS)
    if threads is not None:  # a forked helper imported inductor's settings with the worker's count
        torch._inductor.config.compile_threads = threads
    device = resolve_device(plan.device)
    make_current(device)
    dtype = resolve_dtype(plan.dtype, device)
    set_numerics(device, dtype)
    configure_dynamo()
    stats, inductor = torch._dynamo.utils.counters["stats"], torch._dynamo.utils.counters["inductor"]
    # dynamo's counters are the process's: this share's are what they gained since (a forked helper starts
    # at 0; a caller that compiled before, as a test process, does not).
    graphs_before, hits_before = stats["unique_graphs"], inductor["fxgraph_cache_hit"]

    def result(outcome: str) -> HelperResult:
        peak = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        return HelperResult(
            share.label,
            outcome,
            stats["unique_graphs"] - graphs_before,
            inductor["fxgraph_cache_hit"] - hits_before,
            time.perf_counter() - began,
            peak,
        )

    found = lookup(plan, model_config(plan.source))
    if found.manifest is not None:
        return result("warm")
    lock_path, done = ShareLock.paths(found.path, share)
    lock = ShareLock.hold(lock_path)  # None after the timeout: a stuck holder; compile regardless
    try:
        if done.exists():
            return result("shared")
        if share.kind == "vision":
            os.nice(VISION_NICENESS)  # the language shares take longest: the host's cores go to them first
            compile_vision(plan, share, device, dtype)
        else:
            compile_language(plan, share, device, dtype)
        with contextlib.suppress(OSError):  # an unwritable cache: another process compiles it again, no worse
            done.touch()
        return result("compiled")
    finally:
        if lock is not None:
            lock.release()


def run(task: HelperTask, worker: int) -> int:
    """A helper's whole life, spawned (`main`) or forked (helpers.py) by process `worker`: its report on
    standard output."""
    exit_with_the_worker(worker)
    print(json.dumps(asdict(compile_share(task))), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[2].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    return run(HelperTask.from_json(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
