"""Image and prompt preprocessing with the vendor's numerics (spec §3–5).

Every resampling step goes through Pillow, as the vendor's does, so the pixels fed to the model are
bit-identical; only the uint8 → float normalisation is ours (vectorised in torch, same float32 ops).
Untrusted files are opened by model/images.py (a format allowlist and a pixel limit; anything wrong is an
`InputError` with a reason a person can act on).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch
from PIL import Image, ImageOps

from dsocr_workers.errors import InputError
from dsocr_workers.model.config import (
    BOS_TOKEN_ID,
    DEFAULT_MODE,
    IMAGE_TOKEN_ID,
    MAX_CROPS,
    ModeSpec,
    get_mode,
)
from dsocr_workers.model.images import MAX_PIXELS, load_image

DEFAULT_PROMPT = "<image>\n<|grounding|>Convert the document to markdown."
# The vendor's prompt list (README / vLLM config); "locate" needs an argument and is left to callers.
PROMPTS: dict[str, str] = {
    "document": DEFAULT_PROMPT,
    "ocr": "<image>\n<|grounding|>OCR this image.",
    "free": "<image>\nFree OCR.",
    "figure": "<image>\nParse the figure.",
    "describe": "<image>\nDescribe this image in detail.",
}
IMAGE_PLACEHOLDER = "<image>"

TILE_SIZE = 640  # hard-wired in the vendor's tiling, whatever the mode's image_size
PAD_COLOR = (127, 127, 127)  # int(0.5 * 255) per channel: the normalisation mean
PATCH_SIZE = 16
DOWNSAMPLE = 4  # SAM's 16-px patches, then the 4x (two stride-2 convs) compressor

@dataclass(frozen=True)
class PreparedPage:
    """Everything the model needs for one page, on CPU. Pixels stay uint8 (a quarter of the bytes to
    move to the GPU); the engine normalises them on its device with `normalize_pixels`."""

    input_ids: torch.Tensor  # int64 [L]: BOS, text before <image>, N placeholders, text after
    images_seq_mask: torch.Tensor  # bool [L], True exactly at the N placeholders
    global_pixels: torch.Tensor  # uint8 [1, 3, S, S]
    tile_pixels: torch.Tensor | None  # uint8 [cols*rows, 3, 640, 640] row-major; None without tiles
    crop_grid: tuple[int, int]  # (cols, rows); (1, 1) without tiles
    image_tokens: int  # N
    prompt_tokens: int  # L
    original: Image.Image  # EXIF-corrected RGB original, the frame of the output boxes
    mode: ModeSpec
    # False when the normalised global view sums to exactly 0: the vendor then skips image injection
    # (spec §6.1), so an exactly balanced page silently reads as "no image". Kept for parity.
    injects_image: bool = True

    def pinned(self) -> PreparedPage:
        """This page with its tensors in page-locked memory (CUDA): a copy from pageable memory makes the
        host wait for the work queued on the stream before it, a copy from pinned memory does not."""
        pin = torch.Tensor.pin_memory
        tiles = None if self.tile_pixels is None else pin(self.tile_pixels)
        return replace(
            self, input_ids=pin(self.input_ids), global_pixels=pin(self.global_pixels), tile_pixels=tiles
        )

    @property
    def global_view(self) -> torch.Tensor:
        """float32 [1, 3, S, S] in [-1, 1]: the vendor's normalised global view."""
        return normalize_pixels(self.global_pixels)

    @property
    def tiles(self) -> torch.Tensor | None:
        """float32 [cols*rows, 3, 640, 640] normalised tiles, or None."""
        return None if self.tile_pixels is None else normalize_pixels(self.tile_pixels)


# ---------------------------------------------------------------------------------------------------
# Tiling and token schedule


def crop_candidates(min_crops: int = 2, max_crops: int = MAX_CROPS) -> list[tuple[int, int]]:
    """(cols, rows) grids with min_crops <= cols*rows <= max_crops in the vendor's order.

    The vendor sorts a *set* by tile count, so among grids with the same count the order is CPython's
    set iteration order; building the same set in the same insertion order reproduces it, and it
    decides which grid wins an exact tie between two grids of equal count."""
    grids = {
        (i, j)
        for n in range(min_crops, max_crops + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_crops <= i * j <= max_crops
    }
    return sorted(grids, key=lambda g: g[0] * g[1])


def select_crop_grid(
    width: int, height: int, *, min_crops: int = 2, max_crops: int = MAX_CROPS, tile: int = TILE_SIZE
) -> tuple[int, int]:
    """The (cols, rows) tile grid of crop mode (spec §3.5); (1, 1) when the image fits one tile."""
    if width <= 0 or height <= 0:
        raise InputError(f"image has no pixels ({width}x{height})")
    if min_crops < 1 or max_crops < min_crops:
        raise InputError(f"invalid crop range: min_crops={min_crops}, max_crops={max_crops}")
    if width <= tile and height <= tile:
        return (1, 1)
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in crop_candidates(min_crops, max_crops):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            # An exact tie goes to the later (more tiles) grid only if the image has the pixels for it.
            best = (cols, rows)
    return best


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


# ---------------------------------------------------------------------------------------------------
# Prompt


def build_prompt(prompt: str | None) -> str:
    """The prompt string after the vendor's "plain" template: the user text, stripped (spec §5).

    None gives DEFAULT_PROMPT; a key of PROMPTS ("document", "ocr", …) gives that vendor prompt."""
    if prompt is None:
        prompt = DEFAULT_PROMPT
    elif prompt in PROMPTS:
        prompt = PROMPTS[prompt]
    text = prompt.strip()
    count = text.count(IMAGE_PLACEHOLDER)
    if count != 1:
        raise InputError(
            f"the prompt must contain exactly one {IMAGE_PLACEHOLDER!r} (found {count}); "
            f"named prompts: {', '.join(PROMPTS)}"
        )
    return text


def _text_ids(text: str, encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """The prompt's ids before and after its image placeholder."""
    before, after = text.split(IMAGE_PLACEHOLDER)
    return (list(encode(before)) if before else []), (list(encode(after)) if after else [])


def longest_prompt(
    encode: Callable[[str], list[int]], mode: str | ModeSpec, prompt: str | None, max_crops: int = MAX_CROPS
) -> int:
    """The most prompt tokens a page can make in `mode` with `prompt`: BOS, the text, and the image
    placeholders of its largest grid (`most_image_tokens`)."""
    ids_before, ids_after = _text_ids(build_prompt(prompt), encode)
    return 1 + len(ids_before) + most_image_tokens(get_mode(mode), max_crops) + len(ids_after)


# ---------------------------------------------------------------------------------------------------
# Pixels


def normalize_pixels(pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The vendor's ToTensor + Normalize(0.5, 0.5), same float32 ops on any device: true division by
    255 (multiplying by 1/255 differs in 126 of the 256 values after the bf16 cast), then
    (x - 0.5) / 0.5, then the cast. IEEE float32 division is correctly rounded on CPU and CUDA alike,
    so normalising on the GPU gives the CPU's bits."""
    return pixels.to(torch.float32).div_(255).sub_(0.5).div_(0.5).to(dtype)


_NORMALIZED_BYTES = normalize_pixels(torch.arange(256, dtype=torch.uint8)).double()


def _sums_to_zero(pixels: torch.Tensor) -> bool:
    """Whether the normalised pixels sum to exactly 0, from the byte histogram (no float copy)."""
    counts = torch.bincount(pixels.flatten(), minlength=256).double()
    return bool((counts * _NORMALIZED_BYTES).sum() == 0)


def _chw(uint8: np.ndarray) -> torch.Tensor:
    # The channel-first copy is made on uint8 by numpy (several times faster than a strided torch copy).
    return torch.from_numpy(np.require(uint8, requirements=["C_CONTIGUOUS", "WRITEABLE"]))


def _global_view(image: Image.Image, mode: ModeSpec) -> Image.Image:
    size = mode.global_size
    if not mode.crop_mode and size <= TILE_SIZE:
        # tiny/small: a direct, aspect-distorting resize (the vendor's pad after it is a no-op)
        return image.resize((size, size), Image.Resampling.BICUBIC)
    # Pillow's own pad: its paste offset is round-half-even (3000x500 → y 426), part of parity.
    return ImageOps.pad(image, (size, size), Image.Resampling.BICUBIC, color=PAD_COLOR)


def _tiles(image: Image.Image, grid: tuple[int, int]) -> torch.Tensor:
    cols, rows = grid
    stretched = image.resize((TILE_SIZE * cols, TILE_SIZE * rows), Image.Resampling.BICUBIC)
    hwc = np.asarray(stretched)  # [rows*640, cols*640, 3] uint8
    # Cut row-major (tile k at column k % cols, row k // cols) while still uint8.
    tiles = hwc.reshape(rows, TILE_SIZE, cols, TILE_SIZE, 3).transpose(0, 2, 4, 1, 3)
    return _chw(tiles.reshape(rows * cols, 3, TILE_SIZE, TILE_SIZE))


def _to_tensor(image: Image.Image) -> torch.Tensor:
    return _chw(np.asarray(image).transpose(2, 0, 1)).unsqueeze(0)


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

    grid = (1, 1)
    if spec.crop_mode:
        grid = select_crop_grid(original.width, original.height, max_crops=max_crops)
    if grid == (1, 1):
        global_view, tiles = _to_tensor(_global_view(original, spec)), None
    else:
        # The tiles' resize on a thread of its own while this one makes the global view (PIL resizes
        # without the GIL); a thread per call, no pool: nothing outlives the call into a later fork.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-tiles") as side:
            tiles_made = side.submit(_tiles, original, grid)
            global_view = _to_tensor(_global_view(original, spec))
            tiles = tiles_made.result()

    n_image = count_image_tokens(spec, grid)
    ids_before, ids_after = _text_ids(text, encode)
    ids = [BOS_TOKEN_ID, *ids_before, *([IMAGE_TOKEN_ID] * n_image), *ids_after]
    input_ids = torch.tensor(ids, dtype=torch.int64)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    start = 1 + len(ids_before)
    mask[start : start + n_image] = True

    return PreparedPage(
        input_ids=input_ids,
        images_seq_mask=mask,
        global_pixels=global_view,
        tile_pixels=tiles,
        crop_grid=grid,
        image_tokens=n_image,
        prompt_tokens=len(ids),
        original=original,
        mode=spec,
        injects_image=not _sums_to_zero(global_view),
    )
