"""Preprocessing parity (spec §3–5, §12): tiling, token schedule, pixels, prompt ids, hostile inputs."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from dsocr_workers.errors import InputError
from dsocr_workers.model import preprocess as pp
from dsocr_workers.model.config import BOS_TOKEN_ID, IMAGE_TOKEN_ID
from dsocr_workers.model.deepseek_ocr.config import MODES
from dsocr_workers.model.deepseek_ocr.preprocess import (
    count_image_tokens,
    crop_grid,
    most_image_tokens,
    prepare_page,
)
from dsocr_workers.model.images import ImageProbe, load_image, probe_image
from dsocr_workers.model.preprocess import DEFAULT_PROMPT, PROMPTS, build_prompt


def byte_encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per UTF-8 byte, offset so that no id collides with BOS 0."""
    return [1000 + b for b in text.encode()]


def noise(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


def encoded(image: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height but carries no pixel data: a decompression-bomb header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def vendor_pixels(image: Image.Image) -> torch.Tensor:
    """The vendor's ToTensor + Normalize written out step by step, as the reference for ours."""
    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
    return (chw.to(torch.float32) / 255 - 0.5) / 0.5


# --- tiling and token schedule -------------------------------------------------------------------------

GUNDAM = MODES["gundam"]


@pytest.mark.parametrize(
    ("width", "height", "max_crops", "grid", "tokens"),
    [
        (1000, 800, 9, (2, 2), 693),  # equidistant from 2x2 and 3x2; too small for 3x2
        (1400, 1400, 9, (3, 3), 1203),  # same-ratio tie 2x2/3x3 broken by area
        (1400, 1400, 6, (2, 2), 693),  # vLLM's max 6 has no 3x3
        (640, 640, 9, (1, 1), 273),
        (500, 300, 9, (1, 1), 273),
        (1, 1, 9, (1, 1), 273),
        (1600, 2000, 9, (2, 3), 903),
        (640, 641, 9, (2, 2), 693),
        (641, 641, 9, (2, 2), 693),
        (1024, 1024, 9, (2, 2), 693),
        (1920, 1920, 9, (3, 3), 1203),
        (1240, 1754, 9, (2, 3), 903),  # A4 portrait scans
        (2480, 3508, 6, (2, 3), 903),
        (1280, 640, 9, (2, 1), 483),
        (640, 1280, 9, (1, 2), 493),
        (2560, 1280, 9, (4, 2), 1093),  # 2:1 tie 2x1/4x2: area large enough for 4x2
        (1300, 650, 9, (2, 1), 483),  # same ratio, too small for 4x2
        (1920, 1280, 9, (3, 2), 893),
        (6000, 600, 9, (9, 1), 1183),
        (600, 6000, 9, (1, 9), 1263),
        (6000, 600, 6, (6, 1), 273 + 10 * 61),
    ],
)
def test_crop_grid_and_gundam_tokens(width, height, max_crops, grid, tokens):
    assert crop_grid(width, height, max_crops) == grid
    assert count_image_tokens(GUNDAM, grid) == tokens


@pytest.mark.parametrize(("mode", "tokens"), [("tiny", 73), ("small", 111), ("base", 273), ("large", 421)])
def test_single_view_mode_tokens(mode, tokens):
    assert count_image_tokens(MODES[mode], (1, 1)) == tokens


def test_the_most_image_tokens_of_a_mode_come_from_its_tallest_grid():
    """What the warm-up readies the LM prefill for: a column of tiles has a newline per row, so 1×9
    takes more placeholders than any other grid of at most 9 tiles, 9×1 included."""
    assert most_image_tokens(GUNDAM, 9) == count_image_tokens(GUNDAM, (1, 9)) == 1263
    assert most_image_tokens(GUNDAM, 4) == count_image_tokens(GUNDAM, (1, 4)) > count_image_tokens(GUNDAM, (4, 1))
    assert most_image_tokens(MODES["base"]) == count_image_tokens(MODES["base"], (1, 1)) == 273


def test_crop_candidates_match_the_vendor_set_order():
    # 22 grids for max 9, 13 for max 6, sorted by tile count; the order within a count is CPython's
    # set order, which decides exact ties between grids of equal count.
    nine = pp.crop_candidates(2, 9)
    assert len(nine) == 22 and len(pp.crop_candidates(2, 6)) == 13
    assert [c * r for c, r in nine] == sorted(c * r for c, r in nine)
    assert nine[:5] == [(1, 2), (2, 1), (3, 1), (1, 3), (2, 2)]
    assert nine[-3:] == [(1, 9), (3, 3), (9, 1)]


def test_crop_grid_rejects_bad_arguments():
    with pytest.raises(InputError):
        crop_grid(0, 100)
    with pytest.raises(InputError):
        crop_grid(1000, 1000, 1)


# --- prompt --------------------------------------------------------------------------------------------


def test_build_prompt_default_named_and_stripped():
    assert build_prompt(None) == DEFAULT_PROMPT == PROMPTS["document"]
    assert build_prompt("free") == "<image>\nFree OCR."
    assert build_prompt("ocr") == "<image>\n<|grounding|>OCR this image."
    # the vendor examples carry a trailing space; the "plain" template strips it
    assert build_prompt("  <image>\n<|grounding|>Convert the document to markdown. ") == DEFAULT_PROMPT
    assert set(PROMPTS) >= {"document", "ocr", "free", "figure", "describe"}


@pytest.mark.parametrize("prompt", ["no placeholder", "<image><image> twice", ""])
def test_build_prompt_needs_exactly_one_image(prompt):
    with pytest.raises(InputError, match="exactly one '<image>'"):
        build_prompt(prompt)


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(InputError, match="tiny, small, base, large, gundam"):
        prepare_page(noise(8, 8), byte_encode, mode="huge")


# --- prepare_page ---------------------------------------------------------------------------------------


def test_prepare_page_gundam_layout_and_tensors():
    page = prepare_page(noise(1000, 800), byte_encode)
    assert page.crop_grid == (2, 2) and page.image_tokens == 693
    after = byte_encode("\n<|grounding|>Convert the document to markdown.")
    expected = [BOS_TOKEN_ID] + [IMAGE_TOKEN_ID] * 693 + after
    assert page.input_ids.dtype == torch.int64 and page.input_ids.tolist() == expected
    assert page.prompt_tokens == len(expected)
    assert page.images_seq_mask.dtype == torch.bool and page.images_seq_mask.shape == page.input_ids.shape
    assert int(page.images_seq_mask.sum()) == page.image_tokens
    assert torch.equal(page.images_seq_mask, page.input_ids == IMAGE_TOKEN_ID)
    assert page.global_view.shape == (1, 3, 1024, 1024) and page.global_view.dtype == torch.float32
    assert (
        page.tiles is not None and page.tiles.shape == (4, 3, 640, 640) and page.tiles.dtype == torch.float32
    )
    for t in (page.global_view, page.tiles):
        assert t.is_contiguous() and float(t.min()) >= -1.0 and float(t.max()) <= 1.0
    assert page.image_size == (1000, 800)
    assert page.mode is GUNDAM


def test_text_before_the_placeholder_is_encoded_after_bos():
    page = prepare_page(noise(64, 64), byte_encode, mode="tiny", prompt=" Look: <image>\nFree OCR. ")
    before, after = byte_encode("Look: "), byte_encode("\nFree OCR.")
    assert page.input_ids.tolist() == [BOS_TOKEN_ID] + before + [IMAGE_TOKEN_ID] * 73 + after
    mask = page.images_seq_mask.tolist()
    assert mask == [False] * (1 + len(before)) + [True] * 73 + [False] * len(after)


def test_tiles_are_a_row_major_cut_of_a_stretched_resize():
    image = noise(1600, 2000, seed=1)
    page = prepare_page(image, byte_encode, mode="gundam")
    assert page.crop_grid == (2, 3) and page.image_tokens == 903
    stretched = image.resize((1280, 1920), Image.Resampling.BICUBIC)
    for k in range(6):
        col, row = k % 2, k // 2
        tile = stretched.crop((col * 640, row * 640, col * 640 + 640, row * 640 + 640))
        assert torch.equal(page.tiles[k], vendor_pixels(tile)), f"tile {k}"
    assert torch.equal(
        page.global_view[0], vendor_pixels(ImageOps.pad(image, (1024, 1024), color=(127,) * 3))
    )


def test_max_crops_six_changes_the_grid():
    page = prepare_page(noise(1400, 1400), byte_encode, max_crops=6)
    assert page.crop_grid == (2, 2) and page.tiles.shape[0] == 4 and page.image_tokens == 693


def test_small_image_in_gundam_has_no_tiles():
    page = prepare_page(noise(640, 480), byte_encode)
    assert page.crop_grid == (1, 1) and page.tiles is None and page.image_tokens == 273
    assert page.global_view.shape == (1, 3, 1024, 1024)


@pytest.mark.parametrize(
    ("mode", "side", "tokens"),
    [("tiny", 512, 73), ("small", 640, 111), ("base", 1024, 273), ("large", 1280, 421)],
)
def test_single_view_modes(mode, side, tokens):
    image = noise(900, 300, seed=2)
    page = prepare_page(image, byte_encode, mode=mode)
    assert page.tiles is None and page.crop_grid == (1, 1)
    assert page.image_tokens == tokens and int(page.images_seq_mask.sum()) == tokens
    assert page.global_view.shape == (1, 3, side, side)
    if side <= 640:  # tiny/small stretch the page to a square, no gray bands
        reference = image.resize((side, side), Image.Resampling.BICUBIC)
    else:
        reference = ImageOps.pad(image, (side, side), color=(127, 127, 127))
    assert torch.equal(page.global_view[0], vendor_pixels(reference))


def test_pad_offset_rounds_half_to_even():
    # 3000x500 → contain to 1024x171; (1024-171)/2 = 426.5 pastes at y 426 (Pillow's round), not 427.
    page = prepare_page(Image.new("RGB", (3000, 500), (255, 0, 0)), byte_encode, mode="base")
    red = page.global_view[0, 0, :, 512]  # red channel down the middle column
    gray = vendor_pixels(Image.new("RGB", (1, 1), (127, 127, 127)))[0, 0, 0]
    rows = torch.nonzero(red != gray).flatten()
    assert int(rows.min()) == 426 and int(rows.max()) == 426 + 171 - 1


def test_normalisation_is_true_division_then_half():
    values = np.arange(256, dtype=np.uint8).reshape(1, 1, 256)
    expected = (values.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    ours = pp.normalize_pixels(torch.from_numpy(values)).numpy()
    assert np.array_equal(ours, expected)
    assert ours[0, 0, 0] == -1.0 and ours[0, 0, 255] == 1.0
    # multiplying by 1/255 instead would change bf16 inputs: the reason for true division
    multiplied = torch.from_numpy((values.astype(np.float32) * np.float32(1 / 255) - 0.5) / 0.5)
    assert not torch.equal(torch.from_numpy(ours).bfloat16(), multiplied.bfloat16())
    assert torch.equal(pp.normalize_pixels(torch.from_numpy(values), torch.bfloat16), torch.from_numpy(ours).bfloat16())


def test_balanced_global_view_is_detected_from_the_byte_histogram():
    half = Image.new("RGB", (1024, 1024), (0, 0, 0))
    half.paste((255, 255, 255), (0, 0, 1024, 512))  # normalised: -1 and +1 in equal numbers
    page = prepare_page(half, lambda text: [ord(c) for c in text], mode="base")
    assert page.global_view.sum() == 0 and not page.injects_image
    assert prepare_page(Image.new("RGB", (64, 64), (200, 10, 10)), lambda t: [1], mode="base").injects_image


# --- loading: EXIF, modes, formats ------------------------------------------------------------------------


def oriented(fmt: str) -> bytes:
    image = Image.new("RGB", (200, 100), (255, 255, 255))
    image.paste((255, 0, 0), (0, 0, 50, 50))  # a red block top-left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display needs a 90° clockwise turn
    return encoded(image, fmt, exif=exif)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_exif_orientation_is_applied(fmt, tmp_path):
    path = tmp_path / f"rotated.{fmt.lower()}"
    path.write_bytes(oriented(fmt))
    assert probe_image(path).width == 200  # the probe reports the stored size
    image = load_image(path)
    assert image.size == (100, 200)
    r, g, b = image.getpixel((90, 10))  # the red block is now top-right
    assert r > 200 and g < 60 and b < 60
    page = prepare_page(path, byte_encode, mode="base")
    assert page.image_size == (100, 200)


def test_corrupt_exif_is_tolerated_quietly():
    data = encoded(Image.new("RGB", (20, 10)), "JPEG", exif=b"Exif\x00\x00II*\x00\x08\x00\x00\x00\xff\xff")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(data).size == (20, 10)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Image.new("CMYK", (40, 30), (0, 255, 0, 0)),
        lambda: Image.fromarray(np.full((30, 40), 40000, dtype=np.uint16)),  # 16-bit gray
        lambda: Image.new("LA", (40, 30), (90, 10)),
        lambda: Image.new("1", (40, 30), 1),
        lambda: Image.new("PA", (40, 30)),
        lambda: Image.new("I", (40, 30), 7),
        lambda: noise(40, 30, mode="RGBA"),
    ],
    ids=["CMYK", "I;16", "LA", "1", "PA", "I", "RGBA"],
)
def test_odd_modes_in_memory_become_rgb(make):
    image = load_image(make())
    assert image.mode == "RGB" and image.size == (40, 30)


def test_rgba_alpha_is_dropped_not_composited():
    rgba = Image.new("RGBA", (4, 4), (10, 200, 30, 0))  # fully transparent
    assert load_image(rgba).getpixel((0, 0)) == (10, 200, 30)


@pytest.mark.parametrize(
    ("fmt", "make", "params"),
    [
        ("JPEG", lambda: Image.new("CMYK", (50, 40), (0, 255, 0, 0)), {}),
        ("PNG", lambda: Image.fromarray(np.arange(2000, dtype=np.uint16).reshape(40, 50) * 30), {}),
        ("PNG", lambda: Image.new("P", (50, 40), 3), {"transparency": 3}),
        ("PNG", lambda: Image.new("LA", (50, 40), (100, 50)), {}),
        ("PNG", lambda: Image.new("1", (50, 40), 1), {}),
        ("GIF", lambda: Image.new("P", (50, 40), 1), {"transparency": 1}),
        ("TIFF", lambda: Image.new("CMYK", (50, 40), (10, 20, 30, 40)), {}),
        ("BMP", lambda: noise(50, 40), {}),
        ("WEBP", lambda: noise(50, 40, mode="RGBA"), {"lossless": True}),
        ("PPM", lambda: noise(50, 40), {}),
    ],
    ids=[
        "cmyk-jpeg",
        "16bit-png",
        "palette-transparency",
        "la-png",
        "1bit-png",
        "gif",
        "cmyk-tiff",
        "bmp",
        "webp",
        "ppm",
    ],
)
def test_valid_files_in_odd_formats_load(fmt, make, params, tmp_path):
    path = tmp_path / "page.bin"  # the extension is irrelevant: the bytes decide
    path.write_bytes(encoded(make(), fmt, **params))
    probe = probe_image(path)
    assert (probe.width, probe.height) == (50, 40) and probe.format == fmt
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing for worker logs either
        page = prepare_page(path, byte_encode, mode="tiny")
    assert load_image(path).mode == "RGB" and page.image_size == (50, 40)
    assert page.global_view.shape == (1, 3, 512, 512)


def test_bytes_and_one_pixel_images(tmp_path):
    data = encoded(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG")
    for mode in MODES:
        page = prepare_page(data, byte_encode, mode=mode)
        assert page.crop_grid == (1, 1) and page.image_size == (1, 1)


def test_extreme_aspect_ratio_pads_without_error():
    page = prepare_page(Image.new("RGB", (5000, 2), (0, 0, 0)), byte_encode, mode="gundam")
    assert page.crop_grid == (9, 1) and page.tiles.shape == (9, 3, 640, 640)


# --- hostile inputs ---------------------------------------------------------------------------------------


def cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty file"),
        (b"# not an image\nhello\n", "not an image"),
        (png_header_only(30000, 30000), "too large"),
        (encoded(noise(64, 64), "PCX"), "format PCX is not allowed"),
    ],
    ids=["empty", "text-as-png", "bomb-30000", "pcx"],
)
def test_probe_and_load_reject_bad_files(content, reason, tmp_path):
    path = tmp_path / "page.png"
    path.write_bytes(content)
    with pytest.raises(InputError, match=reason):
        probe_image(path)
    with pytest.raises(InputError, match=reason):
        load_image(path)
    if content:
        with pytest.raises(InputError, match=reason):
            load_image(content)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files_fail_on_decode(fmt, tmp_path):
    path = tmp_path / "page.img"
    path.write_bytes(cut(encoded(noise(300, 200), fmt)))
    probe_image(path)  # the header is intact: the probe is cheap and cannot tell
    with pytest.raises(InputError, match="truncated or corrupt"):
        load_image(path)
    with pytest.raises(InputError, match="truncated or corrupt"):
        prepare_page(path, byte_encode)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        probe_image(tmp_path / "nope.png")
    with pytest.raises(InputError, match="no such file"):
        prepare_page(tmp_path / "nope.png", byte_encode)
    with pytest.raises(InputError, match="not a regular file"):
        load_image(tmp_path)


def test_pixel_limit_is_ours_and_no_pillow_warning_escapes(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(png_header_only(10000, 10000))  # above Pillow's own warning threshold (89.5 MP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match="100,000,000 pixels exceeds the limit of 64,000,000"):
            probe_image(path)
        assert probe_image(path, max_pixels=150_000_000).width == 10000
    with pytest.raises(InputError, match="too large"):
        load_image(noise(100, 100), max_pixels=9_999)
    with pytest.raises(InputError, match="too large"):
        prepare_page(encoded(noise(100, 100), "PNG"), byte_encode, max_pixels=9_999)


def test_probe_reports_format_size_and_mode(tmp_path):
    path = Path(tmp_path / "x.jpg")
    path.write_bytes(encoded(noise(30, 20), "PNG"))  # a PNG under a .jpg name
    assert probe_image(path) == ImageProbe(format="PNG", width=30, height=20, mode="RGB")
