"""DeepSeek-OCR-2 preprocessing against a step-by-step transcription of the vendor's (the HF remote
code's `infer`, `dynamic_preprocess`, `find_closest_aspect_ratio`, `BasicImageTransform`): crop grids
and their tie rule, pixels, token schedule and prompt ids, on the OmniDocBench demo pages and
synthetic sizes; and where transformers' `deepseek_ocr2` image processor differs."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from dsocr_workers.errors import InputError
from dsocr_workers.model.config import BOS_TOKEN_ID, IMAGE_TOKEN_ID
from dsocr_workers.model.deepseek_ocr2 import preprocess as pp
from dsocr_workers.model.deepseek_ocr2.config import DEFAULT_MODE, MAX_CROPS, MIN_CROPS, MODES
from dsocr_workers.model.preprocess import longest_prompt, normalize_pixels
from dsocr_workers.model.tokenizer import OCRTokenizer

DEMO = Path(os.environ.get("OMNIDOCBENCH_DEMO_DIR")
            or Path(__file__).resolve().parents[3] / "shared" / "data" / "omnidocbench-demo")  # fmt: skip
DEMO_PAGES = sorted((DEMO / "images").glob("*.jpg")) if (DEMO / "images").is_dir() else []


def byte_encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per UTF-8 byte, offset so that no id collides with BOS 0."""
    return [1000 + b for b in text.encode()]


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


# --- the vendor's preprocessing, transcribed step by step -------------------------------------------


def vendor_grid(width: int, height: int, min_num: int = 2, max_num: int = 6, image_size: int = 768):
    target_ratios = set(
        (i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
        if i * j <= max_num and i * j >= min_num
    )
    target_ratios = sorted(target_ratios, key=lambda x: x[0] * x[1])
    aspect_ratio, area = width / height, width * height
    best_ratio_diff, best_ratio = float("inf"), (1, 1)
    for ratio in target_ratios:
        ratio_diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if ratio_diff < best_ratio_diff:
            best_ratio_diff, best_ratio = ratio_diff, ratio
        elif ratio_diff == best_ratio_diff:  # noqa: SIM102 (the vendor's nesting, kept)
            if area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
                best_ratio = ratio
    return best_ratio


def vendor_crops(image: Image.Image, max_num: int = 6, image_size: int = 768) -> tuple[list, tuple[int, int]]:
    ratio = vendor_grid(*image.size, max_num=max_num)
    target_width, target_height = image_size * ratio[0], image_size * ratio[1]
    resized = image.resize((target_width, target_height))  # Pillow's default for RGB: BICUBIC
    columns = target_width // image_size
    crops = [
        resized.crop((
            (i % columns) * image_size, (i // columns) * image_size,
            (i % columns + 1) * image_size, (i // columns + 1) * image_size,
        ))
        for i in range(ratio[0] * ratio[1])
    ]
    return crops, ratio


def vendor_transform(image: Image.Image) -> torch.Tensor:
    """torchvision's ToTensor then Normalize(0.5, 0.5), written out: float32 / 255, then (x-0.5)/0.5."""
    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
    return chw.to(torch.float32).div(255).sub_(0.5).div_(0.5)


def vendor_page(image: Image.Image, prompt: str, encode, base_size: int, image_size: int, crop_mode: bool,
                max_num: int = 6):
    """`infer()`'s image and prompt handling: (global view, crops or None, input ids, seq mask)."""
    image = ImageOps.exif_transpose(image).convert("RGB")
    mean_color = tuple(int(x * 255) for x in (0.5, 0.5, 0.5))
    text_splits = prompt.strip().split("<image>")
    tokenized = list(encode(text_splits[0])) if text_splits[0] else []
    seq_mask = [False] * len(tokenized)
    crops = None
    if crop_mode:
        if image.size[0] <= 768 and image.size[1] <= 768:
            crop_ratio = [1, 1]
        else:
            raw_crops, crop_ratio = vendor_crops(image, max_num=max_num)
        global_view = ImageOps.pad(image, (base_size, base_size), color=mean_color)
        width_crop_num, height_crop_num = crop_ratio
        if width_crop_num > 1 or height_crop_num > 1:
            crops = torch.stack([vendor_transform(c) for c in raw_crops])
        num_queries = math.ceil((image_size // 16) / 4)
        num_queries_base = math.ceil((base_size // 16) / 4)
        tokenized_image = [IMAGE_TOKEN_ID] * num_queries_base * num_queries_base + [IMAGE_TOKEN_ID]
        if width_crop_num > 1 or height_crop_num > 1:
            tokenized_image += [IMAGE_TOKEN_ID] * (num_queries * width_crop_num) * (num_queries * height_crop_num)
    else:
        if image_size <= 768:
            image = image.resize((image_size, image_size))
        global_view = ImageOps.pad(image, (image_size, image_size), color=mean_color)
        num_queries = math.ceil((image_size // 16) / 4)
        tokenized_image = [IMAGE_TOKEN_ID] * num_queries * num_queries + [IMAGE_TOKEN_ID]
    tokenized += tokenized_image
    seq_mask += [True] * len(tokenized_image)
    after = list(encode(text_splits[-1])) if text_splits[-1] else []
    tokenized += after
    seq_mask += [False] * len(after)
    ids = torch.tensor([BOS_TOKEN_ID, *tokenized])
    return vendor_transform(global_view)[None], crops, ids, torch.tensor([False, *seq_mask])


def assert_page_is_the_vendors(image: Image.Image, mode: str = DEFAULT_MODE, prompt: str | None = None,
                               encode=byte_encode, max_crops: int = MAX_CROPS, source=None):
    """Our page of `source` (default: `image`) against the vendor's of `image`."""
    spec = MODES[mode]
    page = pp.prepare_page(source or image, encode, mode=mode, prompt=prompt, max_crops=max_crops)
    text = prompt or "<image>\n<|grounding|>Convert the document to markdown."
    global_view, crops, ids, seq_mask = vendor_page(
        image, text, encode, spec.base_size, spec.image_size, spec.crop_mode, max_num=max_crops
    )
    assert page.global_pixels.dtype == torch.uint8
    assert torch.equal(normalize_pixels(page.global_pixels), global_view)
    # the vendor then casts to bf16: equal float32 inputs give equal bf16 inputs
    assert torch.equal(normalize_pixels(page.global_pixels, torch.bfloat16), global_view.bfloat16())
    if crops is None:
        assert page.tile_pixels is None and page.crop_grid == (1, 1)
    else:
        assert page.tile_pixels is not None and page.tile_pixels.shape[1:] == (3, 768, 768)
        assert torch.equal(normalize_pixels(page.tile_pixels), crops)
        assert page.crop_grid == vendor_grid(*page.image_size, max_num=max_crops)
    assert torch.equal(page.input_ids, ids) and torch.equal(page.images_seq_mask, seq_mask)
    assert page.image_tokens == int(seq_mask.sum()) and page.prompt_tokens == len(ids)
    return page


# --- parity ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not DEMO_PAGES, reason=f"OmniDocBench's demo pages are not in {DEMO}/images")
@pytest.mark.parametrize("index", range(18))
def test_demo_pages_are_preprocessed_as_the_vendor_does(index):
    assert len(DEMO_PAGES) == 18
    with Image.open(DEMO_PAGES[index]) as image:
        page = assert_page_is_the_vendors(image, source=DEMO_PAGES[index])
    assert page.image_tokens == 257 + 144 * len(page.tile_pixels if page.tile_pixels is not None else [])


# The spec's measured grids, then one size per remaining candidate grid of at most 6 crops.
GRIDS = [
    ((700, 768), (1, 1)),
    ((768, 768), (1, 1)),
    ((1600, 900), (2, 1)),
    ((2304, 768), (3, 1)),
    ((1000, 800), (2, 2)),
    ((1920, 1920), (2, 2)),
    ((3840, 768), (5, 1)),
    ((2480, 3508), (2, 3)),
    ((800, 1200), (2, 3)),
    ((3000, 500), (6, 1)),
    ((769, 1536), (1, 2)),
    ((768, 2304), (1, 3)),
    ((768, 3072), (1, 4)),
    ((3072, 768), (4, 1)),
    ((768, 3840), (1, 5)),
    ((500, 3000), (1, 6)),
    ((2304, 1536), (3, 2)),
]


@pytest.mark.parametrize(("size", "grid"), GRIDS, ids=[f"{w}x{h}" for (w, h), _ in GRIDS])
def test_crop_grids_and_pixels_are_the_vendors(size, grid):
    assert pp.select_crop_grid(*size, min_crops=MIN_CROPS, max_crops=MAX_CROPS, tile=pp.CROP_SIZE) == grid
    # the vendor asks for a grid only above 768 px (`dynamic_preprocess` never returns 1×1)
    assert vendor_grid(*size) == grid if max(size) > 768 else grid == (1, 1)
    page = assert_page_is_the_vendors(noise(*size, seed=sum(size)))
    assert page.crop_grid == grid


def test_every_candidate_grid_is_reachable():
    reached = {pp.select_crop_grid(768 * c, 768 * r, max_crops=MAX_CROPS, tile=768)
               for c, r in pp.crop_candidates(MIN_CROPS, MAX_CROPS)}
    assert reached == set(pp.crop_candidates(MIN_CROPS, MAX_CROPS)) and len(reached) == 13


@pytest.mark.parametrize(
    ("size", "grid"),
    [
        ((1000, 800), (2, 2)),  # 1.25 is as far from 2×2 as from 3×2; too few pixels for 3×2
        ((2000, 1600), (3, 2)),  # the same tie with enough pixels: the later (more crops) grid wins
    ],
)
def test_an_exact_tie_goes_to_more_crops_only_with_the_pixels_for_them(size, grid):
    assert vendor_grid(*size) == grid
    assert assert_page_is_the_vendors(noise(*size)).crop_grid == grid


@pytest.mark.parametrize("mode", ["gundam", "base", "small"])
@pytest.mark.parametrize("size", [(1000, 333), (333, 1000), (640, 480), (1600, 900), (1, 1)])
def test_every_mode_is_the_vendors(mode, size):
    page = assert_page_is_the_vendors(noise(*size, seed=7), mode=mode)
    assert page.global_pixels.shape[-1] == MODES[mode].global_size


def test_odd_padding_pastes_at_the_half_rounded_to_even():
    # 1000×333 → 1024×341; padding 683, half 341.5 → the vendor (Pillow) pastes at row 342
    page = assert_page_is_the_vendors(Image.new("RGB", (1000, 333), (255, 0, 0)))
    red = page.global_pixels[0, 0, :, 512]
    rows = torch.nonzero(red != 127).flatten()
    assert (int(rows.min()), int(rows.max())) == (342, 342 + 341 - 1)


@pytest.mark.parametrize(
    ("mode", "grid", "tokens"),
    [("gundam", (1, 1), 257), ("gundam", (2, 1), 545), ("gundam", (3, 1), 689), ("gundam", (2, 2), 833),
     ("gundam", (5, 1), 977), ("gundam", (2, 3), 1121), ("gundam", (6, 1), 1121),
     ("base", (1, 1), 257), ("small", (1, 1), 145)],
)
def test_token_schedule(mode, grid, tokens):
    assert pp.count_image_tokens(mode, grid) == tokens


def test_the_most_image_tokens_come_from_six_crops():
    assert pp.most_image_tokens("gundam") == 1121
    assert pp.most_image_tokens("gundam", max_crops=4) == 257 + 4 * 144
    assert pp.most_image_tokens("base") == 257 and pp.most_image_tokens("small") == 145
    prompt_ids = byte_encode("\nFree OCR.")
    assert longest_prompt(byte_encode, "free", pp.most_image_tokens("gundam")) == 1 + 1121 + len(prompt_ids)


def test_prompt_ids_with_the_preset_tokenizer():
    """One BOS, the text before `<image>`, the placeholders, the text after: no role tags, no EOS."""
    tokenizer = OCRTokenizer.build_preset()
    page = assert_page_is_the_vendors(noise(1600, 900), prompt="<image>\nFree OCR. ", encode=tokenizer.encode)
    assert page.input_ids[0] == BOS_TOKEN_ID and (page.input_ids == BOS_TOKEN_ID).sum() == 1
    assert page.input_ids[1:546].eq(IMAGE_TOKEN_ID).all() and page.image_tokens == 545
    assert page.input_ids[546:].tolist() == tokenizer.encode("\nFree OCR.")
    grounding = pp.prepare_page(noise(64, 64), tokenizer.encode)
    assert 128820 in grounding.input_ids.tolist()  # <|grounding|> is one token at the vendor id


def test_text_before_the_placeholder():
    assert_page_is_the_vendors(noise(900, 900), prompt=" Look: <image>\nFree OCR.")


def test_exif_rotation_is_applied_before_everything():
    stored = noise(1600, 900, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed after a 90° clockwise turn: 900×1600
    buffer = io.BytesIO()
    stored.save(buffer, "PNG", exif=exif)
    page = pp.prepare_page(buffer.getvalue(), byte_encode)
    assert page.image_size == (900, 1600) and page.crop_grid == (1, 2)
    with Image.open(io.BytesIO(buffer.getvalue())) as image:
        assert_page_is_the_vendors(image, source=buffer.getvalue())


def test_a_balanced_global_view_is_flagged_as_the_vendor_skips_it():
    half = Image.new("RGB", (1024, 1024), (0, 0, 0))
    half.paste((255, 255, 255), (0, 0, 1024, 512))
    assert not pp.prepare_page(half, byte_encode, mode="base").injects_image
    assert pp.prepare_page(noise(64, 64), byte_encode).injects_image


def test_modes_are_this_familys():
    from dsocr_workers.model.deepseek_ocr.config import MODES as V1_MODES

    with pytest.raises(InputError, match="gundam, base, small"):
        pp.prepare_page(noise(8, 8), byte_encode, mode="large")
    with pytest.raises(InputError, match="not a DeepSeek-OCR-2 mode"):
        pp.prepare_page(noise(8, 8), byte_encode, mode=V1_MODES["gundam"])  # v1's: 640-px tiles


# --- transformers' image processor: where it differs ------------------------------------------------


def test_transformers_floors_the_paste_offset_where_the_vendor_rounds_half_to_even():
    """transformers' PIL-backend processor: the same crops and pixel values, but its global view is
    pasted at floor(padding / 2): one row higher than the vendor's for 1000×333 (341 vs 342)."""
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import (
        DeepseekOcr2ImageProcessorPil,
    )

    image = noise(1000, 333, seed=11)
    theirs = DeepseekOcr2ImageProcessorPil()(image, return_tensors="pt")
    page = assert_page_is_the_vendors(image)
    ours = normalize_pixels(page.global_pixels)[0]
    assert torch.equal(normalize_pixels(page.tile_pixels), theirs["pixel_values_local"])
    assert not torch.equal(ours, theirs["pixel_values"][0])
    assert torch.equal(ours[:, 342:342 + 341], theirs["pixel_values"][0][:, 341:341 + 341])
