"""What every family's preprocessing shares (spec §3–5): the prepared page, the vendor's pixel
normalisation, the prompt and its ids, and the tiling rule both vendors' remote code use (only the tile
size and the crop limits differ).

Every resampling step goes through Pillow, as the vendors' does, so the pixels fed to the model are
bit-identical; only the uint8 → float normalisation is ours (vectorised in torch, same float32 ops).
A family's own schedule (modes, tile size, token counts) is its package's `preprocess.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch
from PIL import Image, ImageOps

from dsocr_workers.errors import InputError
from dsocr_workers.model.config import BOS_TOKEN_ID, IMAGE_TOKEN_ID, ModeSpec

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
PAD_COLOR = (127, 127, 127)  # int(0.5 * 255) per channel: the normalisation mean


@dataclass(frozen=True)
class PreparedPage:
    """Everything the model needs for one page, on CPU. Pixels stay uint8 (a quarter of the bytes to
    move to the GPU); the engine normalises them on its device with `normalize_pixels`."""

    input_ids: torch.Tensor  # int64 [L]: BOS, text before <image>, N placeholders, text after
    images_seq_mask: torch.Tensor  # bool [L], True exactly at the N placeholders
    image_positions: torch.Tensor  # int64 [N]: where the mask is True, the image embeddings' places
    global_pixels: torch.Tensor  # uint8 [1, 3, S, S]
    tile_pixels: torch.Tensor | None  # uint8 [cols*rows, 3, T, T] row-major; None without tiles
    crop_grid: tuple[int, int]  # (cols, rows); (1, 1) without tiles
    image_tokens: int  # N
    prompt_tokens: int  # L
    # (width, height) of the EXIF-corrected original, the frame of the output boxes: its size, not its
    # pixels, so that a page crosses to another process as its tensors alone.
    image_size: tuple[int, int]
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
            self,
            input_ids=pin(self.input_ids),
            image_positions=pin(self.image_positions),
            global_pixels=pin(self.global_pixels),
            tile_pixels=tiles,
        )

    @property
    def global_view(self) -> torch.Tensor:
        """float32 [1, 3, S, S] in [-1, 1]: the vendor's normalised global view."""
        return normalize_pixels(self.global_pixels)

    @property
    def tiles(self) -> torch.Tensor | None:
        """float32 [cols*rows, 3, T, T] normalised tiles, or None."""
        return None if self.tile_pixels is None else normalize_pixels(self.tile_pixels)


# ---------------------------------------------------------------------------------------------------
# Tiling


def crop_candidates(min_crops: int, max_crops: int) -> list[tuple[int, int]]:
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
    width: int, height: int, *, tile: int, max_crops: int, min_crops: int = 2
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


def cut_tiles(image: Image.Image, grid: tuple[int, int], tile: int) -> torch.Tensor:
    """The whole image stretched to the grid (BICUBIC, aspect ignored), cut row-major: uint8
    [cols*rows, 3, tile, tile]."""
    cols, rows = grid
    stretched = image.resize((tile * cols, tile * rows), Image.Resampling.BICUBIC)
    hwc = np.asarray(stretched)  # [rows*tile, cols*tile, 3] uint8
    # Cut row-major (tile k at column k % cols, row k // cols) while still uint8.
    tiles = hwc.reshape(rows, tile, cols, tile, 3).transpose(0, 2, 4, 1, 3)
    return _chw(tiles.reshape(rows * cols, 3, tile, tile))


def padded_view(image: Image.Image, size: int) -> torch.Tensor:
    """The image padded to a `size` square around its aspect-preserving BICUBIC resize, grey fill: uint8
    [1, 3, size, size]. Pillow's own pad: its paste offset is round-half-even (3000x500 → y 426), part
    of parity."""
    return to_tensor(ImageOps.pad(image, (size, size), Image.Resampling.BICUBIC, color=PAD_COLOR))


def global_view(image: Image.Image, mode: ModeSpec, stretch_up_to: int) -> torch.Tensor:
    """The page's global view: without crop mode, sides up to `stretch_up_to` are a direct,
    aspect-distorting BICUBIC resize (the vendors' pad after it is a no-op); otherwise `padded_view`."""
    size = mode.global_size
    if not mode.crop_mode and size <= stretch_up_to:
        return to_tensor(image.resize((size, size), Image.Resampling.BICUBIC))
    return padded_view(image, size)


def assemble_page(
    original: Image.Image,
    mode: ModeSpec,
    grid: tuple[int, int],
    tile: int,
    text: str,
    encode: Callable[[str], list[int]],
    image_tokens: int,
) -> PreparedPage:
    """A page's views and prompt ids: the global view (`tile` is also the side up to which a view without
    crop mode is stretched) and, for a grid of 2 or more, its tiles; `image_tokens` placeholders."""
    if grid == (1, 1):
        view, tiles = global_view(original, mode, tile), None
    else:
        # The tiles' resize on a thread of its own while this one makes the global view (PIL resizes
        # without the GIL); a thread per call, no pool: nothing outlives the call into a later fork.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-tiles") as side:
            tiles_made = side.submit(cut_tiles, original, grid, tile)
            view = global_view(original, mode, tile)
            tiles = tiles_made.result()
    input_ids, mask = prompt_ids(text, encode, image_tokens)
    return PreparedPage(
        input_ids=input_ids,
        images_seq_mask=mask,
        image_positions=mask.nonzero().squeeze(1),
        global_pixels=view,
        tile_pixels=tiles,
        crop_grid=grid,
        image_tokens=image_tokens,
        prompt_tokens=len(input_ids),
        image_size=original.size,
        mode=mode,
        # Both vendors skip the image when its normalised global view sums to exactly 0.
        injects_image=not sums_to_zero(view),
    )


def _chw(uint8: np.ndarray) -> torch.Tensor:
    # The channel-first copy is made on uint8 by numpy (several times faster than a strided torch copy).
    return torch.from_numpy(np.require(uint8, requirements=["C_CONTIGUOUS", "WRITEABLE"]))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as uint8 [1, 3, H, W]."""
    return _chw(np.asarray(image).transpose(2, 0, 1)).unsqueeze(0)


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


def text_ids(text: str, encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """The prompt's ids before and after its image placeholder."""
    before, after = text.split(IMAGE_PLACEHOLDER)
    return (list(encode(before)) if before else []), (list(encode(after)) if after else [])


def prompt_ids(
    text: str, encode: Callable[[str], list[int]], image_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The page's ids (one BOS, the text with `image_tokens` placeholders for its image) and the mask
    that is True exactly at the placeholders."""
    ids_before, ids_after = text_ids(text, encode)
    ids = [BOS_TOKEN_ID, *ids_before, *([IMAGE_TOKEN_ID] * image_tokens), *ids_after]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    start = 1 + len(ids_before)
    mask[start : start + image_tokens] = True
    return torch.tensor(ids, dtype=torch.int64), mask


def longest_prompt(encode: Callable[[str], list[int]], prompt: str | None, most_image_tokens: int) -> int:
    """The most prompt tokens a page can make with `prompt` when its image takes at most
    `most_image_tokens` placeholders: BOS, the text and the placeholders."""
    ids_before, ids_after = text_ids(build_prompt(prompt), encode)
    return 1 + len(ids_before) + most_image_tokens + len(ids_after)


# ---------------------------------------------------------------------------------------------------
# Pixels


def normalize_pixels(pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The vendor's ToTensor + Normalize(0.5, 0.5) in float32: true division by 255 (multiplying by
    1/255 differs in 126 of the 256 values after the bf16 cast), then (x - 0.5) / 0.5, then the cast.
    The CPU's bits; on CUDA a division by a scalar is that multiplication, so the engine normalises
    there through a table of these 256 values made on the CPU."""
    return pixels.to(torch.float32).div_(255).sub_(0.5).div_(0.5).to(dtype)


_NORMALIZED_BYTES = normalize_pixels(torch.arange(256, dtype=torch.uint8)).double()


def sums_to_zero(pixels: torch.Tensor) -> bool:
    """Whether the normalised pixels sum to exactly 0, from the byte histogram (no float copy)."""
    counts = torch.bincount(pixels.flatten(), minlength=256).double()
    return bool((counts * _NORMALIZED_BYTES).sum() == 0)
