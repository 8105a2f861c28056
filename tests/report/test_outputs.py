"""Where a report goes (report/outputs.py `write_report`) and a run's predictions for OmniDocBench's
evaluator (report/export.py), called directly; `dsocr report` and `dsocr export` are tested through the
command line in test_report.py and tests/farm/test_ground_truth.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fakes import Page, make_run

from dsocr_workers.cli import main
from dsocr_workers.errors import InputError
from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.report.export import export_predictions
from dsocr_workers.report.outputs import ReportRequest, write_report


def test_export_writes_each_page_with_a_result_and_counts_the_rest(database, tmp_path, make_png):
    pages = {("p1.png", 0): Page(markup="first"), ("p2.png", 0): None, ("sub/p3.png", 0): Page(markup="third"),
             ("p1.png", 1): Page(markup="again"), ("p2.png", 1): Page(), ("sub/p3.png", 1): Page()}  # fmt: skip
    run = make_run(database, tmp_path, make_png, pages)
    out = tmp_path / "predictions"
    export = export_predictions(database.url, run[:8], out)
    assert (export.run_id, export.without_result) == (run, 1)  # p2.png's repeat 0 failed
    assert sorted(path.name for path in export.files) == ["p1.md", "p3.md"]
    assert (out / "p1.md").read_text() == render_mmd("first") and (out / "p3.md").read_text() == render_mmd("third")
    assert export_predictions(database.url, run, tmp_path / "second", repeat=1).without_result == 0
    # A preset's pages are filler: the folder says so beside them, and the command says so too.
    assert export.random_note == out / "RANDOM_WEIGHTS.txt" and "RANDOM WEIGHTS" in export.random_note.read_text()
    said = CliRunner().invoke(main, ["export", "--run", run, "--omnidocbench", str(tmp_path / "third")],
                              env={"DSOCR_DATABASE_URL": database.url})
    assert said.exit_code == 0 and "ran with RANDOM WEIGHTS" in said.output, said.output
    with pytest.raises(InputError, match=f"run {run} has no repeat 2"):
        export_predictions(database.url, run, tmp_path / "none", repeat=2)


def test_write_report_returns_text_or_tells_each_file_it_wrote(database, tmp_path, make_png):
    run = make_run(database, tmp_path, make_png, {("p1.png", 0): Page(), ("p2.png", 0): Page(2.0)})
    written: list = []
    text = write_report(database.url, ReportRequest(run, fmt="json"), written.append)
    assert text is not None and json.loads(text)["tables"]["Run"] and written == []
    folder = tmp_path / "csv"
    assert write_report(database.url, ReportRequest(run, fmt="csv", out=folder), written.append) is None
    assert set(written) == set(folder.iterdir()) and len(written) > 1  # one file per table
    one = tmp_path / "latency.md"
    assert write_report(database.url, ReportRequest("latest", fmt="md", table="latency and output", out=one),
                        written.append) is None  # fmt: skip
    assert written[-1] == one and one.read_text().count("\n## ") == 1 and "## Latency and output" in one.read_text()
    with pytest.raises(InputError, match="--table 'nope'"):
        write_report(database.url, ReportRequest(run, table="nope"))
