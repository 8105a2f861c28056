"""Accuracy, stop reasons and repetition loops in `dsocr report`, for runs written through the farm's
claim → score → complete path against hand-made OmniDocBench references."""

from __future__ import annotations

import csv
import io
import json

import pytest
from fakes import Page, make_run
from sqlalchemy import select
from test_report import by, invoke, report_json

from dsocr_workers.engine.loops import RepetitionLoop
from dsocr_workers.store.models import Job, Result

REFERENCE_TEXT = "abcdefghij"  # every page reads this; a markup with k wrong letters scores k / 10


def wrong(k: int) -> str:
    return REFERENCE_TEXT[: 10 - k] + "X" * k


@pytest.fixture
def ground_truth(write_omnidocbench):
    def write(images: list[str]):
        return write_omnidocbench({image: [("text_block", REFERENCE_TEXT, 1), ("page_number", "7", 2)]
                                   for image in images})  # fmt: skip

    return write


def test_accuracy_per_mode_beside_latency_with_the_random_weights_label(database, tmp_path, make_png, ground_truth,
                                                                       monkeypatch):
    pages = {("p1.png", 0): Page(1.0, wrong(0)), ("p2.png", 0): Page(1.2, wrong(1)),
             ("p3.png", 0): Page(1.4, wrong(2)), ("p4.png", 0): Page(1.6, wrong(5))}  # fmt: skip
    run = make_run(database, tmp_path, make_png, pages, ground_truth([image for image, _ in pages]))
    document = report_json(database, ["--run", run, "--per-image"], monkeypatch)
    title = "Accuracy and latency per mode (against the ground truth; edit distances: lower is better; TEDS: higher is better)"
    rows = by(document["tables"][title], "mode", "metric")
    text = rows[("tiny", "text edit")]
    assert text["jobs"] == 4 and text["mean"] == pytest.approx((0 + 0.1 + 0.2 + 0.5) / 4)
    assert text["mean_ci_low"] < text["mean"] < text["mean_ci_high"]
    assert text["p50"] == pytest.approx(0.15)
    # Reading order: one scored block per page, written where it belongs; no formula or table on these pages.
    assert rows[("tiny", "reading order edit")]["mean"] == 0.0
    assert rows[("tiny", "formula edit")]["jobs"] == 0 and rows[("tiny", "table edit")]["jobs"] == 0
    assert rows[("tiny", "end-to-end ms")]["jobs"] == 4 and rows[("tiny", "decode ms/token")]["mean"] == pytest.approx(2.6)
    assert "RANDOM WEIGHTS" in document["notes"][title] and "accuracy" in document["notes"][title]
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert facts["ground truth"].endswith("OmniDocBench.json")
    per_image = by(document["tables"]["Per image"], "image")
    assert per_image["p4.png"]["text edit"] == 0.5 and per_image["p1.png"]["reading order edit"] == 0.0

    rows = list(csv.reader(io.StringIO(invoke(database, ["--run", run, "--format", "csv", "--table", title],
                                              monkeypatch))))  # fmt: skip
    at = rows.index([f"# {title}"])
    assert rows[at + 1][0].startswith("# note: RANDOM WEIGHTS")
    assert rows[at + 2][:4] == ["mode", "metric", "jobs", "mean"]
    markdown = invoke(database, ["--run", run, "--format", "md"], monkeypatch)
    assert f"## {title}\n\n> **RANDOM WEIGHTS" in markdown and "| tiny | text edit | 4 | 0.2 [" in markdown
    table = invoke(database, ["--run", run], monkeypatch)
    assert "text edit" in table and "Stop reasons" in table


def test_pages_quick_match_could_not_match_in_time_are_recorded_and_counted(database, tmp_path, make_png,
                                                                           ground_truth, monkeypatch):
    pages = {("exact.png", 0): Page(1.0, wrong(0)), ("off.png", 0): Page(1.0, wrong(5))}
    truth = ground_truth([image for image, _ in pages])
    within = make_run(database, tmp_path / "within", make_png, pages, truth)
    monkeypatch.setenv("DSOCR_MATCH_TIME_LIMIT", "1e-9")  # too short for any page
    past = make_run(database, tmp_path / "past", make_png, pages, truth)
    monkeypatch.setenv("DSOCR_MATCH_TIME_LIMIT", "none")
    unlimited = make_run(database, tmp_path / "unlimited", make_png, pages, truth)
    with database.transaction() as session:
        matched = {(r.run_id, j.image): r.matched_by
                   for r, j in session.execute(select(Result, Job).join(Job, Job.id == Result.job_id))}  # fmt: skip
    assert matched == {(run, image): "one_to_one" if run == past else "quick_match"
                       for run in (within, past, unlimited) for image in ("exact.png", "off.png")}  # fmt: skip
    title = "Accuracy and latency per mode (against the ground truth; edit distances: lower is better; TEDS: higher is better)"
    counted = "pages matched one-to-one (quick_match out of time)"
    for run, fallback in ((within, 0), (past, 2), (unlimited, 0)):
        rows = by(report_json(database, ["--run", run], monkeypatch)["tables"][title], "mode", "metric")
        assert rows[("tiny", counted)]["jobs"] == fallback and rows[("tiny", counted)]["mean"] is None


def test_a_run_without_ground_truth_has_no_accuracy_table(database, tmp_path, make_png, monkeypatch):
    run = make_run(database, tmp_path, make_png, {("p.png", 0): Page(1.0)})
    document = report_json(database, ["--run", run], monkeypatch)
    assert not any(title.startswith("Accuracy") for title in document["tables"])
    assert {row["field"]: row["value"] for row in document["tables"]["Run"]}["ground truth"] is None


def loop_pages() -> dict[tuple[str, int], Page]:
    budget_loop = RepetitionLoop(start=2, period=1, wasted_steps=37)
    stopped_loop = RepetitionLoop(start=4, period=2, wasted_steps=28)
    return {
        ("ok.png", 0): Page(1.0, steps=4, stop_reason="eos"),
        ("long.png", 0): Page(1.0, steps=12),
        ("looped.png", 0): Page(3.0, steps=40, loop=budget_loop),
        ("stopped.png", 0): Page(2.0, steps=33, stop_reason="repetition", loop=stopped_loop),
    }


def test_stop_reasons_and_loops_are_counted_and_kept_in_latency_unless_asked(database, tmp_path, make_png,
                                                                            monkeypatch):
    run = make_run(database, tmp_path, make_png, loop_pages())
    document = report_json(database, ["--run", run, "--per-image"], monkeypatch)
    reasons = by(document["tables"]["Stop reasons"], "stop reason")
    assert list(reasons) == ["eos", "max_new_tokens", "max_positions", "repetition"]
    assert [(r["jobs"], r["in a repetition loop"]) for r in reasons.values()] == [(1, 0), (2, 1), (0, 0), (1, 1)]
    assert reasons["max_new_tokens"]["share %"] == 50.0
    assert reasons["max_new_tokens"]["loop start step p50"] == 2 and reasons["repetition"]["loop wasted steps (sum)"] == 28
    per_image = by(document["tables"]["Per image"], "image")
    assert per_image["looped.png"]["repetition loop"] == "from step 2, period 1, 37 steps wasted"
    assert per_image["ok.png"]["repetition loop"] is None and per_image["stopped.png"]["stop / error"] == "repetition"
    latency = by(document["tables"]["Latency and output"], "metric")
    assert latency["decode ms/token"]["jobs"] == 4 and latency["decode ms/token"]["n"] == 4 + 12 + 40 + 33
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert (facts["results in a repetition loop"], facts["left out of statistics"]) == (2, 0)

    document = report_json(database, ["--run", run, "--exclude-loops"], monkeypatch)
    latency = by(document["tables"]["Latency and output"], "metric")
    assert latency["decode ms/token"]["jobs"] == 2 and latency["decode ms/token"]["n"] == 4 + 12
    assert latency["decode ms/token"]["p99"] == 2.0  # the 2x and 3x slower looping pages are out
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert facts["left out of statistics"] == 2
    assert by(document["tables"]["Stop reasons"], "stop reason")["repetition"]["jobs"] == 1  # still counted


def noisy_accuracy_pages(errors: list[int]) -> dict[tuple[str, int], Page]:
    return {(f"p{i}.png", 0): Page(1.0 + 0.05 * i, wrong(k)) for i, k in enumerate(errors)}


def test_vs_gives_paired_accuracy_differences_with_an_interval(database, tmp_path, make_png, ground_truth,
                                                              monkeypatch):
    truth = ground_truth([f"p{i}.png" for i in range(10)])
    a = make_run(database, tmp_path / "a", make_png, noisy_accuracy_pages([1, 0, 2, 1, 1, 0, 2, 1, 0, 1]), truth)
    worse = make_run(database, tmp_path / "b", make_png, noisy_accuracy_pages([3, 2, 5, 3, 2, 3, 4, 2, 3, 4]), truth)
    same = make_run(database, tmp_path / "c", make_png, noisy_accuracy_pages([0, 1, 1, 2, 1, 1, 1, 0, 1, 1]), truth)
    document = report_json(database, ["--run", a, "--vs", worse], monkeypatch)
    title = "Paired accuracy (edit distances: lower is better; TEDS: higher is better)"
    text = by(document["tables"][title], "metric")["text edit"]
    assert text["pairs"] == 10 and text["A mean"] == pytest.approx(0.09) and text["B mean"] == pytest.approx(0.31)
    assert text["B-A"] == pytest.approx(0.22) and 0 < text["B-A_ci_low"] < 0.22 < text["B-A_ci_high"]
    assert text["verdict"] == "B higher: reads worse"
    assert "RANDOM WEIGHTS" in document["notes"][title]
    reasons = by(document["tables"]["Stop reasons"], "stop reason")
    assert (reasons["max_new_tokens"]["A jobs"], reasons["max_new_tokens"]["B jobs"]) == (10, 10)

    text = by(report_json(database, ["--run", a, "--vs", same], monkeypatch)["tables"][title], "metric")["text edit"]
    assert text["B-A_ci_low"] <= 0 <= text["B-A_ci_high"] and text["verdict"] == "no significant difference"
    figures = next(rows for t, rows in document["tables"].items() if t.startswith("OmniDocBench figures"))
    text = by(figures, "page group", "metric")[("all pages", "text edit")]
    assert (text["A pages"], text["B pages"]) == (10, 10)
    assert (text["A"], text["B"]) == (pytest.approx(0.09, abs=1e-6), pytest.approx(0.31, abs=1e-6))
    per_image = report_json(database, ["--run", a, "--vs", worse, "--per-image"], monkeypatch)["tables"]["Per image"]
    assert by(per_image, "image")["p2.png"]["B text edit"] == 0.5


TABLE = "<table><tr><td>1</td><td>2</td></tr></table>"


def test_omnidocbench_figures_are_page_averages_by_page_group(database, tmp_path, make_png, write_omnidocbench,
                                                             monkeypatch):
    truth = write_omnidocbench({"p1.png": [("text_block", REFERENCE_TEXT, 1), ("table", TABLE, 2)],
                                "p2.png": [("text_block", REFERENCE_TEXT, 1)],
                                "p3.png": [("text_block", REFERENCE_TEXT, 1)]})  # fmt: skip
    pages = json.loads(truth.read_text())
    for page, source in zip(pages, ["book", "book", "newspaper"], strict=True):
        page["page_info"]["page_attribute"] = {"data_source": source, "language": "english",
                                               "special_issue": ["fuzzy_scan"]}  # fmt: skip
    truth.write_text(json.dumps(pages))
    # Two repeats a page; p1 writes its table in the first only (TEDS 1, then 0: the page's TEDS is 0.5).
    run = make_run(database, tmp_path, make_png, {
        ("p1.png", 0): Page(1.0, wrong(0) + "\n\n" + TABLE), ("p1.png", 1): Page(1.0, wrong(2)),
        ("p2.png", 0): Page(1.0, wrong(1)), ("p2.png", 1): Page(1.0, wrong(1)),
        ("p3.png", 0): Page(1.0, wrong(4)), ("p3.png", 1): Page(1.0, wrong(6)),
    }, truth)  # fmt: skip
    document = report_json(database, ["--run", run], monkeypatch)
    title = next(t for t in document["tables"] if t.startswith("OmniDocBench figures"))
    rows = by(document["tables"][title], "page group")
    assert list(rows) == ["all pages", "data_source: book", "data_source: newspaper", "language: english"]
    everything = rows["all pages"]
    assert everything["pages"] == 3 and everything["text edit"] == pytest.approx((0.1 + 0.1 + 0.5) / 3, abs=1e-6)  # (shown rounded)
    assert everything["table TEDS"] == pytest.approx(0.5) and everything["table TEDS structure"] == pytest.approx(0.5)
    assert everything["formula edit"] is None  # no page has a formula
    assert rows["data_source: book"]["text edit"] == pytest.approx(0.1) and rows["data_source: book"]["pages"] == 2
    assert rows["data_source: newspaper"]["text edit"] == pytest.approx(0.5)
    assert rows["data_source: newspaper"]["table TEDS"] is None


def test_report_figures_and_export_round_trip_with_the_official_evaluator(database, tmp_path, make_png,
                                                                          monkeypatch):
    """A run whose pages wrote OmniDocBench's demo predictions: the report's OmniDocBench figures equal
    the official evaluator's on those files (tests/quality/data/omnidocbench/official.json), and
    `dsocr export` writes exactly the files the evaluator was run on."""
    from pathlib import Path

    from dsocr_workers.report.export import export_predictions
    from tests.quality.omnidocbench_sets import DATA
    from tests.quality.omnidocbench_sets import DEMO as demo

    if not (demo / "ground_truth.json").exists():
        pytest.skip(f"OmniDocBench's demo data is not in {demo} (see tests/quality/data/omnidocbench/README.md)")
    official = json.loads((DATA / "official.json").read_text(encoding="utf-8"))["demo"]
    predictions = {p.stem: p.read_text(encoding="utf-8") for p in (demo / "predictions" / "demo").iterdir()}
    images = [page["page_info"]["image_path"] for page in json.loads((demo / "ground_truth.json").read_text())]
    run = make_run(database, tmp_path, make_png, {(image, 0): Page(1.0, predictions[Path(image).stem])
                                                  for image in images}, demo / "ground_truth.json")  # fmt: skip
    document = report_json(database, ["--run", run], monkeypatch)
    title = next(t for t in document["tables"] if t.startswith("OmniDocBench figures"))
    figures = by(document["tables"][title], "page group")["all pages"]
    overall = official["overall"]
    for label, element in [("text edit", "text_block"), ("formula edit", "display_formula"),
                           ("table edit", "table"), ("reading order edit", "reading_order")]:  # fmt: skip
        assert figures[label] == pytest.approx(overall[element]["Edit_dist"]["ALL_page_avg"], abs=1e-6), label
    page_teds = [sum(p["teds"]) / len(p["teds"]) for p in official["pages"].values() if "teds" in p]
    assert figures["table TEDS"] == pytest.approx(sum(page_teds) / len(page_teds), abs=1e-6)

    written = export_predictions(database.url, run, tmp_path / "export")
    assert written.without_result == 0
    assert {p.stem: p.read_text(encoding="utf-8") for p in written.files} == predictions
