"""The engine on its own, outside the farm (`dsocr infer`, `dsocr verify`): a session opened from the
command line's choices, one page through it into an output folder, and the page the self-checks run on.

The steps stay separate calls because the command line shows something between them: the model it
loaded, then the decode's progress.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

from dsocr_workers.engine.result import DecodeOptions, InferenceResult, result_document
from dsocr_workers.engine.sampling import validate_options
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.variants import AUTO
from dsocr_workers.model.images import load_image
from dsocr_workers.model.postprocess import parse_markup, write_outputs
from dsocr_workers.model.preprocess import build_prompt

# `dsocr verify` without --image: a page of this size (Gundam 2×2 grid, small enough for the tiny
# preset on a CPU in seconds).
DEMO_PAGE_SIZE = (1000, 800)
RESULT_FILE = "result.json"


@dataclass(frozen=True)
class SessionOptions:
    """Which model to load, where and how (`--model`, `--device`, `--engine`, `--dtype`, `--preset-seed`)."""

    model: str = "tiny"  # a vendor checkpoint directory, or a random-weight preset
    device: str | None = None  # None: cuda if available, else cpu
    engine: str = AUTO
    dtype: str | None = None  # a torch dtype's name; None: bfloat16 on CUDA, float32 on CPU
    seed: int = 0  # of preset weights


def open_session(options: SessionOptions) -> DeepSeekOCRSession:
    device = options.device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return DeepSeekOCRSession.from_local(
        options.model,
        device=device,
        dtype=getattr(torch, options.dtype) if options.dtype else None,
        engine=options.engine,
        seed=options.seed,
    )


@dataclass(frozen=True)
class InferPage:
    """One page for `dsocr infer`: how it is read and decoded, and where its outputs go."""

    image: Path
    out_dir: Path
    prompt: str | None = None  # text with <image> once, or a vendor prompt's name; None: document
    mode: str | None = None  # None: the model family's default
    max_new_tokens: int | None = None  # None: up to the model's positions
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    max_crops: int | None = None  # None: the model family's limit


def check_page(request: InferPage) -> Image.Image:
    """The page's EXIF-corrected original (also the boxes' frame), once the decode options and the prompt
    have been checked: bad input fails before a model is loaded."""
    validate_options(request.decode)
    build_prompt(request.prompt)
    return load_image(request.image)


@dataclass(frozen=True)
class PageOutputs:
    """What `infer_page` computed and wrote."""

    result: InferenceResult
    out_dir: Path
    files: list[str]  # relative to out_dir, result.json included
    document: dict[str, Any]  # the contents of result.json (`result_document`)


def infer_page(
    session: DeepSeekOCRSession,
    request: InferPage,
    original: Image.Image,
    on_decode_progress: Callable[[int, int], None] | None = None,
) -> PageOutputs:
    """Run the page and write its outputs (markup, boxes, result.mmd, overlay, figure crops) and
    result.json into `request.out_dir`. `original` is `check_page`'s image."""
    result = session.run_inference(
        request.image,
        prompt=request.prompt,
        mode=request.mode,
        max_new_tokens=request.max_new_tokens,
        infer=request.decode,
        max_crops=request.max_crops,
        on_decode_progress=on_decode_progress,
    )
    written = write_outputs(request.out_dir, result.text, original, parse_markup(result.text, *original.size))
    files = sorted([*written, RESULT_FILE])
    document = result_document(result, files)
    (request.out_dir / RESULT_FILE).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return PageOutputs(result, request.out_dir, files, document)


def demo_page() -> Image.Image:
    """A deterministic synthetic page (text lines, a table, a figure) for `dsocr verify`."""
    width, height = DEMO_PAGE_SIZE
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    draw.text((60, 40), "Synthetic page for dsocr verify", fill="black")
    for k in range(18):
        draw.text(
            (60, 90 + 22 * k), f"line {k:02d}: the quick brown fox jumps over the lazy dog", fill="black"
        )
    for r in range(5):
        for c in range(4):
            draw.rectangle((60 + 110 * c, 520 + 40 * r, 170 + 110 * c, 560 + 40 * r), outline="black")
    draw.ellipse((620, 520, 900, 740), fill=(40, 90, 160))
    return page


def verify_page(image: Path | None) -> Image.Image:
    """The page `dsocr verify` checks on: `image`, or without one the synthetic `demo_page`."""
    return load_image(image) if image is not None else demo_page()
