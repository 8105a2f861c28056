"""A vision compile helper of the warm-up (engine/precompile.py):

    python -m dsocr_workers.engine.vision_helper '<HelperTask as JSON>'

compiles the SAM and CLIP graphs of its view sizes into inductor's on-disk cache, as the worker's jobs
will run them, and prints its report (`HelperResult`) as the last line of standard output.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import torch

from dsocr_workers.engine.precompile import HelperResult, HelperTask, VisionShapes, exit_with_the_worker
from dsocr_workers.engine.regions import RegionalVision, configure_dynamo
from dsocr_workers.engine.session import (
    fast_vision_modules,
    make_current,
    resolve_device,
    resolve_dtype,
    set_numerics,
    warmup_pages,
)
from dsocr_workers.model import preprocess
from dsocr_workers.model.checkpoint import build_vision_only, model_config


def _pixel_groups(
    shapes: VisionShapes, max_crops: int, device: torch.device, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The view group of `shapes` from each of the warm-up's pages that has one, on the device and
    normalised as `DeepSeekOCRSession.upload` leaves it. The prompt's tokens play no part: none are made."""
    for mode, image in warmup_pages([shapes.mode], max_crops):
        page = preprocess.prepare_page(image, lambda _text: [], mode=mode, max_crops=max_crops)
        group = page.tile_pixels if shapes.tiles else page.global_pixels
        if group is not None and (shapes.tiles or page.tile_pixels is None):
            yield preprocess.normalize_pixels(group.to(device), dtype)


def compile_vision(task: HelperTask) -> HelperResult:
    began = time.perf_counter()
    device = resolve_device(task.device)
    make_current(device)
    dtype = resolve_dtype(task.dtype, device)
    set_numerics(device, dtype)
    configure_dynamo()
    model = build_vision_only(model_config(task.source), device=device, dtype=dtype,
                              attn_implementation=task.attn_implementation)  # fmt: skip
    fast_vision_modules(model)
    regions = RegionalVision(model, task.backend, task.dynamic_tiles)
    stats, inductor = torch._dynamo.utils.counters["stats"], torch._dynamo.utils.counters["inductor"]
    with torch.inference_mode():  # as jobs run: a compiled block guards on it
        for shapes in task.shapes:
            for pixels in _pixel_groups(shapes, task.max_crops, device, dtype):
                features = regions.encode_sam([pixels])
                if not shapes.tiles:
                    regions.encode_clip(features)
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    return HelperResult([shape.label for shape in task.shapes], stats["unique_graphs"],
                        inductor["fxgraph_cache_hit"], time.perf_counter() - began, peak)  # fmt: skip


def main(argv: list[str]) -> int:
    exit_with_the_worker()
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(asdict(compile_vision(HelperTask.from_json(argv[1])))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
