"""Model markup → boxes, `result.mmd`, an overlay and figure crops, as the vendor's `save_results` (spec §8).

Grounded output interleaves spans `<|ref|>label<|/ref|><|det|>[[x1,y1,x2,y2],…]<|/det|>` with the text
of each region; coordinates are in 0..999 bins of the EXIF-corrected original. Unlike the vendor, the
coordinate literal is parsed as JSON (never `eval`), and nothing the model writes can raise here:
malformed spans and a span cut short by the token limit are counted, not fatal.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# The vendor's pattern, DOTALL and non-greedy: the span, the label, the coordinate literal.
SPAN_RE = re.compile(r"(<\|ref\|>(.*?)<\|/ref\|><\|det\|>(.*?)<\|/det\|>)", re.DOTALL)
REF_OPEN = "<|ref|>"
IMAGE_SPAN_MARK = "<|ref|>image<|/ref|>"  # the vendor's test for a figure span
COORD_BINS = 999  # the vendor divides by 999 although the paper speaks of 1000 bins


@dataclass(frozen=True)
class Region:
    label: str
    boxes: list[tuple[int, int, int, int]]  # pixels (x1, y1, x2, y2) in the original
    text: str  # the text after this span up to the next span, stripped


@dataclass(frozen=True)
class ParsedMarkup:
    regions: list[Region]
    skipped_spans: int  # malformed spans plus a trailing span cut short


def _is_number(v: object) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


def _pixel(v: float, side: int) -> int:
    # The vendor's int(v / 999 * W); clamped so that out-of-range bins stay inside the image.
    return min(max(int(v / COORD_BINS * side), 0), side)


def _parse_boxes(literal: str, width: int, height: int) -> list[tuple[int, int, int, int]] | None:
    """The coordinate literal as pixel boxes, or None when it is not a non-empty list of 4 numbers each."""
    try:
        value = json.loads(literal)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, list) or not value:
        return None
    boxes = []
    for box in value:
        if not isinstance(box, list) or len(box) != 4 or not all(_is_number(v) for v in box):
            return None
        x1, y1, x2, y2 = box
        try:
            boxes.append((_pixel(x1, width), _pixel(y1, height), _pixel(x2, width), _pixel(y2, height)))
        except OverflowError:  # a number too large for a float
            return None
    return boxes


def parse_markup(text: str, width: int, height: int) -> ParsedMarkup:
    """Regions of grounded markup in pixels of a width x height original. Never raises on any text."""
    matches = list(SPAN_RE.finditer(text))
    tail_start = matches[-1].end() if matches else 0
    # A `<|ref|>` after the last complete span never closed: the output was cut (max_new_tokens).
    cut = text.find(REF_OPEN, tail_start)
    truncated = cut != -1
    end_of_text = cut if truncated else len(text)

    regions: list[Region] = []
    skipped = int(truncated)
    for k, match in enumerate(matches):
        boxes = _parse_boxes(match.group(3), width, height)
        if boxes is None:
            skipped += 1
            continue
        text_end = matches[k + 1].start() if k + 1 < len(matches) else end_of_text
        regions.append(Region(match.group(2), boxes, text[match.end() : text_end].strip()))
    return ParsedMarkup(regions=regions, skipped_spans=skipped)


def boxes_json(parsed: ParsedMarkup) -> list[dict[str, Any]]:
    return [{"label": r.label, "boxes": [list(b) for b in r.boxes], "text": r.text} for r in parsed.regions]


def render_mmd(text: str) -> str:
    """The vendor's `result.mmd`: figure spans become image links, every other span is deleted.

    Replays the vendor's replace loops exactly (spec §8): `str.replace` hits every copy of a span,
    links count figure *spans* (not boxes), and the two LaTeX fixes run inside the loop over the other
    spans, so they happen only when there is at least one."""
    spans = [m.group(1) for m in SPAN_RE.finditer(text)]
    figures = [s for s in spans if IMAGE_SPAN_MARK in s]
    others = [s for s in spans if IMAGE_SPAN_MARK not in s]
    out = text
    for idx, span in enumerate(figures):
        out = out.replace(span, f"![](images/{idx}.jpg)\n")
    for span in others:
        out = out.replace(span, "").replace("\\coloneqq", ":=").replace("\\eqqcolon", "=:")
    return out


def _ordered(box: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = box
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def draw_overlay(original: Image.Image, parsed: ParsedMarkup, *, seed: int = 0) -> Image.Image:
    """The vendor's `result_with_boxes` picture: per region a colour (R, G in [0, 200), B in [0, 255)),
    outlines 4 px for titles and 2 px otherwise, a fill at alpha 20, and the label over a light box.
    The vendor's colours are unseeded; ours come from `seed` so the picture is reproducible."""
    rng = np.random.default_rng(seed)
    picture = original.convert("RGB")  # a copy; boxes go on the copy, never on the original
    fills = Image.new("RGBA", picture.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(picture)
    draw_fills = ImageDraw.Draw(fills)
    font = ImageFont.load_default()
    for region in parsed.regions:
        color = (int(rng.integers(0, 200)), int(rng.integers(0, 200)), int(rng.integers(0, 255)))
        width = 4 if region.label == "title" else 2
        for box in region.boxes:
            x1, y1, x2, y2 = _ordered(box)
            draw.rectangle((x1, y1, x2, y2), outline=color, width=width)
            draw_fills.rectangle((x1, y1, x2, y2), fill=(*color, 20), outline=(0, 0, 0, 0), width=1)
            text_xy = (x1, max(0, y1 - 15))
            draw.rectangle(draw.textbbox(text_xy, region.label, font=font), fill=(255, 255, 255, 30))
            draw.text(text_xy, region.label, font=font, fill=color)
    picture.paste(fills, (0, 0), fills)
    return picture


def _crop_box(box: tuple[int, int, int, int], width: int, height: int) -> tuple[int, int, int, int]:
    # At least one pixel, inside the image, so that a degenerate box still yields a savable crop.
    x1, y1, x2, y2 = _ordered(box)
    x1, y1 = min(x1, width - 1), min(y1, height - 1)
    return x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)


def crop_figures(original: Image.Image, parsed: ParsedMarkup) -> list[Image.Image]:
    """Every box of every `image` region, in order (the vendor's `images/{k}.jpg`, k counting boxes)."""
    return [
        original.crop(_crop_box(box, original.width, original.height))
        for region in parsed.regions
        if region.label == "image"
        for box in region.boxes
    ]


def write_outputs(out_dir: Path, text: str, original: Image.Image, parsed: ParsedMarkup) -> dict[str, Path]:
    """Write the raw markup, boxes JSON, `result.mmd`, the overlay and the figure crops into out_dir.

    Returns {path relative to out_dir: absolute path} for every file written."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}

    def put(name: str) -> Path:
        written[name] = out_dir / name
        return written[name]

    put("markup.txt").write_text(text, encoding="utf-8")
    # One region per line: valid JSON that still reads well and diffs line by line.
    lines = ",\n".join(json.dumps(region, ensure_ascii=False) for region in boxes_json(parsed))
    put("boxes.json").write_text(f"[\n{lines}\n]\n" if lines else "[]\n", encoding="utf-8")
    put("result.mmd").write_text(render_mmd(text), encoding="utf-8")
    draw_overlay(original, parsed).save(put("result_with_boxes.jpg"), "JPEG")
    for k, crop in enumerate(crop_figures(original, parsed)):
        crop.convert("RGB").save(put(f"images/{k}.jpg"), "JPEG")
    return written
