"""Markup → boxes, result.mmd, overlay and crops (spec §8), including malformed and truncated markup."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from dsocr_workers.model.postprocess import (
    ParsedMarkup,
    Region,
    boxes_json,
    crop_figures,
    draw_overlay,
    parse_markup,
    render_mmd,
    write_outputs,
)


def span(label: str, coords: str) -> str:
    return f"<|ref|>{label}<|/ref|><|det|>{coords}<|/det|>"


PAGE = (
    span("title", "[[100, 50, 899, 120]]")
    + "\n# Annual report\n\n"
    + span("text", "[[100, 150, 899, 400]]")
    + "\nRevenue grew.\n\n"
    + span("image", "[[100, 450, 500, 800], [520, 450, 899, 800]]")
    + "\n\n"
    + span("image_caption", "[[100, 810, 899, 840]]")
    + "\nFigure 1: growth."
)


def test_well_formed_page():
    parsed = parse_markup(PAGE, 1000, 2000)
    assert parsed.skipped_spans == 0
    assert [r.label for r in parsed.regions] == ["title", "text", "image", "image_caption"]
    title, text, image, caption = parsed.regions
    # int(v / 999 * W) per coordinate, W and H of the original
    assert title.boxes == [
        (int(100 / 999 * 1000), int(50 / 999 * 2000), int(899 / 999 * 1000), int(120 / 999 * 2000))
    ]
    assert title.boxes == [(100, 100, 899, 240)]
    assert title.text == "# Annual report"
    assert text.text == "Revenue grew."
    assert len(image.boxes) == 2 and image.text == ""
    assert caption.text == "Figure 1: growth."


def test_coordinates_at_999_reach_the_edge_and_floats_are_accepted():
    parsed = parse_markup(
        span("text", "[[0, 0, 999, 999]]") + span("text", "[[0.5, 10.9, 499.5, 999.0]]"), 640, 480
    )
    assert parsed.regions[0].boxes == [(0, 0, 640, 480)]
    assert parsed.regions[1].boxes == [
        (int(0.5 / 999 * 640), int(10.9 / 999 * 480), int(499.5 / 999 * 640), 480)
    ]


def test_out_of_range_coordinates_are_clamped_into_the_image():
    parsed = parse_markup(span("text", "[[-50, 10, 1500, 2000]]"), 100, 100)
    assert parsed.regions[0].boxes == [(0, 1, 100, 100)]


@pytest.mark.parametrize(
    "coords",
    [
        "[[1, 2, 3]]",  # arity
        "[[1, 2, 3, 4, 5]]",
        "[1, 2, 3, 4]",  # not a list of boxes
        "[]",
        "[[1, 2, 3, 4], [5, 6]]",  # one bad box spoils the span
        '[["1", 2, 3, 4]]',  # strings
        "[[true, 2, 3, 4]]",  # booleans are not coordinates
        "[[NaN, 2, 3, 4]]",
        "[[Infinity, 2, 3, 4]]",
        "[[1e400, 2, 3, 4]]",
        "[[1, 2, 3, 4]",  # bad JSON
        "[(1, 2, 3, 4)]",  # a Python literal the vendor's eval would take
        "[[__import__('os').system('false'), 2, 3, 4]]",  # never eval
        "[[" + "9" * 5000 + ", 2, 3, 4]]",  # beyond int parsing limits
        "[" * 50000 + "]" * 50000,  # deep nesting
        '{"x": 1}',
        "",
    ],
)
def test_malformed_spans_are_counted_not_raised(coords):
    text = (
        span("title", "[[1, 2, 3, 4]]")
        + "kept\n"
        + span("text", coords)
        + "after bad"
        + span("x", "[[5, 6, 7, 8]]")
        + "end"
    )
    parsed = parse_markup(text, 999, 999)
    assert parsed.skipped_spans == 1
    assert [(r.label, r.boxes, r.text) for r in parsed.regions] == [
        ("title", [(1, 2, 3, 4)], "kept"),
        ("x", [(5, 6, 7, 8)], "end"),
    ]


def test_every_truncation_of_a_span_keeps_what_came_before():
    first = span("title", "[[1, 2, 3, 4]]") + " Title text "
    second = span("text", "[[10, 20, 30, 40]]")
    for cut in range(len(second)):
        parsed = parse_markup(first + second[:cut], 999, 999)
        assert parsed.regions[0].boxes == [(1, 2, 3, 4)]
        assert len(parsed.regions) == 1
        opened = cut >= len("<|ref|>")
        assert parsed.skipped_spans == int(opened), cut
        if opened:  # the cut span is not part of the region's text
            assert parsed.regions[0].text == "Title text"
    complete = parse_markup(first + second, 999, 999)
    assert len(complete.regions) == 2 and complete.skipped_spans == 0


def test_no_markup_at_all():
    assert parse_markup("plain text, no grounding", 10, 10) == ParsedMarkup(regions=[], skipped_spans=0)
    assert parse_markup("", 10, 10) == ParsedMarkup(regions=[], skipped_spans=0)


def test_boxes_json_is_serialisable():
    parsed = parse_markup(PAGE, 1000, 2000)
    data = json.loads(json.dumps(boxes_json(parsed)))
    assert data[0] == {"label": "title", "boxes": [[100, 100, 899, 240]], "text": "# Annual report"}
    assert len(data) == 4 and len(data[2]["boxes"]) == 2


# --- property tests ------------------------------------------------------------------------------------

MARKUP_PIECES = st.sampled_from(
    [
        "<|ref|>",
        "<|/ref|>",
        "<|det|>",
        "<|/det|>",
        "[[",
        "]]",
        "[",
        "]",
        ",",
        "1",
        "999",
        "-3",
        "1e9",
        "\n",
        "image",
        " ",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.text(), st.lists(st.one_of(MARKUP_PIECES, st.text(max_size=5)), max_size=40).map("".join)
    ),
    width=st.integers(1, 10_000),
    height=st.integers(1, 10_000),
)
def test_arbitrary_text_never_raises(text, width, height):
    parsed = parse_markup(text, width, height)
    assert parsed.skipped_spans >= 0
    assert len(parsed.regions) + parsed.skipped_spans <= text.count("<|ref|>")
    for region in parsed.regions:
        for x1, y1, x2, y2 in region.boxes:
            assert min(x1, x2) >= 0 and max(x1, x2) <= width and min(y1, y2) >= 0 and max(y1, y2) <= height
    render_mmd(text)
    json.dumps(boxes_json(parsed))


PLAIN = st.text(st.characters(blacklist_characters="<"), max_size=20)  # no markup inside free text
LABELS = st.text(st.characters(blacklist_characters="<"), min_size=1, max_size=10)
BOX = st.lists(st.integers(0, 999), min_size=4, max_size=4)
BAD_COORDS = st.one_of(
    st.sampled_from(["[[1,2,3]]", "[]", "[[1,2,3,4]", "oops", "[[null,1,2,3]]", "[1,2,3,4]"]),
    st.lists(st.integers(0, 999), min_size=0, max_size=8)
    .filter(lambda v: len(v) != 4)
    .map(lambda v: json.dumps([v])),
)
SEGMENT = st.one_of(
    st.tuples(st.just(True), LABELS, st.lists(BOX, min_size=1, max_size=3).map(json.dumps), PLAIN),
    st.tuples(st.just(False), LABELS, BAD_COORDS, PLAIN),
)


@settings(max_examples=300, deadline=None)
@given(
    head=PLAIN,
    segments=st.lists(SEGMENT, max_size=8),
    tail=st.sampled_from(["", "<|ref|>", "<|ref|>text<|/ref|>", "<|ref|>text<|/ref|><|det|>[[1, 2"]),
    width=st.integers(1, 5000),
    height=st.integers(1, 5000),
)
def test_regions_and_skipped_spans_account_for_every_span(head, segments, tail, width, height):
    text = head + "".join(span(label, coords) + after for _, label, coords, after in segments) + tail
    parsed = parse_markup(text, width, height)
    good = [(label, json.loads(coords), after) for ok, label, coords, after in segments if ok]
    assert parsed.skipped_spans == sum(not ok for ok, *_ in segments) + int(bool(tail))
    assert [r.label for r in parsed.regions] == [label for label, _, _ in good]
    for region, (_, boxes, _) in zip(parsed.regions, good, strict=True):
        assert region.boxes == [
            (int(x1 / 999 * width), int(y1 / 999 * height), int(x2 / 999 * width), int(y2 / 999 * height))
            for x1, y1, x2, y2 in boxes
        ]
        for x1, y1, x2, y2 in region.boxes:
            assert 0 <= x1 <= width and 0 <= x2 <= width and 0 <= y1 <= height and 0 <= y2 <= height
    # a region's text runs to the next span, good or bad
    texts = [after.strip() for ok, _, _, after in segments if ok]
    assert [r.text for r in parsed.regions] == texts


# --- result.mmd -----------------------------------------------------------------------------------------


def test_render_mmd_replaces_figures_and_deletes_other_spans():
    mmd = render_mmd(PAGE)
    assert "<|ref|>" not in mmd and "<|det|>" not in mmd
    assert mmd == "\n# Annual report\n\n\nRevenue grew.\n\n![](images/0.jpg)\n\n\n\nFigure 1: growth."


def test_render_mmd_numbers_figure_spans_not_boxes():
    text = span("image", "[[1,1,2,2],[3,3,4,4]]") + "a" + span("image", "[[5,5,6,6]]") + "b"
    # two boxes in the first span → crops 0 and 1, but the second link still says 1 (vendor quirk)
    assert render_mmd(text) == "![](images/0.jpg)\na![](images/1.jpg)\nb"


def test_render_mmd_latex_fixes_only_with_another_span():
    latex = r"$a \coloneqq b \eqqcolon c$"
    assert render_mmd(latex) == latex
    assert render_mmd(span("image", "[[1,1,2,2]]") + latex) == "![](images/0.jpg)\n" + latex
    assert render_mmd(span("equation", "[[1,1,2,2]]") + latex) == "$a := b =: c$"


def test_render_mmd_identical_spans_are_replaced_together():
    figure = span("image", "[[1,1,2,2]]")
    # str.replace hits both copies with index 0; the second figure's own replace then finds nothing
    assert render_mmd(figure + "x" + figure) == "![](images/0.jpg)\nx![](images/0.jpg)\n"


def test_render_mmd_keeps_malformed_spans_semantics_of_the_regex():
    # the vendor's regex ignores coordinates: a span with bad coordinates is still deleted
    assert render_mmd("a" + span("text", "[[oops") + "b") == "ab"
    assert render_mmd("a<|ref|>text<|/ref|><|det|>[[1,2") == "a<|ref|>text<|/ref|><|det|>[[1,2"


# --- overlay, crops, files ------------------------------------------------------------------------------


def white(width: int = 1000, height: int = 2000) -> Image.Image:
    return Image.new("RGB", (width, height), (255, 255, 255))


def test_overlay_is_deterministic_and_leaves_the_original_alone():
    original = white()
    parsed = parse_markup(PAGE, *original.size)
    first = draw_overlay(original, parsed, seed=3)
    again = draw_overlay(original, parsed, seed=3)
    other = draw_overlay(original, parsed, seed=4)
    assert first.size == original.size and first.mode == "RGB"
    assert first.tobytes() == again.tobytes() and first.tobytes() != other.tobytes()
    assert original.getextrema() == ((255, 255), (255, 255), (255, 255))


def test_overlay_outlines_titles_thicker_with_vendor_colour_ranges():
    original = white(400, 400)
    parsed = ParsedMarkup(
        [Region("title", [(50, 50, 350, 150)], ""), Region("text", [(50, 200, 350, 300)], "")], 0
    )
    pixels = np.asarray(draw_overlay(original, parsed)).astype(int)
    column = 200  # away from the label text at the left
    title_edge = pixels[50:54, column]  # 4 px outline
    text_edge = pixels[200:202, column]  # 2 px outline
    inside_text = pixels[203, column]
    for edge in (title_edge, text_edge):
        assert (edge[:, 0] < 200).all() and (edge[:, 1] < 200).all()  # R, G drawn from [0, 200)
    assert (inside_text > 200).all() and (inside_text < 255).any()  # a light alpha-20 tint inside
    assert (pixels[5, 5] == 255).all()


def test_crop_figures_every_image_box_in_order():
    original = Image.fromarray(np.random.default_rng(0).integers(0, 256, (2000, 1000, 3), dtype=np.uint8))
    parsed = parse_markup(PAGE + span("image", "[[0, 0, 0, 0]]"), *original.size)
    crops = crop_figures(original, parsed)
    figure_boxes = parsed.regions[2].boxes
    assert figure_boxes == [(100, 900, 500, 1601), (520, 900, 899, 1601)]
    assert [c.size for c in crops] == [(400, 701), (379, 701), (1, 1)]  # a degenerate box still gives a pixel
    for crop, box in zip(crops, figure_boxes, strict=False):
        assert crop.tobytes() == original.crop(box).tobytes()


def test_write_outputs(tmp_path):
    original = white()
    parsed = parse_markup(PAGE + " <|ref|>text<|/ref|><|det|>[[1,", *original.size)
    text = PAGE + " <|ref|>text<|/ref|><|det|>[[1,"
    written = write_outputs(tmp_path / "out", text, original, parsed)
    expected = {
        "markup.txt",
        "boxes.json",
        "result.mmd",
        "result_with_boxes.jpg",
        "images/0.jpg",
        "images/1.jpg",
    }
    assert set(written) == expected
    assert all(path.is_file() for path in written.values())
    assert written["markup.txt"].read_text(encoding="utf-8") == text
    assert json.loads(written["boxes.json"].read_text(encoding="utf-8")) == boxes_json(parsed)
    assert written["result.mmd"].read_text(encoding="utf-8") == render_mmd(text)
    with Image.open(written["result_with_boxes.jpg"]) as overlay:
        assert overlay.format == "JPEG" and overlay.size == original.size
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == ["0.jpg", "1.jpg"]
    with Image.open(written["images/0.jpg"]) as crop:
        assert crop.size == (400, 701)


def test_write_outputs_without_markup(tmp_path):
    written = write_outputs(tmp_path, "just text", white(50, 50), parse_markup("just text", 50, 50))
    assert json.loads(written["boxes.json"].read_text(encoding="utf-8")) == []
    assert (tmp_path / "images").is_dir() and not any((tmp_path / "images").iterdir())
