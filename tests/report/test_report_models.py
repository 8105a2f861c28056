"""`dsocr report --run A --vs B` across two models: the unlike-runs banner names the model (and its
family), the pages pair by image, and a table says per page what differs: model, visual tokens, output
tokens. The stage tables show each family's view encoder only where a run measured it."""

from __future__ import annotations

import json

from click.testing import CliRunner
from fakes import Page, make_run

from dsocr_workers.cli import main
from dsocr_workers.model.deepseek_ocr.config import PRESETS
from dsocr_workers.store.db import Database

OCR2 = "ocr2-tiny"


def report_json(database: Database, args: list[str], monkeypatch) -> dict:
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    result = CliRunner().invoke(main, ["report", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def by_metric(rows: list[dict]) -> dict[str, dict]:
    """The paired table's mean rows by their metric."""
    return {row["metric"].strip(): row for row in rows if row["statistic"] == "mean"}


def pages(steps: int, image_tokens: int, encoder: str = "clip_ms") -> dict[tuple[str, int], Page]:
    return {
        (f"p{i}.png", 0): Page(1.0 + i / 4, steps=steps + i, image_tokens=image_tokens, encoder=encoder)
        for i in range(3)
    }


def test_two_models_of_one_family_pair_by_image_and_name_the_model(database, tmp_path, make_png, monkeypatch):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(PRESETS["tiny"].to_vendor()))
    a = make_run(database, tmp_path / "a", make_png, pages(3, 273))
    b = make_run(database, tmp_path / "b", make_png, pages(5, 273), model=str(checkpoint))
    document = report_json(database, ["--run", a, "--vs", b], monkeypatch)
    assert document["unlike_runs"][0] == f"model (A tiny, B {checkpoint})"  # one family: no family entry
    rows = document["tables"]["Per page across models"]
    assert [(r["image"], r["A tokens out"], r["B tokens out"]) for r in rows] == [
        ("p0.png", 4, 6), ("p1.png", 5, 7), ("p2.png", 6, 8),
    ]
    assert {r["differs"] for r in rows} == {"model, output tokens"}


def test_one_model_has_no_per_model_table(database, tmp_path, make_png, monkeypatch):
    a = make_run(database, tmp_path / "a", make_png, pages(3, 273))
    b = make_run(database, tmp_path / "b", make_png, pages(3, 273))
    document = report_json(database, ["--run", a, "--vs", b], monkeypatch)
    assert "Per page across models" not in document["tables"] and "unlike_runs" not in document


def test_deepseek_ocr_against_deepseek_ocr2(database, tmp_path, make_png, monkeypatch):
    a = make_run(database, tmp_path / "a", make_png, pages(3, 273), mode="gundam")
    b = make_run(database, tmp_path / "b", make_png, pages(3, 545, "qwen2_ms"), model=OCR2, mode="gundam")
    document = report_json(database, ["--run", a, "--vs", b], monkeypatch)
    assert document["unlike_runs"][:2] == [
        "model family (A deepseek-ocr, B deepseek-ocr2)", f"model (A tiny, B {OCR2})",
    ]
    assert document["warnings"][0].startswith("NOT LIKE FOR LIKE: runs A and B differ in model family")
    rows = document["tables"]["Per page across models"]
    assert [(r["image"], r["A visual tokens"], r["B visual tokens"]) for r in rows] == [
        (f"p{i}.png", 273, 545) for i in range(3)
    ]
    assert {r["differs"] for r in rows} == {"model, visual tokens"}
    # Each family's view encoder where a run measured it: both rows in the paired table, each on one side.
    paired = by_metric(document["tables"]["Paired latency"])
    assert (paired["CLIP ms"]["B"], paired["CLIP ms"]["verdict"]) == (None, "one model's stage (unlike runs)")
    assert paired["Qwen2 encoder ms"]["A"] is None and paired["Qwen2 encoder ms"]["B"] > 0
    assert {"CLIP", "Qwen2 encoder"} <= set(document["terms"])
    single = report_json(database, ["--run", b], monkeypatch)
    assert "Qwen2 encoder ms" in {r["metric"].strip() for r in single["tables"]["Latency and output"]}
    assert "CLIP ms" not in {r["metric"].strip() for r in single["tables"]["Latency and output"]}
    assert "Qwen2 encoder" in single["terms"] and "CLIP" not in single["terms"]  # the legend: its stages
