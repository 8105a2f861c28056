"""Distinct pages of the same shapes: each page of a file list mirrored, flipped, turned and inverted
into up to 8 variants, written as JPEGs with a file list of their own.

Why: on random weights, two copies of one page decode the same tokens. Copies in one batch at the same
step (a wave of 128 slots over 18 pages) feed the same tokens, so the routed experts read fewer experts
than a batch of distinct pages makes them read, and the step is faster than serving would see. Variants
keep every page's size, so the token schedule (grid, prompt length) is the list's own.

    python3 benchmarks/page_variants.py --filelist datasets/omnidocbench/subsets/demo-18.txt \\
        --variants 8 --out /tmp/pages   # then --filelist /tmp/pages/pages.txt
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageOps

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsocr_workers.farm.filelist import read_filelist  # noqa: E402

Transform = Callable[[Image.Image], Image.Image]


def _turned(image: Image.Image) -> Image.Image:
    return image.rotate(180)


# Each keeps the page's width and height. The first is the page itself.
GEOMETRIC: tuple[tuple[str, Transform], ...] = (
    ("page", lambda image: image),
    ("mirrored", ImageOps.mirror),
    ("flipped", ImageOps.flip),
    ("turned", _turned),
)
VARIANTS: tuple[tuple[str, Transform], ...] = GEOMETRIC + tuple(
    (f"{name}-inverted", lambda image, move=move: ImageOps.invert(move(image))) for name, move in GEOMETRIC
)


def write_variants(filelist: Path, variants: int, out: Path) -> Path:
    """`variants` (1 … 8) of every readable page of `filelist` under `out`/images, listed in
    `out`/pages.txt, page by page (a page's variants together). Returns that list's path."""
    if not 1 <= variants <= len(VARIANTS):
        raise ValueError(f"variants: 1 … {len(VARIANTS)}, not {variants}")
    listed = read_filelist(filelist)
    if not listed.images:
        raise ValueError(f"{filelist}: no readable page")
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    names = []
    for image in listed.images:
        with Image.open(image.path) as opened:
            page = opened.convert("RGB")
        for label, move in VARIANTS[:variants]:
            name = f"images/{image.path.stem}-{label}.jpg"
            move(page).save(out / name, quality=95)
            names.append(name)
    target = out / "pages.txt"
    header = f"# {variants} variants of each page of {filelist} (benchmarks/page_variants.py)\n"
    target.write_text(header + "\n".join(names) + "\n")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filelist", type=Path, required=True)
    parser.add_argument("--variants", type=int, default=len(VARIANTS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        print(write_variants(args.filelist, args.variants, args.out))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
