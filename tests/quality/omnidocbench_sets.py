"""The prediction sets the agreement tests score (tests/quality/data/omnidocbench/README.md): the public
demo predictions and sets derived here from the ground truth, each exercising one matching or
normalisation path of the official evaluator. Derived sets are made at test time (seeded, so always the
same files); the official evaluator's outputs for all of them are committed, while OmniDocBench's own
files (its demo ground truth, slimmed, and its demo predictions) live in the shared data folder,
`shared/data/omnidocbench-demo/` beside the checkout (OMNIDOCBENCH_DEMO_DIR elsewhere).

usage: python -m tests.quality.omnidocbench_sets DEMO_DATA_DIR OUT_DIR
  (DEMO_DATA_DIR: OmniDocBench's demo_data/): writes OUT_DIR/ground_truth.json (slimmed),
  OUT_DIR/predictions/demo/ (the shared folder's contents) and every set to OUT_DIR/sets/<set>/ for
  the evaluator."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

from lxml import html as lxml_html

DATA = Path(__file__).parent / "data" / "omnidocbench"
DEMO = Path(os.environ.get("OMNIDOCBENCH_DEMO_DIR")
            or Path(__file__).resolve().parents[3] / "shared" / "data" / "omnidocbench-demo")  # fmt: skip
SCORED = ("text_block", "title", "code_txt", "code_txt_caption", "reference", "equation_caption",
          "figure_caption", "figure_footnote", "table_caption", "table_footnote", "code_algorithm",
          "code_algorithm_caption", "header", "footer", "page_footnote", "page_number")  # fmt: skip


def slim(page: dict) -> dict:
    """A page without the polygons and spans: end-to-end scoring reads neither."""
    blocks = [{k: v for k, v in block.items() if k not in ("poly", "line_with_spans")}
              for block in page["layout_dets"]]  # fmt: skip
    return {"layout_dets": blocks, "extra": page["extra"], "page_info": page["page_info"]}


def reference_blocks(page: dict) -> list[tuple[str, str]]:
    """(kind, markdown) of each readable block, in reading order."""
    ordered = sorted(page["layout_dets"], key=lambda b: b.get("order") if isinstance(b.get("order"), int) else 10**6)
    out = []
    for block in ordered:
        category = block["category_type"]
        if category in SCORED and block.get("text"):
            out.append(("title" if category == "title" else "text", block["text"]))
        elif category == "equation_isolated" and block.get("latex"):
            latex = block["latex"].strip().strip("$").strip()
            out.append(("formula", f"$$\n{latex}\n$$"))
        elif category == "table" and block.get("html"):
            out.append(("table", block["html"]))
    return out


def pipe_table(table_html: str) -> str:
    rows = [[" ".join(cell.text_content().split()) for cell in row.xpath("./td|./th")]
            for row in lxml_html.fromstring(table_html).xpath(".//tr")]  # fmt: skip
    rows = [r for r in rows if r]
    if not rows:
        return ""
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in rows]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * width]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def echo(blocks: list[tuple[str, str]]) -> str:
    return "\n\n".join(("# " + text) if kind == "title" else text for kind, text in blocks)


def split_merged(blocks: list[tuple[str, str]], rng: random.Random) -> str:
    """Every other pair of neighbouring text blocks merged into one paragraph; long ones split in two."""
    out: list[str] = []
    k = 0
    while k < len(blocks):
        kind, text = blocks[k]
        if kind == "text" and k + 1 < len(blocks) and blocks[k + 1][0] == "text" and rng.random() < 0.5:
            out.append(text + " " + blocks[k + 1][1])
            k += 2
            continue
        if kind == "text" and len(text) > 80 and rng.random() < 0.6:
            cut = len(text) // 2
            out += [text[:cut], text[cut:]]
        else:
            out.append(("# " + text) if kind == "title" else text)
        k += 1
    return "\n\n".join(out)


def inline_math(blocks: list[tuple[str, str]], rng: random.Random) -> str:
    """Display formulas written inline in a sentence or as a one-dollar paragraph; numbers in text as
    inline math with a command."""
    out = []
    for kind, text in blocks:
        if kind == "formula":
            latex = text.strip("$\n ")
            out.append(f"where ${latex}$ holds" if rng.random() < 0.5 else f"${latex}$")
        elif kind == "text":
            out.append(re.sub(r"(\d+)", lambda m: rf"$\mathrm{{{m.group(1)}}}^{{2}}$"
                              if rng.random() < 0.2 else m.group(1), text, count=3))  # fmt: skip
        else:
            out.append(("# " + text) if kind == "title" else text)
    return "\n\n".join(out)


def pipe_tables(blocks: list[tuple[str, str]]) -> str:
    return "\n\n".join(pipe_table(text) if kind == "table" else ("# " + text) if kind == "title" else text
                       for kind, text in blocks)  # fmt: skip


def empty_lines(blocks: list[tuple[str, str]], rng: random.Random) -> str:
    """Paragraphs that normalise to nothing (rules, bullets, punctuation) between real ones."""
    furniture = ["---", "* * *", "·", "……", "()", "—", "|  |"]
    out = []
    for kind, text in blocks:
        if rng.random() < 0.4:
            out.append(rng.choice(furniture))
        out.append(("# " + text) if kind == "title" else text)
    return "\n\n".join(out)


def unmatched(blocks: list[tuple[str, str]], rng: random.Random) -> str:
    """Some blocks dropped, invented paragraphs and a table nothing in the reference matches added."""
    invented = ["Lorem ipsum dolor sit amet, consectetur adipiscing elit.", "这是一段参考答案中没有的文字。",
                "<table><tr><td>x</td><td>y</td></tr><tr><td>1</td><td>2</td></tr></table>"]
    out = []
    for kind, text in blocks:
        if rng.random() < 0.25:
            continue
        out.append(("# " + text) if kind == "title" else text)
        if rng.random() < 0.2:
            out.append(rng.choice(invented))
    return "\n\n".join(out + [invented[0]])


def reordered(blocks: list[tuple[str, str]], rng: random.Random) -> str:
    shuffled = list(blocks)
    rng.shuffle(shuffled)
    return echo(shuffled)


DERIVED = {"echo": lambda b, r: echo(b), "split_merged": split_merged, "inline_math": inline_math,
           "pipe_tables": lambda b, r: pipe_tables(b), "empty_lines": empty_lines,
           "unmatched": unmatched, "reordered": reordered}  # fmt: skip
SETS = ("demo", *DERIVED)


def write_set(name: str, pages: list[dict], directory: Path, demo: Path = DEMO) -> None:
    """One prediction set's markdown files (`<image stem>.md`) into `directory`."""
    if name == "demo":
        shutil.copytree(demo / "predictions" / "demo", directory, dirs_exist_ok=True)
        return
    directory.mkdir(parents=True, exist_ok=True)
    for page in pages:
        rng = random.Random(f"{name}:{page['page_info']['image_path']}")
        stem = Path(page["page_info"]["image_path"]).stem
        (directory / f"{stem}.md").write_text(DERIVED[name](reference_blocks(page), rng), encoding="utf-8")


def main(demo_data: Path, out: Path) -> None:
    pages = json.loads((demo_data / "omnidocbench_demo" / "OmniDocBench_demo.json").read_text(encoding="utf-8"))
    slimmed = [slim(p) for p in pages]
    out.mkdir(parents=True, exist_ok=True)
    (out / "ground_truth.json").write_text(json.dumps(slimmed, ensure_ascii=False, indent=0), encoding="utf-8")
    shutil.copytree(demo_data / "end2end", out / "predictions" / "demo", dirs_exist_ok=True)
    for name in SETS:
        write_set(name, slimmed, out / "sets" / name, demo=out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
