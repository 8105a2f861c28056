"""`dsocr report` as text where its output is redirected or the terminal is narrow: tables as wide as
their content (not a fixed 160 columns), a number and its interval on one line, headers broken only
between words, a worker's warm-up in one line (its shapes counted, not listed), and a legend of the
terms the tables use."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta

import pytest
from fakes import Page, add_session, make_run, set_times

from dsocr_workers.report.build import glossary, single_report
from dsocr_workers.report.queries import load_run
from dsocr_workers.report.render import cell_text
from dsocr_workers.report.stats import Estimate
from dsocr_workers.store.models import WorkerSession

T0 = datetime(2026, 11, 26, 8, 0, 0)
GRIDS = [f"gundam:{c}x{r}" for c in range(1, 6) for r in range(1, 6)]  # 25 crop grids, as a gundam warm-up


@pytest.fixture
def run_on_a_warmed_worker(database, tmp_path, make_png) -> str:
    add_session(database, "s-warm", T0, T0 + timedelta(seconds=2))
    with database.transaction() as session:
        session.get(WorkerSession, "s-warm").warmup = ", ".join(f"{g} (256 tokens)" for g in GRIDS)
    pages = {(f"page-{i}.png", 0): Page(1.0 + 0.1 * i, steps=4 + i, session="s-warm") for i in range(6)}
    run = make_run(database, tmp_path, make_png, pages)
    set_times(database, run, T0, {key: (2.0 + i, 3.0 + i) for i, key in enumerate(pages)})
    return run


def report_text(url: str, run: str, subprocess_env, *args: str) -> str:
    """The report as a redirected `dsocr report` writes it (stdout a pipe, not a terminal)."""
    done = subprocess.run([sys.executable, "-m", "dsocr_workers", "report", "--run", run, *args],
                          env={**subprocess_env, "DSOCR_DATABASE_URL": url}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_redirected_report_lays_tables_out_whole(database, run_on_a_warmed_worker, subprocess_env):
    run = run_on_a_warmed_worker
    with database.transaction() as session:
        document = single_report(load_run(session, run))
    intervals = {cell_text(cell) for t in document.tables for row in t.rows for cell in row
                 if isinstance(cell, Estimate) and cell.low is not None}  # fmt: skip
    assert len(intervals) > 20
    for width in ([], ["--width", "120"]):  # redirected: as wide as the content; a narrow terminal
        text = report_text(database.url, run, subprocess_env, *width)
        lines = text.splitlines()
        assert all(line == line.rstrip() for line in lines), "lines padded out with spaces"
        if width:  # every table fits the terminal: its text wrapped, or a block per row where that does not fit
            assert max(map(len, lines)) <= 120, max(lines, key=len)
        broken = [i for i in intervals if not any(i in line for line in lines)]
        assert not broken, f"intervals split over lines: {broken[:5]}"
        for table in document.tables:  # each header whole (no "prefetche" / "d")
            for column in table.columns:
                assert all(any(word in line.split() for line in lines) for word in column.split()), column
        # One shape per line was a column of 25 lines in the worker's row.
        assert sum("gundam: 25 shapes (256 tokens)" in line for line in lines) == 1
        assert not any("gundam:3x4" in line for line in lines)
    text = report_text(database.url, run, subprocess_env)
    throughput = text[text.index("\nThroughput\n") : text.index("\nLatency and output\n")].splitlines()
    assert max(map(len, throughput)) < 80, "\n".join(throughput)  # as wide as its content, not 160 columns


def test_report_explains_its_terms(database, run_on_a_warmed_worker, subprocess_env):
    text = report_text(database.url, run_on_a_warmed_worker, subprocess_env)
    legend = text[text.index("\nTerms\n") :]
    terms = dict(glossary(()))
    for term in ("TTFT from claim", "host gap", "device idle between jobs", "device share of a job between jobs",
                 "TTFT", "value [low, high]"):  # fmt: skip
        assert any(line.split() [: len(term.split())] == term.split() and terms[term] in line
                   for line in legend.splitlines()), term  # fmt: skip
    markdown = report_text(database.url, run_on_a_warmed_worker, subprocess_env, "--format", "md")
    assert f"- **host gap**: {terms['host gap']}" in markdown
