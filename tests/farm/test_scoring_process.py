"""A worker child scores a job against its reference in a process of its own (farm/job/scoring_process.py):
the same columns as scoring in the child, no process for a job without a reference, one process for
every page, started again after it dies, and a scorer's error raised in the caller with the process
kept. The scorer and the process are the real ones."""

from __future__ import annotations

import pytest

from dsocr_workers.farm.job.columns import NO_ACCURACY, accuracy_columns
from dsocr_workers.farm.job.scoring_process import ScoringProcess

REFERENCE = {
    "image": "p1.png",
    "blocks": [["title", "Quarterly report", 1], ["text_block", "Revenue grew by ten percent.", 2],
               ["equation_isolated", "\\[x=1\\]", 3]],  # fmt: skip
    "attributes": {"language": "english"},
}
MARKUP = (
    "<|ref|>title<|/ref|><|det|>[[10, 10, 500, 60]]<|/det|>\n# Quarterly report\n\n"
    "<|ref|>text<|/ref|><|det|>[[10, 80, 900, 140]]<|/det|>\nRevenue grew by 10 percent.\n\n"
    "<|ref|>equation<|/ref|><|det|>[[10, 160, 400, 220]]<|/det|>\n\\[x = 1\\]\n"
)


@pytest.fixture
def scoring():
    process = ScoringProcess()
    yield process
    process.close()


def test_pages_are_scored_in_one_process_as_in_the_child(scoring):
    assert scoring(MARKUP, None) == NO_ACCURACY and scoring.started == 0  # no reference, no process
    expected = accuracy_columns(MARKUP, REFERENCE)
    assert expected["text_edit"] is not None and expected["formula_edit"] is not None
    assert scoring(MARKUP, REFERENCE) == expected
    assert scoring("# Quarterly report\n", REFERENCE) == accuracy_columns("# Quarterly report\n", REFERENCE)
    assert scoring.started == 1


def test_a_process_that_died_is_started_again_for_the_next_page(scoring):
    first = scoring(MARKUP, REFERENCE)
    assert scoring._process is not None
    scoring._process.kill()
    scoring._process.wait()
    assert scoring(MARKUP, REFERENCE) == first
    assert scoring.started == 2


def test_a_scorers_error_reaches_the_caller_and_the_process_stays(scoring):
    scoring(MARKUP, REFERENCE)
    with pytest.raises(KeyError):  # a reference without blocks: what accuracy_columns raises in the child
        scoring(MARKUP, {"image": "p1.png"})
    assert scoring(MARKUP, REFERENCE)["text_edit"] is not None
    assert scoring.started == 1
