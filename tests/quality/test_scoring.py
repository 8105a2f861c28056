"""Page scores against hand-made references: every expected value follows from the definition in
quality/scoring.py (Σ edits / Σ max lengths over matched blocks, after OmniDocBench's normalisation)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.quality.omnidocbench import PageReference, ReferenceBlock
from dsocr_workers.quality.scoring import (
    normalize_formula,
    normalize_table,
    normalize_text,
    score_page,
    split_markdown,
)


def reference(*blocks: tuple[str, str, int | None]) -> PageReference:
    return PageReference("page.png", tuple(ReferenceBlock(*block) for block in blocks))


def test_text_normalisation_keeps_letters_digits_and_cjk_only():
    assert normalize_text("Hello, World!\n 世界 — 42%") == "HelloWorld世界42"
    assert normalize_text("area $x_1^2$ and \\(y\\)") == "areax_12andy"  # inline-formula delimiters off
    assert normalize_text("a\\tb/nc") == "abc"  # OmniDocBench also drops literal escapes


def test_markdown_is_split_into_text_formulas_and_tables():
    blocks = split_markdown(
        "# Title\n\n![](images/0.jpg)\nFirst paragraph.\n\n$$E = mc^2$$\n\n"
        "<table><tr><td>1</td></tr></table>\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n$x + y$\n\nLast ---------------- line"
    )
    assert blocks.text == ["# Title", "First paragraph.", "Last ---- line"]
    assert blocks.formulas == ["$$E = mc^2$$", "$x + y$"]
    assert blocks.tables == ["<table><tr><td>1</td></tr></table>",
                             "<table><tr><td>a</td><td>b</td></tr><tr><td>1</td><td>2</td></tr></table>"]


def test_identical_page_scores_zero_everywhere():
    page = reference(("title", "Results", 1), ("text_block", "We measured ten pages.", 2),
                     ("equation_isolated", "\\[ a+b \\]", 3), ("table", "<table><tr><td>7</td></tr></table>", 4))
    markdown = "# Results\n\nWe measured ten pages.\n\n\\[a + b\\]\n\n<table><tr><td>7</td></tr></table>\n"
    assert score_page(markdown, page).__dict__ == {"text": 0.0, "formula": 0.0, "table": 0.0, "reading_order": 0.0}


def test_one_wrong_character_in_ten():
    assert score_page("abcdefghiX", reference(("text_block", "abcdefghij", 1))).text == pytest.approx(1 / 10)


def test_a_missing_block_counts_as_wholly_deleted():
    page = reference(("text_block", "aaaa", 1), ("text_block", "bbbbbb", 2))
    scores = score_page("aaaa", page)
    assert scores.text == pytest.approx((0 + 6) / (4 + 6))
    assert scores.reading_order == pytest.approx(1 / 2)  # [1, 2] expected, [1] written


def test_an_extra_block_counts_as_wholly_inserted():
    assert score_page("aaaa\n\ncccc", reference(("text_block", "aaaa", 1))).text == pytest.approx(4 / 8)


def test_blocks_are_matched_one_to_one_whatever_their_order():
    page = reference(("text_block", "alpha alpha", 1), ("text_block", "beta beta", 2), ("text_block", "gamma", 3))
    scores = score_page("gamma\n\nalpha alpha\n\nbeta beta", page)
    assert scores.text == 0.0
    # The reference's order [1, 2, 3] against the order the markdown wrote them, [3, 1, 2]: two edits.
    assert scores.reading_order == pytest.approx(2 / 3)


def test_page_furniture_is_matched_then_left_out():
    page = reference(("header", "Journal of Tests", 0), ("text_block", "Body text here", 1), ("page_number", "12", 2))
    assert score_page("Journal of Tests\n\nBody text here\n\n12", page).text == 0.0
    assert score_page("Body text here", page).text == 0.0  # nothing lost by leaving the header out
    # An unmatched prediction is still extra text: "Bodytexthere" + "Othertext" against "Bodytexthere".
    scores = score_page("Body text here\n\nOther text", reference(("text_block", "Body text here", 1)))
    assert scores.text == pytest.approx(9 / (12 + 9))


def test_formulas_are_compared_after_normalisation():
    page = reference(("equation_isolated", "\\[ \\frac{a}{b} \\tag{3} \\]", 1))
    assert normalize_formula("\\[ \\frac{a}{b} \\tag{3} \\]") == "\\frac{a}{b}"
    assert normalize_formula("$$\\mathbf{X}^{T}$$") == "{x}^{t}"
    scores = score_page("$$\\frac{a}{c}$$", page)
    assert scores.formula == pytest.approx(1 / len("\\frac{a}{b}"))
    assert scores.text is None and scores.table is None  # neither side has text, no reference table


def test_tables_are_compared_as_normalised_html():
    wrapped = '<html><body><table border="1" ><tr><td>1</td><td>2</td></tr></table></body></html>'
    assert normalize_table('<table class="x"><thead><tr><th style="a">1</th><td>2</td></tr></thead></table>') == wrapped
    page = reference(("table", "<table><tr><td>1</td><td>2</td></tr></table>", 1))
    assert score_page("<table><tr><th>1</th><td>3</td></tr></table>", page).table == pytest.approx(1 / len(wrapped))
    assert score_page("no table at all", page).table == 1.0  # the reference table is wholly missing
    assert score_page("<table><tr><td>1</td></tr></table>", reference(("text_block", "x", 1))).table is None


def test_a_page_without_reference_text_reads_every_predicted_character_as_wrong():
    assert score_page("Some text", reference(("table", "<table></table>", 1))).text == 1.0
    assert score_page("", reference(("text_block", "Some text", 1))).text == 1.0
    assert score_page("", reference()).__dict__ == dict.fromkeys(("text", "formula", "table", "reading_order"))


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
                     ("table", "<table><tr><td>a</td></tr></table>", 3), ("header", "b", 0))
    scores = score_page(markdown, page)
    for value in scores.__dict__.values():
        assert value is None or 0.0 <= value <= 1.0
