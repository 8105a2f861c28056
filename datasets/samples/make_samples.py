"""Generate the synthetic document pages in this folder (Pillow only, seeded, deterministic).

    python datasets/samples/make_samples.py            # rewrite the images and samples.txt here
    python datasets/samples/make_samples.py --out DIR  # write them somewhere else

Every page is drawn from scratch: titles, paragraphs of pseudo-English, a ruled table with cell text, a
chart, a formula line (fraction, sum, superscripts). The sizes cover what the DeepSeek-OCR
preprocessing treats differently: a page within 640 px (no tiles), A4 portrait, a 16:9 slide, a square,
a very tall strip, the 1600x2000 benchmark page (2x3 tiles in gundam mode) and a JPEG whose pixels are
stored sideways with an EXIF orientation tag. Output is byte-identical for a given Pillow + zlib.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont, ImageOps

HERE = Path(__file__).resolve().parent
SEED = 20251121

INK = (20, 20, 24)
GREY = (110, 110, 118)
RULE = (60, 60, 66)
PALETTE = [(52, 101, 164), (204, 102, 51), (78, 154, 6), (117, 80, 123), (196, 160, 0)]

WORD_TEXT = (
    "page layout region block table figure caption formula equation column row cell header footer "
    "section paragraph margin baseline glyph token vision encoder decoder prefill cache latency "
    "throughput worker queue ledger lease attempt result report median sample batch image scan "
    "document reader model output markup grounding box label score measure stage timing profile "
    "kernel memory device host transfer compressed patch window attention projector newline crop "
    "tile ratio width height scale index value metric series summary method dataset record review"
)
WORDS = WORD_TEXT.split()
BAR_LABELS = ("prep", "sam", "clip", "proj", "lm", "decode", "write")


def font(size: int) -> ImageFont.FreeTypeFont:
    # Pillow's bundled font: the same glyphs on every machine, no system font lookup.
    return ImageFont.load_default(size=size)


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randint(1, len(words) - 1), str(rng.randint(2, 2048)))
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


@dataclass
class Page:
    """A canvas with a text cursor: blocks are stacked from the top margin down."""

    image: Image.Image
    margin: int
    y: int = 0

    def __post_init__(self) -> None:
        self.draw = ImageDraw.Draw(self.image)
        self.y = self.margin

    @property
    def width(self) -> int:
        return self.image.width - 2 * self.margin

    def space(self, pixels: int) -> None:
        self.y += pixels


def text_width(text: str, f: ImageFont.FreeTypeFont) -> float:
    return f.getlength(text)


def wrap(text: str, f: ImageFont.FreeTypeFont, width: int) -> list[str]:
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and text_width(candidate, f) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    if line:
        lines.append(line)
    return lines


def draw_title(page: Page, text: str, size: int, x: int | None = None, bold: bool = True) -> None:
    f = font(size)
    x = page.margin if x is None else x
    page.draw.text((x, page.y), text, font=f, fill=INK, stroke_width=1 if bold else 0, stroke_fill=INK)
    page.y += int(size * 1.5)


def draw_paragraph(page: Page, text: str, size: int, x: int | None = None, width: int | None = None) -> None:
    f = font(size)
    x = page.margin if x is None else x
    width = page.width if width is None else width
    for line in wrap(text, f, width):
        page.draw.text((x, page.y), line, font=f, fill=INK)
        page.y += int(size * 1.4)
    page.y += size // 2


def draw_bullets(page: Page, items: list[str], size: int, x: int, width: int) -> None:
    f = font(size)
    for item in items:
        r = size // 5
        cy = page.y + size // 2 + 2
        page.draw.ellipse((x, cy - r, x + 2 * r, cy + r), fill=INK)
        for line in wrap(item, f, width - 3 * size // 2):
            page.draw.text((x + 3 * size // 2, page.y), line, font=f, fill=INK)
            page.y += int(size * 1.35)
        page.y += size // 3


def draw_table(page: Page, rng: random.Random, rows: int, cols: int, size: int,
               x: int | None = None, width: int | None = None, caption: str = "") -> None:
    """A fully ruled grid: a bold header row, a label column, numbers elsewhere."""
    f = font(size)
    x = page.margin if x is None else x
    width = page.width if width is None else width
    if caption:
        page.draw.text((x, page.y), caption, font=f, fill=GREY)
        page.y += int(size * 1.6)
    row_h = int(size * 1.9)
    col_w = width // cols
    top = page.y
    header = ["Name"] + [rng.choice(WORDS).capitalize() for _ in range(cols - 1)]
    for r in range(rows):
        for c in range(cols):
            if r == 0:
                cell = header[c]
            elif c == 0:
                cell = f"{rng.choice(WORDS)}-{r}"
            else:
                cell = f"{rng.uniform(0, 999):.1f}"
            bold = 1 if r == 0 else 0
            page.draw.text((x + c * col_w + size // 2, top + r * row_h + (row_h - size) // 2), cell,
                           font=f, fill=INK, stroke_width=bold, stroke_fill=INK)
    for r in range(rows + 1):
        thickness = 2 if r in (0, 1, rows) else 1
        page.draw.line((x, top + r * row_h, x + cols * col_w, top + r * row_h), fill=RULE, width=thickness)
    for c in range(cols + 1):
        page.draw.line((x + c * col_w, top, x + c * col_w, top + rows * row_h), fill=RULE, width=1)
    page.y = top + rows * row_h + size


def draw_bar_chart(page: Page, rng: random.Random, width: int, height: int, size: int,
                   x: int | None = None, caption: str = "") -> None:
    """Axes with ticks, coloured bars with value labels, category names under the axis."""
    f = font(size)
    x0 = (page.margin if x is None else x) + 3 * size
    y0 = page.y + height  # the x axis
    bars = rng.randint(4, 7)
    values = [rng.uniform(0.15, 1.0) for _ in range(bars)]
    plot_w = width - 4 * size
    page.draw.line((x0, page.y, x0, y0), fill=RULE, width=2)
    page.draw.line((x0, y0, x0 + plot_w, y0), fill=RULE, width=2)
    for tick in range(5):
        ty = y0 - tick * (height - size) // 4
        page.draw.line((x0 - 6, ty, x0, ty), fill=RULE, width=1)
        page.draw.text((x0 - 3 * size, ty - size // 2), str(tick * 25), font=f, fill=GREY)
    slot = plot_w // bars
    for i, v in enumerate(values):
        left = x0 + i * slot + slot // 5
        top = y0 - int(v * (height - size))
        page.draw.rectangle((left, top, left + slot * 3 // 5, y0 - 1), fill=PALETTE[i % len(PALETTE)])
        page.draw.text((left, top - int(size * 1.3)), f"{v * 100:.0f}", font=f, fill=INK)
        page.draw.text((left, y0 + size // 3), BAR_LABELS[i], font=f, fill=INK)
    page.y = y0 + int(size * 1.8)
    if caption:
        page.draw.text((x0, page.y), caption, font=f, fill=GREY)
        page.y += int(size * 1.8)


def draw_line_chart(page: Page, rng: random.Random, x: int, width: int, height: int, size: int) -> None:
    """Two series over a light grid, with a legend."""
    f = font(size)
    top = page.y
    page.draw.rectangle((x, top, x + width, top + height), outline=RULE, width=2)
    for i in range(1, 5):
        gy = top + i * height // 5
        page.draw.line((x, gy, x + width, gy), fill=(215, 215, 220), width=1)
    for s, colour in enumerate(PALETTE[:2]):
        level = rng.uniform(0.3, 0.7)
        points = []
        for i in range(12):
            level = min(0.95, max(0.05, level + rng.uniform(-0.15, 0.15)))
            points.append((x + i * width // 11, top + int((1 - level) * height)))
        page.draw.line(points, fill=colour, width=4)
        page.draw.rectangle((x + 10, top + 10 + s * int(size * 1.5), x + 10 + size, top + 10 + s * int(size * 1.5) + size // 2), fill=colour)
        page.draw.text((x + 20 + size, top + 2 + s * int(size * 1.5)), f"series {s + 1}", font=f, fill=INK)
    page.y = top + height + size


def draw_formula(page: Page, size: int, number: int, x: int | None = None, width: int | None = None) -> None:
    """f(x) = (a + b x) / (1 + x^2) + SUM_{i=1}^{n} w_i x_i   (number), with a drawn sum sign and
    fraction bar: the bundled font has ASCII glyphs only."""
    f, small = font(size), font(size * 3 // 5)
    left = page.margin if x is None else x
    right = left + (page.width if width is None else width)
    x = left + size
    mid = page.y + size * 3 // 2  # the fraction bar / math axis
    d = page.draw

    def put(text: str, at_x: float, top: float, fnt: ImageFont.FreeTypeFont = f) -> float:
        d.text((at_x, top), text, font=fnt, fill=INK)
        return at_x + text_width(text, fnt)

    cx = put("f(x) = ", x, mid - size * 0.6)
    num, den = "a + b x", "1 + x"
    w = max(text_width(num, f), text_width(den, f) + text_width("2", small)) + size // 2
    put(num, cx + (w - text_width(num, f)) / 2, mid - size * 1.25)
    d.line((cx, mid, cx + w, mid), fill=INK, width=max(2, size // 14))
    end = put(den, cx + size // 4, mid + size * 0.15)
    put("2", end, mid + size * 0.05, small)
    cx = put(" + ", cx + w, mid - size * 0.6)
    # The sum sign: a drawn sigma with limits above and below.
    sw, sh = size * 0.9, size * 1.3
    top, bot = mid - sh / 2, mid + sh / 2
    d.line([(cx + sw, top), (cx, top), (cx + sw * 0.5, mid), (cx, bot), (cx + sw, bot)], fill=INK,
           width=max(2, size // 12))
    put("n", cx + sw * 0.3, top - size * 0.75, small)
    put("i=1", cx, bot + size * 0.05, small)
    cx = put(" w", cx + sw + size * 0.2, mid - size * 0.6)
    cx = put("i", cx, mid - size * 0.05, small)
    cx = put(" x", cx, mid - size * 0.6)
    put("i", cx, mid - size * 0.05, small)
    put(f"({number})", right - 3 * size, mid - size * 0.6)
    page.y = int(bot + size * 1.2)


# Pages ---------------------------------------------------------------------------------------------

def small_page(rng: random.Random) -> Image.Image:
    page = Page(Image.new("RGB", (600, 480), "white"), margin=28)
    draw_title(page, "Field notes: queue latency", 24)
    draw_paragraph(page, paragraph(rng, 2), 14)
    draw_table(page, rng, rows=4, cols=3, size=13, caption="Table 1. Stage times (ms)")
    draw_formula(page, 18, 1)
    return page.image


def a4_page(rng: random.Random) -> Image.Image:
    page = Page(Image.new("RGB", (1240, 1754), "white"), margin=110)
    draw_title(page, "Profiling a Vision Language Model on Many GPUs", 38)
    draw_paragraph(page, "A. Reader, B. Writer  -  Technical Report 7", 20)
    draw_title(page, "Abstract", 24)
    draw_paragraph(page, paragraph(rng, 4), 20)
    draw_title(page, "1  Introduction", 26)
    draw_paragraph(page, paragraph(rng, 5), 20)
    draw_formula(page, 30, 1)
    draw_title(page, "2  Measurements", 26)
    draw_table(page, rng, rows=6, cols=5, size=18, caption="Table 1. Per-stage timings over the dev set.")
    draw_bar_chart(page, rng, width=page.width, height=300, size=18,
                   caption="Figure 1. Share of end-to-end time per stage.")
    draw_paragraph(page, paragraph(rng, 3), 20)
    return page.image


def slide_page(rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (1600, 900), "white")
    page = Page(img, margin=70)
    page.draw.rectangle((0, 0, 1600, 130), fill=PALETTE[0])
    page.draw.text((70, 38), "Decode throughput per worker", font=font(52), fill="white", stroke_width=1,
                   stroke_fill="white")
    page.y = 190
    draw_bullets(page, [sentence(rng) for _ in range(4)], 30, x=70, width=700)
    page.y = 190
    draw_line_chart(page, rng, x=850, width=680, height=420, size=24)
    page.y = 700
    draw_formula(page, 34, 3)
    return page.image


def square_page(rng: random.Random) -> Image.Image:
    page = Page(Image.new("RGB", (1400, 1400), "white"), margin=90)
    draw_title(page, "Two-column layout with a table and a chart", 40)
    start = page.y
    col_w = (page.width - 60) // 2
    draw_paragraph(page, paragraph(rng, 6), 22, width=col_w)
    draw_formula(page, 30, 2, width=col_w)
    draw_paragraph(page, paragraph(rng, 4), 22, width=col_w)
    page.y = start
    right = page.margin + col_w + 60
    draw_table(page, rng, rows=7, cols=3, size=20, x=right, width=col_w, caption="Table 2. Results per worker.")
    draw_bar_chart(page, rng, width=col_w, height=330, size=20, x=right, caption="Figure 2. Pages per second.")
    draw_paragraph(page, paragraph(rng, 3), 22, x=right, width=col_w)
    return page.image


def tall_page(rng: random.Random) -> Image.Image:
    page = Page(Image.new("RGB", (800, 4000), "white"), margin=50)
    draw_title(page, "A very long strip of content", 32)
    for section in range(1, 11):
        draw_title(page, f"{section}. {rng.choice(WORDS).capitalize()} {rng.choice(WORDS)}", 24)
        draw_paragraph(page, paragraph(rng, 4), 17)
        if section % 2:
            draw_table(page, rng, rows=5, cols=4, size=15, caption=f"Table {section}. Values.")
        else:
            draw_bar_chart(page, rng, width=page.width, height=220, size=15, caption=f"Figure {section}.")
        if section % 3 == 0:
            draw_formula(page, 22, section)
    return page.image


def report_page(rng: random.Random) -> Image.Image:
    """The benchmark page size of ../../shared/anchors.md: 1600x2000 -> 2x3 tiles in gundam mode."""
    page = Page(Image.new("RGB", (1600, 2000), "white"), margin=130)
    draw_title(page, "Quarterly Report on Document Throughput", 48)
    draw_paragraph(page, paragraph(rng, 5), 24)
    draw_title(page, "Summary table", 32)
    draw_table(page, rng, rows=7, cols=6, size=22, caption="Table 1. Throughput by site.")
    draw_formula(page, 36, 1)
    draw_title(page, "Trend", 32)
    draw_bar_chart(page, rng, width=page.width, height=420, size=22, caption="Figure 1. Pages per hour.")
    draw_paragraph(page, paragraph(rng, 4), 24)
    return page.image


def rotated_scan(rng: random.Random) -> Image.Image:
    """An upright 900x1200 page, returned rotated so that EXIF orientation 6 (rotate 90 degrees
    clockwise to display) brings it back upright."""
    page = Page(Image.new("RGB", (900, 1200), (250, 249, 246)), margin=70)
    draw_title(page, "Scanned memo (EXIF orientation 6)", 30)
    draw_paragraph(page, paragraph(rng, 4), 19)
    draw_table(page, rng, rows=4, cols=4, size=17, caption="Table 1. Counts.")
    draw_formula(page, 24, 1)
    draw_paragraph(page, paragraph(rng, 3), 19)
    return page.image.transpose(Image.Transpose.ROTATE_90)


@dataclass(frozen=True)
class Sample:
    name: str
    render: Callable[[random.Random], Image.Image]
    note: str


SAMPLES = (
    Sample("small_600x480.png", small_page, "within 640 px on both sides: no tiles in any mode"),
    Sample("a4_portrait_1240x1754.png", a4_page, "A4 at 150 dpi"),
    Sample("slide_1600x900.png", slide_page, "16:9 landscape slide"),
    Sample("square_1400x1400.png", square_page, "square: 3x3 tiles with max 9, 2x2 with max 6"),
    Sample("tall_800x4000.png", tall_page, "very tall strip (1:5)"),
    Sample("report_1600x2000.png", report_page, "the benchmark page size: 2x3 tiles, 903 image tokens"),
    Sample("scan_exif_rotated.jpg", rotated_scan, "JPEG stored sideways with EXIF orientation 6"),
)


def save(image: Image.Image, path: Path) -> None:
    if path.suffix == ".jpg":
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation: the 0th row is the visual right side -> rotate 90 CW to view
        image.save(path, "JPEG", quality=80, exif=exif.tobytes())
        return
    # Mostly white pages with a few colours: a 64-colour palette keeps each file small without
    # visible loss; readers convert to RGB anyway.
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, "PNG", optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: this folder)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["# Synthetic document pages made by make_samples.py; paths relative to this file's folder."]
    for index, sample in enumerate(SAMPLES):
        rng = random.Random(SEED * 100 + index)
        path = args.out / sample.name
        save(sample.render(rng), path)
        with Image.open(path) as check:
            size = ImageOps.exif_transpose(check).size
        lines.append(f"# {sample.note}; {size[0]}x{size[1]} after EXIF transpose")
        lines.append(sample.name)
        print(f"{path}  {size[0]}x{size[1]}  {path.stat().st_size // 1024} KiB")
    (args.out / "samples.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
