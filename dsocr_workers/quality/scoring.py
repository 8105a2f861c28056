"""A page's markdown scored against its OmniDocBench reference as the official end-to-end evaluator does
(`pdf_validation.py`, quick_match; tested page by page against its stored outputs in
tests/quality/test_official_agreement.py): the markdown cut into blocks (quality/markdown.py), then:

1. Tables first, paired one-to-one by the Hungarian method on the raw HTML's edit distance; a predicted
   table's leftover cells join the text. A page with more LaTeX than HTML tables scores its tables as
   missing (the evaluator's LaTeXML conversion is not reproduced).
2. Reference text and display formulas matched in one pool against the predicted blocks by
   `quick_match` (quality/matching.py), or one-to-one past its time limit (the evaluator's fallback);
   page furniture, captions and unmatched predictions are left out; a reference formula answered by a
   text block is scored as text.
3. Per page, per category: Σ edits / Σ max(len(reference), len(prediction)); tables also TEDS and
   structure-only TEDS; reading order: the edit distance between the reference's and the prediction's
   orders of the reference text blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bs4 import BeautifulSoup
from rapidfuzz.distance import Levenshtein

from dsocr_workers.quality import markdown as md
from dsocr_workers.quality.matching import (
    ONE_TO_ONE,
    QUICK_MATCH,
    MatchedEntry,
    OutOfTime,
    ReferenceItem,
    one_to_one_match,
    quick_match,
    simple_match,
)
from dsocr_workers.quality.normalize import clean_text, latex_to_unicode, normalize_table
from dsocr_workers.quality.omnidocbench import (
    FORMULA_CATEGORY,
    TABLE_CATEGORY,
    TEXT_CATEGORIES,
    PageReference,
)
from dsocr_workers.quality.teds import teds
from dsocr_workers.settings import MATCH_TIME_LIMIT

# The reference categories matched against predicted text and formulas, in the evaluator's order.
_MIXED = TEXT_CATEGORIES + (
    "equation_caption",
    "figure_caption",
    "figure_footnote",
    "table_caption",
    "table_footnote",
    "code_algorithm",
    "code_algorithm_caption",
    "header",
    "footer",
    "page_footnote",
    "page_number",
    FORMULA_CATEGORY,
)
_FORMULA_KINDS = (md.INLINE_FORMULA, md.FORMULA, "")


@dataclass(frozen=True)
class PageScores:
    """One page's figures, None where the page has nothing of the category to score. Edit distances:
    lower is better; TEDS: higher is better, one value per reference table averaged over the page.
    `matched_by`: QUICK_MATCH or ONE_TO_ONE, the matching that paired its text and formulas."""

    text: float | None
    formula: float | None
    table: float | None
    reading_order: float | None
    table_teds: float | None = None
    table_teds_structure: float | None = None
    matched_by: str | None = None


@dataclass(frozen=True)
class EditPair:
    """What one pair contributes to a page's edit distance."""

    reference: str
    prediction: str

    @property
    def edits(self) -> int:
        return Levenshtein.distance(self.prediction, self.reference)

    @property
    def length(self) -> int:
        return max(len(self.prediction), len(self.reference))


@dataclass(frozen=True)
class PageMatch:
    """The pairs a page is scored on, per category."""

    text: list[EditPair]
    formula: list[EditPair]
    table: list[EditPair]
    reading_order: tuple[list[float], list[float]] | None  # (reference orders, orders as written)
    matched_by: str  # QUICK_MATCH, or ONE_TO_ONE where quick_match ran out of time


def page_edit_distance(pairs: Sequence[EditPair]) -> float | None:
    """Σ edits / Σ max(len) over the pairs; None for no pairs (or nothing in any)."""
    length = sum(pair.length for pair in pairs)
    return sum(pair.edits for pair in pairs) / length if length else None


def _pair(entry: MatchedEntry) -> EditPair:
    # The evaluator scores the normalised strings, the raw ones where a normalised one is empty.
    return EditPair(entry.norm_gt or entry.gt, entry.norm_pred or entry.pred)


def _table_cells(table: str, block: md.PredictedBlock) -> list[md.PredictedBlock]:
    """A left-over predicted table as text blocks, one per cell that holds a plain string."""
    cells = BeautifulSoup(table, "html.parser").find_all("td")
    return [
        md.PredictedBlock(md.TEXT, cell.string.replace("$\\cdot$", "").strip(), block.position, block.fine)
        for cell in cells
        if cell.string
    ]


def _reading_order(entries: Sequence[MatchedEntry]) -> tuple[list[float], list[float]] | None:
    with_reference = [e for e in entries if e.gt_orders != [""]]
    written = sorted(
        (e for e in with_reference if e.pred_position is not None), key=lambda e: e.pred_position or 0
    )
    expected = sorted(o for e in with_reference for o in e.gt_orders if o)
    as_written = [o for e in written for o in e.gt_orders if o]
    return (expected, as_written) if expected or as_written else None


def match_page(
    markdown: str, reference: PageReference, time_limit_s: float | None = MATCH_TIME_LIMIT.default
) -> PageMatch:
    """The page's pairs; quick_match gets `time_limit_s` (None: no limit) before the page is matched
    one-to-one instead."""
    blocks = md.split_markdown(markdown)
    # Grouped by category, categories in the order they first occur: the order ties in position keep.
    categories = list(
        dict.fromkeys(b.category for b in blocks if b.category not in (md.HTML_TABLE, md.LATEX_TABLE))
    )
    mixed = [b for category in categories for b in blocks if b.category == category]

    table_pairs: list[EditPair] = []
    reference_tables = sorted(
        (b for b in reference.blocks if b.category == TABLE_CATEGORY), key=lambda b: b.order or 0
    )
    if reference_tables:
        gts = [b.content for b in reference_tables if b.content]
        html_tables = [b for b in blocks if b.category == md.HTML_TABLE]
        latex_count = sum(b.category == md.LATEX_TABLE for b in blocks)
        if latex_count > len(html_tables):
            html_tables = []  # LaTeX tables: scored as missing (see the module's docstring)
        pairs, left_over = simple_match(gts, [b.content for b in html_tables])
        left_over = left_over if gts else []  # predicted tables on a page without reference tables stay out
        for i, j in pairs:
            prediction = html_tables[j].content if j is not None else ""
            table_pairs.append(
                EditPair(normalize_table(gts[i]) or gts[i], normalize_table(prediction) or prediction)
            )
        for j in left_over:
            mixed += _table_cells(html_tables[j].content, html_tables[j])

    items = [
        ReferenceItem(b.category, b.content, b.order)
        for category in _MIXED
        for b in reference.blocks
        if b.category == category
    ]
    items.sort(key=lambda item: item.order or 0)
    try:
        entries, matched_by = quick_match(items, mixed, time_limit_s), QUICK_MATCH
    except OutOfTime:
        entries, matched_by = one_to_one_match(items, mixed), ONE_TO_ONE
    text_entries = [e for e in entries if e.category in TEXT_CATEGORIES]
    formula_entries = [e for e in entries if e.category == FORMULA_CATEGORY]
    text_pairs = [_pair(e) for e in text_entries]
    formula_pairs = []
    for entry in formula_entries:
        if entry.pred_kind in _FORMULA_KINDS:
            formula_pairs.append(_pair(entry))
        else:  # a formula answered by text: scored as text, its LaTeX read as Unicode
            try:
                unicode = latex_to_unicode(entry.gt)
            except Exception:  # noqa: BLE001 - pylatexenc fails on some LaTeX (an empty matrix); the
                unicode = entry.gt  # evaluator then stops altogether: here the LaTeX is scored as written

            text_pairs.append(EditPair(clean_text(unicode) or unicode, entry.norm_pred or entry.pred))
    return PageMatch(text_pairs, formula_pairs, table_pairs, _reading_order(text_entries), matched_by)


def score_page(
    markdown: str, reference: PageReference, time_limit_s: float | None = MATCH_TIME_LIMIT.default
) -> PageScores:
    """The page's scores (`time_limit_s`: quick_match's, see match_page)."""
    match = match_page(markdown, reference, time_limit_s)
    order = match.reading_order
    tables = [(pair.prediction, pair.reference) for pair in match.table]
    return PageScores(
        text=page_edit_distance(match.text),
        formula=page_edit_distance(match.formula),
        table=page_edit_distance(match.table),
        reading_order=(Levenshtein.distance(order[0], order[1]) / max(len(order[0]), len(order[1])))
        if order
        else None,
        table_teds=sum(teds(p, r) for p, r in tables) / len(tables) if tables else None,
        table_teds_structure=sum(teds(p, r, structure_only=True) for p, r in tables) / len(tables)
        if tables
        else None,
        matched_by=match.matched_by,
    )


__all__ = ["PageMatch", "PageScores", "match_page", "page_edit_distance", "score_page"]
