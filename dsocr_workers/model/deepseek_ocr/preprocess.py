"""DeepSeek-OCR (v1)'s page preprocessing with the vendor's numerics (spec §3–5): its modes, 640-px
tiles, token schedule and prompt ids. What both families share (the page, normalisation, the prompt,
the tiling rule) is model/preprocess.py. Untrusted files are opened by model/images.py (a format
allowlist and a pixel limit; anything wrong is an `InputError` with a reason a person can act on).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from PIL import Image

from dsocr_workers.model.config import ModeSpec
from dsocr_workers.model.deepseek_ocr.config import DEFAULT_MODE, MAX_CROPS, get_mode
from dsocr_workers.model.images import MAX_PIXELS, load_image
from dsocr_workers.model.preprocess import (
    PreparedPage,
    assemble_page,
    build_prompt,
    crop_candidates,
    select_crop_grid,
)

TILE_SIZE = 640  # hard-wired in the vendor's tiling, whatever the mode's image_size
PATCH_SIZE = 16
DOWNSAMPLE = 4  # SAM's 16-px patches, then the 4x (two stride-2 convs) compressor


def crop_grid(width: int, height: int, max_crops: int = MAX_CROPS) -> tuple[int, int]:
    """The (cols, rows) tile grid of a page in crop mode; (1, 1) when it fits one 640-px tile."""
    return select_crop_grid(width, height, tile=TILE_SIZE, max_crops=max_crops)


def _queries(side: int) -> int:
    return math.ceil((side // PATCH_SIZE) / DOWNSAMPLE)


def count_image_tokens(mode: ModeSpec, crop_grid: tuple[int, int]) -> int:
    """Placeholder count N (spec §4.1): rows of the global grid, each + image_newline, + view_seperator,
    plus, with tiles, the local grid's rows (each + image_newline)."""
    q = _queries(mode.global_size)
    n = q * (q + 1) + 1
    cols, rows = crop_grid
    if cols > 1 or rows > 1:
        qt = _queries(mode.image_size)
        n += (rows * qt) * (cols * qt + 1)
    return n


def most_image_tokens(mode: ModeSpec, max_crops: int = MAX_CROPS) -> int:
    """The most placeholders a page can take in `mode`: with tiles, the grid whose rows bring the most
    newlines (1×9 takes 80 more than 9×1, for the same tiles)."""
    grids = crop_candidates(2, max_crops) if mode.crop_mode else []
    return max(count_image_tokens(mode, grid) for grid in [(1, 1), *grids])


def prepare_page(
    image: str | os.PathLike | bytes | Image.Image,
    encode: Callable[[str], list[int]],
    *,
    mode: str | ModeSpec = DEFAULT_MODE,
    prompt: str | None = None,
    max_crops: int = MAX_CROPS,
    max_pixels: int = MAX_PIXELS,
) -> PreparedPage:
    """One page → model inputs. `encode` is the tokenizer's encode without added special tokens.

    max_crops: 9 in the HF vendor path, 6 in the vendor vLLM path (crop mode only)."""
    spec = get_mode(mode)
    text = build_prompt(prompt)
    original = load_image(image, max_pixels=max_pixels)

    grid = crop_grid(original.width, original.height, max_crops) if spec.crop_mode else (1, 1)
    return assemble_page(original, spec, grid, TILE_SIZE, text, encode, count_image_tokens(spec, grid))
