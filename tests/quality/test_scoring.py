"""Page scores against hand-made references, one behaviour of OmniDocBench's end-to-end evaluator
(quick_match) per test, official quirks included; tests/quality/test_official_agreement.py holds the
scorer to the evaluator's own outputs on real pages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.quality.markdown import (
    FORMULA,
    HTML_TABLE,
    INLINE_FORMULA,
    PIPE_TABLE,
    TEXT,
    split_markdown,
)
from dsocr_workers.quality.normalize import normalize_formula, normalize_table, normalize_text
from dsocr_workers.quality.omnidocbench import PageReference, ReferenceBlock
from dsocr_workers.quality.scoring import score_page


def reference(*blocks: tuple[str, str, int | None]) -> PageReference:
    return PageReference("page.png", tuple(ReferenceBlock(*block) for block in blocks))


def test_text_normalisation_reads_inline_latex_as_unicode():
    assert normalize_text("Hello, World!\n 世界 — 42%") == "HelloWorld世界42"
    assert normalize_text("a third: $\\frac{1}{3}$") == "athird13"  # pylatexenc: "1/3"
    assert normalize_text("$\\alpha$ and $x$") == "αandx"  # no command, ^ or _: delimiters only dropped
    assert normalize_text("a\\tb/nc") == "abc"  # the evaluator also drops literal escapes


def test_formula_normalisation_drops_sizing_and_display_commands():
    assert normalize_formula("\\[ \\frac{a}{b} \\tag{3} \\]") == "\\frac{a}{b}"
    assert normalize_formula("$$\\left( \\displaystyle x \\right)$$") == "(x)"


def test_markdown_is_split_as_the_evaluator_splits_it():
    blocks = split_markdown("# Title\n\n![](images/0.jpg)\nFirst $x^2$ paragraph.\n\n$$E = mc^2$$\n\n"
                            "<table><tr><td>1</td></tr></table>\n\nLast line")  # fmt: skip
    kinds = [(b.kind, b.content) for b in blocks]
    assert ("text_block", "# Title") in kinds and ("text_block", "First $x^2$ paragraph.") in kinds
    assert (FORMULA, "\\[E = mc^2\\]") in kinds
    assert (INLINE_FORMULA, "\\[x^2\\]") in kinds  # inline math: a formula candidate as well
    assert (HTML_TABLE, "<table><tr><td>1</td></tr></table>") in kinds
    assert {b.category for b in blocks} == {TEXT, FORMULA, HTML_TABLE}


def test_pipe_tables_get_colspan_and_rowspan_on_every_cell():
    blocks = split_markdown("Intro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    table = next(b for b in blocks if b.fine == PIPE_TABLE)
    assert table.content.count('colspan="1" rowspan="1"') == 4
    assert '<table border="1" >' in table.content
    # The evaluator drops every converted line that looks like a `|---|` rule: any cell with a colon.
    (table,) = [b for b in split_markdown("Intro\n\n| a | b: c |\n|---|---|\n| 1 | 2 |\n") if b.fine == PIPE_TABLE]
    assert "b: c" not in table.content and table.content.count("<td") == 3


def test_tabular_extraction_takes_one_character_past_its_end():
    # The evaluator measures `\end{tabular}` by its pattern's source, one character longer.
    (table,) = [b for b in split_markdown("\\begin{tabular}{c} x \\end{tabular}! after") if b.category != TEXT]
    assert table.content == "\\begin{tabular}{c} x \\end{tabular}!"


def test_identical_page_scores_perfectly():
    page = reference(("title", "Results", 1), ("text_block", "We measured ten pages.", 2),
                     ("equation_isolated", "\\[ a+b \\]", 3), ("table", "<table><tr><td>7</td></tr></table>", 4))  # fmt: skip
    markdown = "# Results\n\nWe measured ten pages.\n\n\\[a + b\\]\n\n<table><tr><td>7</td></tr></table>\n"
    scores = score_page(markdown, page)
    assert (scores.text, scores.formula, scores.table, scores.reading_order) == (0.0, 0.0, 0.0, 0.0)
    assert (scores.table_teds, scores.table_teds_structure) == (1.0, 1.0)


def test_one_wrong_character_in_ten():
    assert score_page("abcdefghiX", reference(("text_block", "abcdefghij", 1))).text == pytest.approx(1 / 10)


def test_a_missing_block_counts_as_wholly_deleted():
    page = reference(("text_block", "aaaa", 1), ("text_block", "bbbbbb", 2))
    scores = score_page("aaaa", page)
    assert scores.text == pytest.approx((0 + 6) / (4 + 6))
    assert scores.reading_order == pytest.approx(1 / 2)  # [1, 2] expected, [1] written


def test_predictions_matched_to_no_reference_are_not_counted():
    page = reference(("text_block", "aaaa", 1), ("text_block", "bbbb", 2))
    assert score_page("aaaa\n\nbbbb\n\nzzzzzzzz", page).text == 0.0


def test_blocks_split_differently_are_merged():
    # Three reference paragraphs written as one: quick_match gives all three the one prediction.
    page = reference(("text_block", "alpha beta gamma", 1), ("text_block", "delta epsilon zeta", 2),
                     ("text_block", "eta theta iota", 3))  # fmt: skip
    assert score_page("alpha beta gamma delta epsilon zeta eta theta iota", page).text == 0.0
    # One reference paragraph written as two: the two predictions are joined.
    assert score_page("alpha beta gamma delta\n\nepsilon zeta eta theta",
                      reference(("text_block", "alpha beta gamma delta epsilon zeta eta theta", 1))).text == 0.0  # fmt: skip


def test_blocks_are_matched_whatever_their_order():
    page = reference(("text_block", "alpha alpha", 1), ("text_block", "beta beta", 2), ("text_block", "gamma", 3))
    scores = score_page("gamma\n\nalpha alpha\n\nbeta beta", page)
    assert scores.text == 0.0
    # The reference's order [1, 2, 3] against the order the markdown wrote them, [3, 1, 2]: two edits.
    assert scores.reading_order == pytest.approx(2 / 3)


def test_page_furniture_is_matched_then_left_out():
    page = reference(("header", "Journal of Tests", 1), ("text_block", "Body text here", 2), ("page_number", "12", 3))
    assert score_page("Journal of Tests\n\nBody text here\n\n12", page).text == 0.0
    assert score_page("Body text here", page).text == 0.0


def test_a_formula_written_as_text_is_scored_as_text():
    page = reference(("text_block", "Some words here", 1), ("equation_isolated", "\\[ \\alpha + \\beta \\]", 2))
    scores = score_page("Some words here\n\nα + β", page)
    assert scores.formula is None  # the formula's only pair went to text
    assert scores.text == 0.0  # its LaTeX read as Unicode, "α+β" → "αβ", against "αβ"


def test_tables_are_compared_as_normalised_html_and_by_teds():
    wrapped = '<html><body><table border="1" ><tr><td>1</td><td>2</td></tr></table></body></html>'
    assert normalize_table('<table class="x"><thead><tr><th style="a">1</th><td>2</td></tr></thead></table>') == wrapped
    page = reference(("table", "<table><tr><td>1</td><td>2</td></tr></table>", 1))
    scores = score_page("<table><tr><th>1</th><td>3</td></tr></table>", page)
    assert scores.table == pytest.approx(1 / len(wrapped))
    assert scores.table_teds == pytest.approx(1 - 1 / 3)  # one cell's one token of three nodes
    assert scores.table_teds_structure == 1.0
    missing = score_page("no table at all", page)
    assert (missing.table, missing.table_teds) == (1.0, 0.0)  # the reference table is wholly missing
    assert score_page("<table><tr><td>1</td></tr></table>", reference(("text_block", "x", 1))).table is None


def test_a_reference_split_in_three_repeats_its_middle_part():
    from dsocr_workers.quality.omnidocbench import page_reference

    page = {"page_info": {"image_path": "p.png"}, "extra": {"relation": [
        {"relation_type": "truncated", "source_anno_id": 1, "target_anno_id": 2},
        {"relation_type": "truncated", "source_anno_id": 2, "target_anno_id": 3}]},
        "layout_dets": [{"category_type": "text_block", "anno_id": k, "order": k, "text": t}
                        for k, t in ((1, "a"), (2, "b"), (3, "c"))]}  # fmt: skip
    assert [b.content for b in page_reference(page, "test").blocks] == ["abbc"]


def test_deepseek_markup_is_scored_through_its_markdown():
    markup = ("<|ref|>title<|/ref|><|det|>[[10, 10, 500, 40]]<|/det|>\n# Results\n\n"
              "<|ref|>image<|/ref|><|det|>[[10, 50, 500, 400]]<|/det|>\n\n"
              "<|ref|>text<|/ref|><|det|>[[10, 410, 500, 480]]<|/det|>\nWe measured ten pages.")
    page = reference(("title", "Results", 1), ("text_block", "We measured ten pages.", 2))
    scores = score_page(render_mmd(markup), page)
    assert (scores.text, scores.reading_order) == (0.0, 0.0)


@settings(max_examples=200, deadline=None)
@given(markdown=st.text(alphabet=st.sampled_from(list("ab $\\[]{}|-<>/tablerd#\n_^x世")), max_size=300),
       ref_text=st.text(max_size=60))
def test_any_markdown_scores_between_zero_and_one(markdown, ref_text):
    page = reference(("text_block", ref_text, 1), ("equation_isolated", "\\[x\\]", 2),
                     ("table", "<table><tr><td>a</td></tr></table>", 3), ("header", "b", 4))  # fmt: skip
    scores = score_page(markdown, page)
    for value in (scores.text, scores.formula, scores.table, scores.reading_order,
                  scores.table_teds, scores.table_teds_structure):  # fmt: skip
        assert value is None or 0.0 <= value <= 1.0


def test_past_its_time_limit_quick_match_gives_way_to_a_one_to_one_match():
    from dsocr_workers.quality.markdown import split_markdown as split
    from dsocr_workers.quality.matching import OutOfTime, ReferenceItem, one_to_one_match, quick_match

    items = [ReferenceItem("text_block", "alpha beta gamma", 1), ReferenceItem("text_block", "delta epsilon", 2)]
    blocks = split("alpha beta\n\ngamma\n\nsomething else entirely")
    with pytest.raises(OutOfTime):
        quick_match(items, blocks, time_limit_s=0)
    entries = one_to_one_match(items, blocks)
    assert [(e.norm_gt, e.norm_pred) for e in entries] == [("alphabetagamma", "alphabeta"),
                                                          ("deltaepsilon", "somethingelseentirely")]  # fmt: skip
    # The evaluator's fallback reads prediction 0 as "none" when it looks up its position.
    assert [e.pred_position for e in entries][0] is None


SPLIT_PAGE = "alpha beta\n\ngamma\n\nsomething else entirely"  # quick_match merges its first two blocks


def test_a_page_out_of_time_is_scored_one_to_one_and_says_so():
    from dsocr_workers.quality.matching import ONE_TO_ONE, QUICK_MATCH

    page = reference(("text_block", "alpha beta gamma", 1), ("text_block", "delta epsilon", 2))
    within = score_page(SPLIT_PAGE, page)  # the evaluator's 30 s
    assert within.matched_by == QUICK_MATCH and within.text == pytest.approx(17 / 35)
    past = score_page(SPLIT_PAGE, page, time_limit_s=1e-9)
    assert past.matched_by == ONE_TO_ONE and past.text == pytest.approx(22 / 35) and past.reading_order == 0.5


def test_no_time_limit_never_falls_back():
    from dsocr_workers.quality.markdown import split_markdown as split
    from dsocr_workers.quality.matching import QUICK_MATCH, ReferenceItem, quick_match

    page = reference(("text_block", "alpha beta gamma", 1), ("text_block", "delta epsilon", 2))
    assert score_page(SPLIT_PAGE, page, time_limit_s=None).matched_by == QUICK_MATCH
    items = [ReferenceItem("text_block", "alpha beta gamma", 1), ReferenceItem("text_block", "delta epsilon", 2)]
    entries = quick_match(items, split(SPLIT_PAGE), time_limit_s=None)
    assert ("alphabetagamma", "alphabetagamma") in [(e.norm_gt, e.norm_pred) for e in entries]


def test_a_block_that_normalises_to_nothing_shifts_the_items_read_after_it():
    page = reference(("equation_isolated", "\\[a+b\\]", 1))
    assert score_page("$$a+b$$", page).formula == 0.0
    # "***" leaves the lines (nothing left of it) but not the items: the formula's line is read with
    # the item of "***", a text block, so the evaluator scores the formula as text ("a+b" against "ab").
    scores = score_page("***\n\n$$a+b$$", page)
    assert scores.formula is None and scores.text == pytest.approx(1 / 3)


def test_latex_pylatexenc_cannot_read_is_scored_as_written():
    # An array pylatexenc fails on (the evaluator stops there), matched to a text block: no exception.
    page = reference(("equation_isolated", "\\begin{array}{l} a \\\\ b \\end{array}", 0), ("text_block", "alpha $x^2$", None))
    scores = score_page("alpha beta", page)
    assert scores.text is not None and 0.0 < scores.text <= 1.0
