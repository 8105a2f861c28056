"""A page's markdown against its OmniDocBench reference: normalised edit distance per category, the way
OmniDocBench's end-to-end evaluation computes its page-level figures (lower is better, 0 = identical).

1. The markdown is split as OmniDocBench splits a prediction: images and code fences dropped, long
   runs of one character shortened, then HTML / Markdown / LaTeX tables and display formulas
   (`$$…$$`, `\\[…\\]`, a paragraph that is one `$…$`) taken out; the rest, split at blank lines, are
   text blocks.
2. Each side is normalised per category: text keeps only letters, digits and CJK characters (its
   `clean_string`); formulas drop delimiters, tags, font and spacing commands and spaces, lower-cased;
   tables keep the cells' HTML without styling attributes.
3. Predicted blocks are matched one-to-one to reference blocks of the same category by the Hungarian
   method on normalised edit distance (OmniDocBench's `simple_match`). A reference block left without
   a partner counts as wholly deleted, predicted blocks left over as wholly inserted.
4. A page's score for a category is Σ edits / Σ max(len(reference), len(prediction)) over its blocks;
   text pairs whose reference is page furniture or a caption (IGNORED_TEXT_CATEGORIES) are matched and
   then left out, so a predicted header costs nothing. Reading order is the edit distance between the
   reference's order of the scored text blocks and the order in which the prediction wrote them.

Not reproduced (the official evaluator over `dsocr export --omnidocbench` gives them): its
`quick_match`, which also merges blocks split differently on the two sides, and text and formulas
matched in one pool; inline LaTeX turned into Unicode (here `$\\alpha$` reads "alpha" on both sides);
LaTeX tables converted to HTML (compared as written); TEDS and CDM.
"""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Levenshtein
from scipy.optimize import linear_sum_assignment

from dsocr_workers.quality.omnidocbench import (
    FORMULA_CATEGORY,
    IGNORED_TEXT_CATEGORIES,
    TABLE_CATEGORY,
    TEXT_CATEGORIES,
    PageReference,
)

# --- the prediction's blocks -------------------------------------------------------------------------

_IMAGE = re.compile(r"!\[.*?\]\(.*?\)")
_FENCE_OPEN = re.compile(r"^```markdown\n?", re.MULTILINE)
_FENCE_CLOSE = re.compile(r"```\n?$", re.MULTILINE)
_HTML_TABLE = re.compile(r"<table\b[^>]*>.*?</table>", re.DOTALL | re.IGNORECASE)
_LATEX_TABLE = re.compile(r"\\begin\{tabular\}.*?\\end\{tabular\}", re.DOTALL)
_MARKDOWN_TABLE = re.compile(r"(?:^[ \t]*\|.*\|[ \t]*(?:\n|$)){2,}", re.MULTILINE)
_DISPLAY_FORMULA = re.compile(r"\$\$(.+?)\$\$|\\\[(.+?)\\\]", re.DOTALL)
_CODE_BLOCK = re.compile(r"```\w*\n(.*?)```", re.DOTALL)
_LATEX_WRAPPERS = re.compile(r"\\(?:title|text|section\*?)\s*\{\s*(.*?)\s*\}", re.DOTALL)


@dataclass(frozen=True)
class MarkdownBlocks:
    """A prediction split by category, each list in the order the markdown writes it."""

    text: list[str]
    formulas: list[str]
    tables: list[str]


def _repeats_shortened(text: str) -> str:
    """OmniDocBench's `replace_repeated_chars`: a dotted leader or a rule of 500 dashes is not text."""
    text = re.sub(r"_{4,}", "____", text)
    text = re.sub(r" {4,}", "    ", text)
    return re.sub(r"([^a-zA-Z0-9])\1{10,}", r"\1\1\1\1", text)


def _markdown_table_html(table: str) -> str:
    """A pipe table as HTML rows, its `|---|` rule left out."""
    rows = []
    for line in table.strip().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if all(re.fullmatch(r":?-{3,}:?", cell) for cell in cells):
            continue
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def split_markdown(markdown: str) -> MarkdownBlocks:
    """The text blocks, display formulas and tables of one page of markdown."""
    content = _IMAGE.sub("", markdown)
    content = _FENCE_CLOSE.sub("", _FENCE_OPEN.sub("", content))
    content = _repeats_shortened(content)
    found: list[tuple[int, str, str]] = []  # (position, category, content)

    def take(pattern: re.Pattern[str], category: str, convert: Callable[[re.Match[str]], str]) -> None:
        nonlocal content
        for match in pattern.finditer(content):
            found.append((match.start(), category, convert(match)))
        # Blanked, not cut out: later positions stay comparable.
        content = pattern.sub(lambda m: " " * len(m.group(0)), content)

    take(_LATEX_TABLE, "table", lambda m: m.group(0))
    take(_HTML_TABLE, "table", lambda m: m.group(0))
    take(_DISPLAY_FORMULA, "formula", lambda m: m.group(0))
    take(_MARKDOWN_TABLE, "table", lambda m: _markdown_table_html(m.group(0)))
    take(_CODE_BLOCK, "text", lambda m: m.group(1).strip())

    separator = "\n\n" if "\n\n" in content else "\n"  # some output has single line breaks only
    position = 0
    for piece in content.split(separator):
        text = "\n".join(line.strip() for line in piece.strip().split("\n") if line.strip())
        text = _LATEX_WRAPPERS.sub(r"\1", text)
        if text.startswith("$") and text.endswith("$") and text.replace("$", "").strip():
            found.append((position, "formula", text))
        elif text:
            found.append((position, "text", text))
        position += len(piece) + len(separator)
    found.sort(key=lambda item: item[0])
    return MarkdownBlocks(
        [c for _, kind, c in found if kind == "text" and c],
        [c for _, kind, c in found if kind == "formula"],
        [c for _, kind, c in found if kind == "table"],
    )


# --- normalisation -----------------------------------------------------------------------------------

_INLINE_MATH = re.compile(r"\$(.*?)\$|\\\((.*?)\\\)")
_FORMULA_FILTERS = (
    "\\mathbf", "\\mathrm", "\\mathnormal", "\\mathit", "\\mathbb", "\\mathcal", "\\mathscr", "\\mathfrak",
    "\\mathsf", "\\mathtt", "\\textbf", "\\text", "\\boldmath", "\\boldsymbol", "\\operatorname", "\\bm",
    "\\symbfit", "\\mathbfcal", "\\symbf", "\\scriptscriptstyle", "\\notag", "\\setlength", "\\coloneqq",
    "\\space", "\\thickspace", "\\thinspace", "\\medspace", "\\nobreakspace", "\\negmedspace", "\\quad",
    "\\qquad", "\\enspace", "\\substackw", " ",
)  # fmt: skip


def normalize_text(text: str) -> str:
    """OmniDocBench's `clean_string`: inline-formula delimiters off, then only word characters (letters
    and digits of any script, `_`) and CJK ideographs are kept; whitespace and punctuation go."""
    text = _INLINE_MATH.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(2), text)
    for escape in ("\\t", "\\n", "\t", "\n", "/t", "/n"):  # its list, literal escapes included
        text = text.replace(escape, "")
    return re.sub(r"[^\w\u4e00-\u9fff]", "", text)


def normalize_formula(latex: str) -> str:
    """OmniDocBench's `normalized_formula`: delimiters, `\\tag`, `\\hspace`, environments, font and
    spacing commands and spaces removed, lower-cased."""
    text = latex.strip()
    for opening, closing in (("$$", "$$"), ("\\[", "\\]"), ("$", "$")):
        if text.startswith(opening) and text.endswith(closing) and len(text) >= len(opening) + len(closing):
            text = text[len(opening) : len(text) - len(closing)].strip()
            break
    for pattern in (r"\\tag\{.*?\}", r"\\hspace\{.*?\}", r"\\begin\{.*?\}", r"\\end\{.*?\}", r"\\arraycolsep.*?\}"):
        text = re.sub(pattern, "", text)
    text = text.strip(".")
    for command in _FORMULA_FILTERS:
        text = text.replace(command, "")
    return text.lower()


_TABLE_ATTRIBUTES = re.compile(r'\s(?:style|height|width|align|class)="[^"]*"')
_TABLE_INNER = re.compile(r"<table\b[^>]*>(.*)</table>", re.DOTALL | re.IGNORECASE)


def normalize_table(table: str) -> str:
    """OmniDocBench's `normalized_html_table`: header cells as cells, entities decoded, NFKC, the rows
    of the table without styling attributes, tbody / thead / span / sup / sub / div / p tags and
    colgroups dropped, whitespace collapsed, in its fixed wrapper."""
    text = re.sub(r"<th\b", "<td", table, flags=re.IGNORECASE)
    text = re.sub(r"</th>", "</td>", text, flags=re.IGNORECASE)
    text = re.sub(r"</?(?:thead|span)\b[^>]*>", "", text, flags=re.IGNORECASE)
    text = unicodedata.normalize("NFKC", html.unescape(text).replace("\n", "")).strip()
    text = "".join(_TABLE_INNER.findall(text))
    text = _TABLE_ATTRIBUTES.sub("", text)
    text = re.sub(r"</?tbody>", "", text)
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"</?(?:sup|sub|div|p)>", "", text)
    text = re.sub(r"<colgroup>.*?</colgroup>", "", text)
    return f'<html><body><table border="1" >{text}</table></body></html>'


# --- matching and page scores -----------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """One reference block and the predicted block matched to it (None: left without a partner), or
    (reference None) the predicted blocks nothing matched, joined."""

    reference: str | None
    prediction: str | None
    category: str  # the reference block's category; "" for unmatched predictions
    order: int | None  # the reference block's reading order
    predicted_at: int | None  # index of the predicted block in the markdown


def match_blocks(
    reference: Sequence[tuple[str, str, int | None]], predicted: Sequence[str]
) -> list[Pair]:
    """Reference blocks (normalised content, category, order) matched one-to-one to normalised predicted
    blocks by minimum total normalised edit distance. Empty blocks take no part."""
    reference = [block for block in reference if block[0]]
    kept = [(k, p) for k, p in enumerate(predicted) if p]
    pairs: list[Pair] = []
    matched_predictions: set[int] = set()
    if reference and kept:
        costs = process.cdist([r[0] for r in reference], [p for _, p in kept],
                              scorer=Levenshtein.normalized_distance, dtype=np.float64)  # fmt: skip
        rows, columns = linear_sum_assignment(costs)
        partner = dict(zip(rows.tolist(), columns.tolist(), strict=True))
    else:
        partner = {}
    for i, (content, category, order) in enumerate(reference):
        j = partner.get(i)
        if j is None:
            pairs.append(Pair(content, None, category, order, None))
        else:
            matched_predictions.add(j)
            pairs.append(Pair(content, kept[j][1], category, order, kept[j][0]))
    left_over = [p for j, (_, p) in enumerate(kept) if j not in matched_predictions]
    if left_over:
        pairs.append(Pair(None, "".join(left_over), "", None, None))
    return pairs


def page_edit_distance(pairs: Sequence[Pair]) -> float | None:
    """Σ edits / Σ max(len) over the pairs; None when there is nothing on either side."""
    edits = length = 0
    for pair in pairs:
        ref, pred = pair.reference or "", pair.prediction or ""
        edits += Levenshtein.distance(ref, pred)
        length += max(len(ref), len(pred))
    return edits / length if length else None


def reading_order_edit_distance(pairs: Sequence[Pair]) -> float | None:
    """The reading orders of the reference blocks, sorted, against the same orders listed in the order
    the prediction wrote their matched blocks (an unmatched reference block is missing from the
    latter): normalised edit distance of the two sequences."""
    expected = sorted(p.order for p in pairs if p.reference is not None and p.order is not None)
    written = [p.order for p in sorted(
        (p for p in pairs if p.reference is not None and p.predicted_at is not None and p.order is not None),
        key=lambda p: p.predicted_at or 0,
    )]  # fmt: skip
    if not expected and not written:
        return None
    return Levenshtein.normalized_distance(expected, written)


@dataclass(frozen=True)
class PageScores:
    """Normalised edit distances of one page, None where neither side has anything of the category."""

    text: float | None
    formula: float | None
    table: float | None
    reading_order: float | None


def score_page(markdown: str, reference: PageReference) -> PageScores:
    blocks = split_markdown(markdown)

    def pairs_of(categories: Sequence[str], normalize: Callable[[str], str], predicted: list[str]) -> list[Pair]:
        ref = [(normalize(b.content), b.category, b.order) for b in reference.of(categories)]
        return match_blocks(ref, [normalize(p) for p in predicted])

    text = [p for p in pairs_of(TEXT_CATEGORIES + IGNORED_TEXT_CATEGORIES, normalize_text, blocks.text)
            if p.category not in IGNORED_TEXT_CATEGORIES]  # fmt: skip
    # Formulas and tables are scored on pages whose reference has some, as OmniDocBench does.
    formulas = reference.of([FORMULA_CATEGORY])
    tables = reference.of([TABLE_CATEGORY])
    return PageScores(
        text=page_edit_distance(text),
        formula=page_edit_distance(pairs_of([FORMULA_CATEGORY], normalize_formula, blocks.formulas))
        if formulas else None,
        table=page_edit_distance(pairs_of([TABLE_CATEGORY], normalize_table, blocks.tables)) if tables else None,
        reading_order=reading_order_edit_distance(text),
    )
