"""Ground truth through the farm: `--ground-truth` at submit, scores stored per job by the worker,
`dsocr report` and `dsocr export --omnidocbench` over a real run of the tiny preset on SQLite, and of
DeepSeek-OCR-2's ocr2-tiny on OmniDocBench's demo pages against their ground truth."""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import func, select
from test_workers import dsocr

from dsocr_workers.cli import main
from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.quality.omnidocbench import PageReference, prediction_filename
from dsocr_workers.quality.scoring import score_page
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Result, Run
from tests.quality.omnidocbench_sets import DEMO

TEXT = [("title", "Quarterly report", 1), ("text_block", "Revenue grew by ten percent.", 2),
        ("page_number", "3", 3)]  # fmt: skip


@pytest.fixture
def listed(tmp_path, make_png):
    folder = tmp_path / "pages"
    for name, size in (("p1.png", (320, 420)), ("p2.png", (640, 480))):
        make_png(name, size, folder=folder)
    listing = folder / "pages.txt"
    listing.write_text("p1.png\np2.png\n")
    return listing


def test_dsocr_run_scores_pages_reports_accuracy_and_exports_for_the_evaluator(
    listed, tmp_path, write_omnidocbench, subprocess_env
):
    truth = write_omnidocbench({"images/p1.png": TEXT, "p2.png": [*TEXT, ("equation_isolated", "\\[x=1\\]", 4)]})
    url = f"sqlite:///{tmp_path / 'embedded.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    done = dsocr("run", str(listed), "--ground-truth", str(truth), "--max-new-tokens", "24", "--mode", "tiny",
                 "--stop-on-repetition", "--no-repeat-ngram-size", "0", "--format", "json", env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    accuracy = next(rows for title, rows in document["tables"].items() if title.startswith("Accuracy"))
    rows = {row["metric"]: row for row in accuracy}
    assert rows["text edit"]["jobs"] == 2 and 0 < rows["text edit"]["mean"] <= 1  # random weights read noise
    assert rows["formula edit"]["jobs"] == 1 and rows["end-to-end ms"]["jobs"] == 2
    assert any("RANDOM WEIGHTS" in note for note in document["notes"].values())
    reasons = {row["stop reason"]: row["jobs"] for row in document["tables"]["Stop reasons"]}
    assert sum(reasons.values()) == 2 and reasons["eos"] + reasons["max_new_tokens"] + reasons["repetition"] == 2

    db = open_database(url)
    with db.transaction() as session:
        run = session.scalars(select(Run)).one()
        pairs = session.execute(select(Job, Result).join(Result, Result.job_id == Job.id)).all()
    db.dispose()
    assert run.ground_truth == str(truth) and run.parameters["stop_on_repetition"] is True
    assert run.parameters["no_repeat_ngram_size"] == 0
    for job, result in pairs:  # what the worker stored is the score of what the model wrote
        scores = score_page(render_mmd(result.markup), PageReference.from_json(job.reference))
        assert (result.text_edit, result.formula_edit, result.table_edit, result.reading_order_edit) == (
            scores.text, scores.formula, scores.table, scores.reading_order)

    out = tmp_path / "predictions"
    exported = dsocr("export", "--run", run.id, "--omnidocbench", str(out), env=env, timeout=60)
    assert exported.returncode == 0, exported.stderr
    # The pages, and beside them the note that a preset's pages are filler (random weights).
    assert sorted(p.name for p in out.iterdir()) == ["RANDOM_WEIGHTS.txt", "p1.md", "p2.md"]
    markup = {job.image: result.markup for job, result in pairs}
    assert (out / "p2.md").read_text(encoding="utf-8") == render_mmd(markup["p2.png"])
    markdown = dsocr("report", "--run", run.id, "--format", "md", "--per-image", env=env, timeout=60).stdout
    assert "| tiny | text edit | 2 |" in markdown and "## Stop reasons" in markdown
    assert dsocr("export", "--run", run.id, "--omnidocbench", str(out), "--repeat", "1", env=env,
                 timeout=60).returncode == 2  # fmt: skip


# Two of OmniDocBench's demo pages, small ones: a note with a table, a newspaper page of text.
DEMO_PAGES = (
    "notes_1ba14cb325bc448f7201b20502ecf2b5_15.jpg",
    "newspaper_5e266dfd9c498cab274e12a7b4a75755_4.jpg",
)


@pytest.mark.skipif(
    not (DEMO / "ground_truth.json").exists(),
    reason=f"OmniDocBench's demo data is not in {DEMO} (tests/quality/data/omnidocbench/README.md)",
)
def test_deepseek_ocr2_is_scored_against_the_demo_ground_truth_and_exported(tmp_path):
    """DeepSeek-OCR-2 (ocr2-tiny) through `dsocr run --ground-truth` on OmniDocBench's demo pages: each
    page scored as the evaluator scores it, the report's accuracy tables, `dsocr export --omnidocbench`.
    In this process (the v1 test above runs the commands as subprocesses): their imports cost more than
    the model."""
    listing = tmp_path / "demo.txt"
    listing.write_text("\n".join(DEMO_PAGES) + "\n")
    url = f"sqlite:///{tmp_path / 'embedded.db'}"
    done = CliRunner().invoke(main, [
        "run", str(listing), "--root", str(DEMO / "images"), "--ground-truth", str(DEMO / "ground_truth.json"),
        "--model", "ocr2-tiny", "--mode", "small", "--max-new-tokens", "12", "--gpus", "cpu", "--format", "json",
    ], env={"DSOCR_DATABASE_URL": url})  # fmt: skip
    assert done.exit_code == 0, done.output
    tables = json.loads(done.stdout)["tables"]
    # Its view encoder's row, not CLIP's (NULL in its rows: not measured).
    encoders = {row["metric"].strip(): row["n"] for row in tables["Latency and output"]
                if "CLIP" in row["metric"] or "Qwen2" in row["metric"]}  # fmt: skip
    assert encoders == {"Qwen2 encoder ms": 2}
    accuracy = {row["metric"]: row for row in next(rows for t, rows in tables.items() if t.startswith("Accuracy"))}
    assert accuracy["text edit"]["jobs"] == 2 and 0 < accuracy["text edit"]["mean"] <= 1
    assert accuracy["table edit"]["jobs"] == 1  # the note's table
    figures = next(rows for t, rows in tables.items() if t.startswith("OmniDocBench figures"))
    assert {row["page group"]: row["pages"] for row in figures}["all pages"] == 2

    db = open_database(url)
    with db.transaction() as session:
        run = session.scalars(select(Run)).one()
        pairs = session.execute(select(Job, Result).join(Result, Result.job_id == Job.id)).all()
    db.dispose()
    assert run.model_family == "deepseek-ocr2" and len(pairs) == 2
    for job, result in pairs:  # what the run stored is the score of what the model wrote
        scores = score_page(render_mmd(result.markup), PageReference.from_json(job.reference))
        assert (result.text_edit, result.formula_edit, result.table_edit, result.reading_order_edit) == (
            scores.text, scores.formula, scores.table, scores.reading_order)
        assert result.image_tokens == 145 and result.qwen2_ms > 0 and result.clip_ms is None

    out = tmp_path / "predictions"
    exported = CliRunner().invoke(main, ["export", "--run", run.id, "--omnidocbench", str(out)],
                                  env={"DSOCR_DATABASE_URL": url})  # fmt: skip
    assert exported.exit_code == 0, exported.output
    markup = {job.image: result.markup for job, result in pairs}
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["RANDOM_WEIGHTS.txt", *(prediction_filename(image) for image in DEMO_PAGES)])
    for image in DEMO_PAGES:
        assert (out / prediction_filename(image)).read_text(encoding="utf-8") == render_mmd(markup[image])


def submit(args: list[str], env: dict[str, str], monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return CliRunner().invoke(main, ["submit", *args])


def count_runs(url: str) -> int:
    db = open_database(url)
    with db.transaction() as session:
        n = session.scalar(select(func.count()).select_from(Run)) or 0
    db.dispose()
    return n


@pytest.mark.redis
def test_pages_missing_from_the_ground_truth_are_bad_lines(listed, write_omnidocbench, sqlite_url, broker_env,
                                                          monkeypatch):
    truth = write_omnidocbench({"p1.png": TEXT})
    env = {**broker_env, "DSOCR_DATABASE_URL": sqlite_url}
    refused = submit([str(listed), "--ground-truth", str(truth)], env, monkeypatch)
    assert refused.exit_code == 2, refused.output
    assert f"pages.txt:2: p2.png: not in the ground truth {truth}" in refused.output
    assert "nothing was recorded or enqueued" in refused.output and count_runs(sqlite_url) == 0

    kept = submit([str(listed), "--ground-truth", str(truth), "--skip-invalid"], env, monkeypatch)
    assert kept.exit_code == 0, kept.output
    db = open_database(sqlite_url)
    with db.transaction() as session:
        jobs = session.scalars(select(Job)).all()
    db.dispose()
    assert [(j.image, PageReference.from_json(j.reference).image) for j in jobs] == [("p1.png", "p1.png")]
    redis.Redis.from_url(broker_env["DSOCR_BROKER_URL"]).delete(broker_env["DSOCR_BROKER_KEY_PREFIX"] + "dsocr")


@pytest.mark.parametrize(("content", "message"), [
    ("[{", "the ground truth is not JSON (line 1, column 3"),
    ('[{"page_info": {}, "layout_dets": []}]', "page 0: no page_info.image_path"),
])  # fmt: skip
def test_a_malformed_ground_truth_is_one_line_and_records_nothing(listed, tmp_path, sqlite_url, content, message,
                                                                 monkeypatch):
    truth = tmp_path / "gt.json"
    truth.write_text(content)
    refused = submit([str(listed), "--ground-truth", str(truth)], {"DSOCR_DATABASE_URL": sqlite_url}, monkeypatch)
    assert refused.exit_code == 2
    lines = refused.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {truth}: {message}")
    assert count_runs(sqlite_url) == 0
