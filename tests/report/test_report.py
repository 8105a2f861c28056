"""Reports over runs written through the farm's own claim → complete path, with given inference results."""

from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner

from dsocr_workers.cli import main
from dsocr_workers.engine.result import InferenceResult, ModelSource, StageTimings
from dsocr_workers.errors import InputError
from dsocr_workers.farm.execute import Ran, execute_job
from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.fingerprint import environment_fingerprint
from dsocr_workers.farm.submit import RunOptions, record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Worker
from dsocr_workers.store.upsert import upsert

SOURCE = ModelSource(kind="preset", name="tiny", random_weights=True, seed=0)


def fake_result(scale: float, markup: str, boxes: int, steps: int = 4) -> InferenceResult:
    timings = StageTimings(
        clock="perf_counter", preprocess_ms=1 * scale, prefill_ms=10 * scale, vision_ms=6 * scale, sam_ms=3 * scale,
        clip_ms=2 * scale, projector_ms=1 * scale, lm_prefill_ms=4 * scale, decode_ms=steps * 2 * scale,
        decode_step_ms=[2 * scale] * steps, ttft_ms=12 * scale, e2e_ms=(12 + steps * 2) * scale,
    )  # fmt: skip
    return InferenceResult(
        text=markup, token_ids=list(range(steps + 1)), stop_reason="max_new_tokens", prompt_tokens=20,
        image_tokens=16, crop_grid=(1, 1), mode="tiny", image_size=(320, 420), timings=timings,
        boxes=[{"label": "text", "box": [0, 0, 1, 1]}] * boxes, skipped_spans=0, memory=None,
        engine="eager", device="cpu", dtype="float32", model=SOURCE, kv_length=25, vision_calls=1,
    )  # fmt: skip


def make_run(db: Database, tmp_path, make_png, outputs: dict[str, tuple[float, str, int] | None]) -> str:
    """A run over one page per key; None makes that page fail as an input error."""
    for name in outputs:
        make_png(name, folder=tmp_path / "pages")
    listing = tmp_path / "pages" / "list.txt"
    listing.write_text("\n".join(outputs) + "\n")
    run = record_run(db, read_filelist(listing), RunOptions(mode="tiny"), queue="q")
    worker = environment_fingerprint("cpu", SOURCE)
    with db.transaction() as session:
        upsert(session, Worker, worker, ["id"])

    def infer(claim):
        spec = outputs[claim.image]
        if spec is None:
            raise InputError("corrupt page")
        return Ran(fake_result(*spec), worker["id"])

    settings = Settings(max_attempts=2)
    for job_id in run.job_ids:
        assert execute_job(db, job_id, owner="test:1:x", settings=settings, infer=infer).status in (
            "done",
            "failed",
        )
    return run.run_id


@pytest.fixture
def two_runs(database, tmp_path, make_png):
    a = make_run(
        database,
        tmp_path / "a",
        make_png,
        {"p1.png": (1.0, "same", 2), "p2.png": (1.0, "x", 3), "p3.png": None},
    )
    b = make_run(
        database,
        tmp_path / "b",
        make_png,
        {"p1.png": (2.0, "same", 2), "p2.png": (2.0, "y", 1), "p4.png": (2.0, "z", 0)},
    )
    return database, a, b


def invoke(database: Database, args: list[str], monkeypatch) -> str:
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    result = CliRunner().invoke(main, ["report", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_single_run_counts_percentiles_and_label(two_runs, monkeypatch):
    database, a, _ = two_runs
    document = json.loads(invoke(database, ["--run", a, "--format", "json", "--per-image"], monkeypatch))
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert (facts["jobs"], facts["ok"], facts["failed"], facts["results"]) == (3, 2, 1, 2)
    assert facts["pages/s"] > 0
    assert any("RANDOM WEIGHTS" in w for w in document["warnings"])
    latency = {row["metric"]: row for row in document["tables"]["Latency and output"]}
    assert latency["TTFT ms"]["n"] == 2 and latency["TTFT ms"]["p50"] == 12.0
    assert latency["decode ms/token"]["n"] == 8 and latency["decode ms/token"]["p99"] == 2.0
    assert latency["boxes per page"]["mean"] == 2.5
    assert [row["jobs"] for row in document["tables"]["By worker"]] == [2]
    assert document["tables"]["Environment"][0]["model"] == SOURCE.label
    failures = document["tables"]["Failures"]
    assert [(f["image"], f["state"], f["attempts"], f["error"]) for f in failures] == [
        ("p3.png", "failed", 1, "InputError")
    ]
    assert len(document["tables"]["Per image"]) == 3


def test_vs_pairs_images_in_both_runs(two_runs, monkeypatch):
    database, a, b = two_runs
    document = json.loads(
        invoke(database, ["--run", a, "--vs", b, "--format", "json", "--per-image"], monkeypatch)
    )
    (paired,) = [t for t in document["tables"] if t.startswith("Paired latency")]
    assert "(2 images" in paired
    rows = {row["metric"]: row for row in document["tables"][paired]}
    assert rows["end-to-end ms"]["B/A p50"] == 2.0 and rows["TTFT ms"]["B/A p99"] == 2.0
    agreement = {row["measure"]: row["value"] for row in document["tables"]["Output agreement"]}
    assert agreement["paired images"] == 2 and agreement["only in A"] == 0 and agreement["only in B"] == 1
    assert agreement["identical markup %"] == 50.0
    assert (
        agreement["box count delta B-A (mean)"] == -1.0
        and agreement["images with a different box count"] == 1
    )
    assert [r["image"] for r in document["tables"]["Per image"]] == ["p1.png", "p2.png"]


def test_formats_table_csv_markdown_and_out_file(two_runs, monkeypatch, tmp_path):
    database, a, b = two_runs
    table = invoke(database, ["--run", a[:6], "--vs", b], monkeypatch)
    assert "WARNING" in table and "Output agreement" in table and "B/A p50" in table
    rows = list(csv.reader(io.StringIO(invoke(database, ["--run", a, "--format", "csv"], monkeypatch))))
    assert ["# Latency and output"] in rows and ["metric", "n", "mean", "p50", "p90", "p99"] in rows
    out = tmp_path / "report.md"
    invoke(database, ["--run", "latest", "--format", "md", "--out", str(out)], monkeypatch)
    markdown = out.read_text()
    assert (
        markdown.startswith(f"# dsocr report: run {b}")
        and "| metric | n | mean | p50 | p90 | p99 |" in markdown
    )


def test_unknown_run_is_an_input_error(database, monkeypatch):
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    result = CliRunner().invoke(main, ["report", "--run", "nope"])
    assert result.exit_code == 2 and "no run 'nope'" in result.output
