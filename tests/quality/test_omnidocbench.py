"""Reading OmniDocBench annotation files (hand-made, in its JSON layout) and naming predictions."""

from __future__ import annotations

import json
import re

import pytest

from dsocr_workers.errors import InputError
from dsocr_workers.quality.omnidocbench import (
    PageReference,
    ReferenceBlock,
    load_annotation,
    prediction_filename,
    reference_for,
    write_predictions,
)
from dsocr_workers.quality.scoring import score_page


def test_pages_by_image_name_with_their_scored_blocks(write_omnidocbench):
    path = write_omnidocbench({
        "images/slide_1.png": [("title", "Limits", 1), ("figure", "", None), ("text_block", "A limit is", 2),
                               ("equation_isolated", "\\[ \\lim x \\]", 3), ("page_number", "15", 4)],
        "paper.pdf_3.jpg": [("table", "<table><tr><td>1</td></tr></table>", 1)],
    })  # fmt: skip
    pages = load_annotation(path)
    assert set(pages) == {"slide_1.png", "paper.pdf_3.jpg"}
    # The figure has nothing to read: it is left out.
    assert pages["slide_1.png"].blocks == (
        ReferenceBlock("title", "Limits", 1), ReferenceBlock("text_block", "A limit is", 2),
        ReferenceBlock("equation_isolated", "\\[ \\lim x \\]", 3), ReferenceBlock("page_number", "15", 4),
    )  # fmt: skip
    assert reference_for(pages, "images/slide_1.png") is pages["slide_1.png"]
    assert reference_for(pages, "other/slide_1.png") is pages["slide_1.png"]  # matched by file name
    assert reference_for(pages, "missing.png") is None
    stored = pages["slide_1.png"].to_json()
    assert PageReference.from_json(json.loads(json.dumps(stored))) == pages["slide_1.png"]


def test_truncated_blocks_are_joined_in_reading_order(write_omnidocbench):
    path = write_omnidocbench(
        {"p.png": [("text_block", "continues here.", 3), ("title", "T", 1), ("text_block", "A sentence that ", 2),
                   ("text_block", "Other", 4)]},
        truncated={"p.png": [(2, 0)]},
    )  # fmt: skip
    page = load_annotation(path)["p.png"]
    # Joined parts go after every other block, as the evaluator appends them to their category's list.
    assert [(b.category, b.content, b.order) for b in page.blocks] == [
        ("title", "T", 1), ("text_block", "Other", 4), ("text_block", "A sentence that continues here.", 2),
    ]  # fmt: skip
    assert score_page("# T\n\nA sentence that continues here.\n\nOther", page).text == 0.0


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON (line 1, column 2"),
    ('{"pages": []}', "a JSON list of pages"),
    ('[{"layout_dets": []}]', "page 0: no page_info.image_path"),
    ('[{"page_info": {"image_path": "a.png"}, "layout_dets": {}}]', "page 0 (a.png): layout_dets is not a list"),
    ('[{"page_info": {"image_path": "a.png"}, "layout_dets": [{"text": "x"}]}]', "layout_dets[0] has no category_type"),
    ('[{"page_info": {"image_path": "a.png"}, "layout_dets": [{"category_type": "title", "text": 3}]}]',
     "layout_dets[0].text is not a string"),
    ('[{"page_info": {"image_path": "a.png"}, "layout_dets": []}, '
     '{"page_info": {"image_path": "x/a.png"}, "layout_dets": []}]', "a.png is annotated twice (pages 0 and 1)"),
])  # fmt: skip
def test_malformed_files_are_one_line_input_errors(tmp_path, content, message):
    path = tmp_path / "gt.json"
    path.write_text(content)
    with pytest.raises(InputError, match=re.escape(message)) as raised:
        load_annotation(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such ground-truth file"):
        load_annotation(tmp_path / "nope.json")


def test_predictions_are_named_as_the_evaluator_reads_them(tmp_path):
    assert prediction_filename("images/docstructbench_x.pdf_3.jpg") == "docstructbench_x.pdf_3.md"
    written = write_predictions({"images/a.png": "# A\n", "b.jpg": "B"}, tmp_path / "preds")
    assert sorted(p.name for p in written) == ["a.md", "b.md"]
    assert (tmp_path / "preds" / "a.md").read_text() == "# A\n"
    with pytest.raises(InputError, match="a.png and other/a.jpg would both be written to a.md"):
        write_predictions({"a.png": "1", "other/a.jpg": "2"}, tmp_path / "clash")
    assert not (tmp_path / "clash").exists()  # refused before anything was written


def test_a_relation_with_a_malformed_id_links_nothing(tmp_path):
    page = {"page_info": {"image_path": "p.png"},
            "layout_dets": [{"category_type": "text_block", "anno_id": 0, "order": 1, "text": "a"},
                            {"category_type": "text_block", "anno_id": 1, "order": 2, "text": "b"}],
            "extra": {"relation": [{"source_anno_id": [0], "target_anno_id": 1, "relation_type": "truncated"}]}}
    path = tmp_path / "gt.json"
    path.write_text(json.dumps([page]))
    assert [b.content for b in load_annotation(path)["p.png"].blocks] == ["a", "b"]
