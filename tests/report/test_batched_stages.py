"""A batched run's rows measure its pages' prefill and vision and hold NULL for the stages the batch does
not time per page (engine/session.py `BatchFigures`): the report shows those it measured, with their
values, and no row or bar of 0 ms for the others; against a batch-1 run, a stage only it measured is
shown on its side without a ratio."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fakes import Page, fake_result, make_run

from dsocr_workers.cli import main
from dsocr_workers.report.plots import GAPS, stage_ms
from dsocr_workers.report.queries import load_run
from dsocr_workers.stages import breakdown_bars, unmeasured
from dsocr_workers.store.db import Database

BATCHED = Page(scale=1.5, steps=3, batched=True)
UNTIMED = ("SAM", "CLIP", "Qwen2 encoder", "projector", "LM prefill", "setup", "first token", "decode",
           "wasted decode", "readback")  # fmt: skip


def report_json(database: Database, args: list[str], monkeypatch) -> dict:
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    result = CliRunner().invoke(main, ["report", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def labels(rows: list[dict], key: str) -> dict[str, dict]:
    return {row[key].strip().removesuffix(" ms"): row for row in rows}


def test_a_batched_run_s_report_shows_its_prefill_and_vision_and_no_0_ms_stages(
    database, tmp_path, make_png, monkeypatch
):  # fmt: skip
    run = make_run(database, tmp_path, make_png, {("p.png", r): BATCHED for r in range(2)}, concurrency=3)
    expected = fake_result(BATCHED).timings
    tables = report_json(database, ["--run", run, "--per-image"], monkeypatch)["tables"]
    latency = labels(tables["Latency and output"], "metric")
    assert expected.prefill_ms > expected.vision_ms > 0
    assert latency["prefill"]["mean"] == pytest.approx(expected.prefill_ms)
    assert latency["vision"]["mean"] == pytest.approx(expected.vision_ms)
    assert "decode ms/token" in latency and not set(UNTIMED) & set(latency)
    accounting = labels(tables["Accounting: parts of end-to-end"], "part")
    assert list(accounting) == [
        "preprocess",
        "prefill",
        "postprocess",
        "host gap",
        "sum of parts",
        "end-to-end",
    ]
    assert accounting["sum of parts"]["mean ms"] == pytest.approx(accounting["end-to-end"]["mean ms"])
    assert "SAM ms" not in tables["Per image"][0] and tables["Per image"][0]["prefill ms"] > 0
    with database.transaction() as session:
        results = list(load_run(session, run).results.values())
    bars = breakdown_bars(unmeasured(results))
    assert list(bars) == ["preprocess", "prefill", "postprocess"]  # its prefill a bar of its own
    drawn = stage_ms(results[0], bars)
    assert drawn["prefill"] == pytest.approx(expected.prefill_ms)
    assert sum(drawn.values()) == pytest.approx(expected.e2e_ms) and drawn[GAPS] > 0


def test_a_stage_only_the_batch_1_run_measured_has_no_ratio(database, tmp_path, make_png, monkeypatch):
    alone = make_run(database, tmp_path / "a", make_png, {("p.png", 0): Page(scale=1.5, steps=3)})
    batched = make_run(database, tmp_path / "b", make_png, {("p.png", 0): BATCHED}, concurrency=3)
    page = tmp_path / "vs.html"  # the stage breakdown draws each side's own bars
    document = report_json(database, ["--run", alone, "--vs", batched, "--html", str(page)], monkeypatch)
    assert page.read_text().count("<img") >= 1
    rows = document["tables"]["Paired latency"]
    paired = {row["metric"].strip(): row for row in rows if row["statistic"] == "mean"}
    assert paired["SAM ms"]["B"] is None and paired["SAM ms"]["verdict"].startswith("measured by one run")
    assert paired["SAM ms"]["A"] > 0 and paired["prefill ms"]["B/A"] == pytest.approx(1.0)
