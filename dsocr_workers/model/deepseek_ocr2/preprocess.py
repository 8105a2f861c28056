"""DeepSeek-OCR-2's page preprocessing with the vendor's numerics (spec "Preprocessing").

v1's pieces carry over unchanged (Pillow resampling, the grid choice with its tie rule, the "plain"
prompt, uint8 pixels normalised on the device); what differs is the geometry: 768-px crops made only
when a side exceeds 768, at most 6, a 1024 global view always padded, and one query output per image
token (no newline vectors): 256 + 1 + 144 per crop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from PIL import Image

from dsocr_workers.errors import InputError
from dsocr_workers.model.config import ModeSpec, pick_mode
from dsocr_workers.model.deepseek_ocr2.config import DEFAULT_MODE, MAX_CROPS, MIN_CROPS, MODES
from dsocr_workers.model.images import MAX_PIXELS, load_image
from dsocr_workers.model.preprocess import (
    PreparedPage,
    assemble_page,
    build_prompt,
    crop_candidates,
    select_crop_grid,
)

CROP_SIZE = 768  # `dynamic_preprocess(image_size=768)` and the crop threshold, whatever the mode says
PATCH_SIZE = 16
DOWNSAMPLE = 4  # SAM's 16-px patches, then the two stride-2 convs: one token per 64 px


def get_mode(mode: str | ModeSpec) -> ModeSpec:
    if isinstance(mode, ModeSpec) and MODES.get(mode.name) != mode:
        raise InputError(f"mode {mode.name!r} is not a DeepSeek-OCR-2 mode; valid modes: {', '.join(MODES)}")
    return pick_mode(MODES, mode, "DeepSeek-OCR-2")


def _queries(side: int) -> int:
    return math.ceil((side // PATCH_SIZE) / DOWNSAMPLE)


def count_image_tokens(mode: str | ModeSpec, crop_grid: tuple[int, int]) -> int:
    """Placeholders of a page: the global view's queries, the separator, then 144 per crop (crop mode
    with a grid of 2 or more crops). Without crop mode: the one view's queries and the separator."""
    spec = get_mode(mode)
    if not spec.crop_mode:
        return _queries(spec.image_size) ** 2 + 1
    cols, rows = crop_grid
    n = _queries(spec.base_size) ** 2 + 1
    if cols > 1 or rows > 1:
        n += (_queries(spec.image_size) * cols) * (_queries(spec.image_size) * rows)
    return n


def most_image_tokens(mode: str | ModeSpec, max_crops: int = MAX_CROPS) -> int:
    """The most placeholders a page can take in `mode` (the grid with the most crops)."""
    spec = get_mode(mode)
    grids = crop_candidates(MIN_CROPS, max_crops) if spec.crop_mode and max_crops >= MIN_CROPS else []
    return max(count_image_tokens(spec, grid) for grid in [(1, 1), *grids])


def prepare_page(
    image: str | os.PathLike | bytes | Image.Image,
    encode: Callable[[str], list[int]],
    *,
    mode: str | ModeSpec = DEFAULT_MODE,
    prompt: str | None = None,
    max_crops: int = MAX_CROPS,
    max_pixels: int = MAX_PIXELS,
) -> PreparedPage:
    """One page → model inputs (uint8 pixels; the engine normalises on its device). `encode` is the
    tokenizer's encode without added special tokens. Crops: `crop_grid` (cols, rows), `tile_pixels`
    [cols·rows, 3, 768, 768]; none when both sides are at most 768."""
    spec = get_mode(mode)
    text = build_prompt(prompt)
    original = load_image(image, max_pixels=max_pixels)  # EXIF transpose, then RGB

    grid = (1, 1)
    if spec.crop_mode:
        grid = select_crop_grid(
            original.width, original.height, min_crops=MIN_CROPS, max_crops=max_crops, tile=CROP_SIZE
        )
    return assemble_page(original, spec, grid, CROP_SIZE, text, encode, count_image_tokens(spec, grid))
