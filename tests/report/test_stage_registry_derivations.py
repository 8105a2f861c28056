"""Everything that shows a stage is derived from the stage registry (dsocr_workers/stages.py): the result
row, the store's `results` columns, the report's tables and plots, `dsocr infer`'s timing table. Each
test compares one of them with the registry, figure by figure, values included, on a run written
through the farm's own claim → complete path."""

from __future__ import annotations

import io
from datetime import datetime
from pathlib import Path

import pytest
from fakes import WORKER, Page, fake_result, make_run
from rich.console import Console
from sqlalchemy import Float, inspect

from dsocr_workers.cli.commands_model import timing_table
from dsocr_workers.farm.job.execute import Ran, result_row
from dsocr_workers.report.build import latency as latency_figures
from dsocr_workers.report.build import single_report
from dsocr_workers.report.plots import CDF_METRICS, GAPS, stage_ms
from dsocr_workers.report.queries import RunData, load_run
from dsocr_workers.stages import (
    CDF_PLOT,
    LATENCY_TABLE,
    PARTS,
    PER_IMAGE_TABLE,
    TIMINGS,
    breakdown_bars,
    depth,
    shown_in,
)
from dsocr_workers.store.ledger import Claim
from dsocr_workers.store.models import Result

PAGE = Page(scale=1.5, steps=3, wasted=1)
# Columns of `results` that are not the job's measurements: the row's identity, written by the ledger.
IDENTITY = {"id", "job_id", "run_id", "created_at"}


def claim() -> Claim:
    return Claim("job", "run", "p.png", Path("p.png"), 0, 1, "test:1:x", datetime(2026, 1, 1), "tiny", {})


def test_the_row_writes_every_results_column_and_the_registry_s_are_its_timings():
    row = result_row(Ran(fake_result(PAGE), WORKER["id"]), claim(), claimed_s=0.0)
    columns = {c.name for c in Result.__table__.columns}
    assert set(row) == columns - IDENTITY
    timings = fake_result(PAGE).timings
    for t in TIMINGS:
        assert row[t.column] == getattr(timings, t.column), t.column
    # No figure of milliseconds in the store but the registry's, beside the one the farm measures.
    figures = {c.name for c in Result.__table__.columns if c.name.endswith("_ms") and isinstance(c.type, Float)}
    assert figures == {t.column for t in TIMINGS} | {"ttft_from_claim_ms"}


def test_the_store_has_a_float_column_per_figure_nullable_as_the_registry_says(database):
    table = Result.__table__
    for t in TIMINGS:
        column = table.columns[t.column]
        assert isinstance(column.type, Float) and column.nullable == t.nullable, t.column
    # The migrated schema agrees (tests/store/test_migrations.py compares the whole of it).
    migrated = {c["name"]: c for c in inspect(database.engine).get_columns("results")}
    assert all(migrated[t.column]["nullable"] == t.nullable for t in TIMINGS)


@pytest.fixture
def run_data(database, tmp_path, make_png) -> RunData:
    run = make_run(database, tmp_path, make_png, {("p1.png", 0): PAGE, ("p2.png", 0): PAGE})
    with database.transaction() as session:
        return load_run(session, run)


def test_the_stored_figures_are_the_engine_s(run_data):
    expected = fake_result(PAGE).timings
    for result in run_data.results.values():
        assert {t.column: t.of(result) for t in TIMINGS} == pytest.approx(expected.columns())


def rows_by_first_cell(report_table) -> dict:
    return {row[0]: row[1:] for row in report_table.rows}


def test_report_tables_show_the_registry_s_figures(run_data):
    report = single_report(run_data, per_image=True)
    tables = {t.title: t for t in report.tables}
    expected = fake_result(PAGE).timings

    latency = rows_by_first_cell(tables["Latency and output"])
    results = list(run_data.results.values())
    labels = [m.label for m in latency_figures(results)]
    registry_rows = [f"{'  ' * depth(t)}{t.label} ms" for t in shown_in(LATENCY_TABLE, results)]
    # A DeepSeek-OCR run: CLIP's stage, not the Qwen2 encoder's.
    assert "CLIP ms" in {row.strip() for row in registry_rows} and not any("Qwen2" in row for row in registry_rows)
    assert [label for label in labels if label in registry_rows] == registry_rows
    assert set(labels) - set(registry_rows) == {"TTFT from claim ms", "decode ms/token"}
    for t in shown_in(LATENCY_TABLE, results):
        jobs, n, mean, *_ = latency[f"{'  ' * depth(t)}{t.label} ms"]
        assert (jobs, n) == (2, 2) and mean.value == pytest.approx(getattr(expected, t.column)), t.column

    accounting = rows_by_first_cell(tables["Accounting: parts of end-to-end"])
    assert list(accounting) == [*(t.label for t in PARTS), "sum of parts", "end-to-end"]
    for t in PARTS:
        assert accounting[t.label][0].value == pytest.approx(getattr(expected, t.column)), t.column

    per_image = tables["Per image"]
    for t in shown_in(PER_IMAGE_TABLE):
        cells = [row[per_image.columns.index(f"{t.label} ms")] for row in per_image.rows]
        assert cells == pytest.approx([getattr(expected, t.column)] * 2), t.column


def test_plots_draw_the_registry_s_bars_and_distributions(run_data):
    expected = fake_result(PAGE).timings
    result = next(iter(run_data.results.values()))
    bars = stage_ms(result)
    assert list(bars) == [*breakdown_bars(), GAPS]
    assert expected.qwen2_ms is None and bars["Qwen2 encoder"] == 0  # another family's view encoder: no bar
    for label, columns in breakdown_bars().items():
        assert bars[label] == pytest.approx(sum(getattr(expected, c) or 0.0 for c in columns)), label
    assert sum(bars.values()) == pytest.approx(expected.e2e_ms)
    assert [m.label for m in CDF_METRICS] == [*(f"{t.label} ms" for t in shown_in(CDF_PLOT)), "decode ms/token"]


def test_the_cli_timing_table_lists_every_figure_in_registry_order():
    result = fake_result(PAGE)
    console = Console(file=io.StringIO(), width=200)
    console.print(timing_table(result, "page"))
    lines = console.file.getvalue().splitlines()
    figure_rows = [line for line in lines if line.startswith("│")]  # the header's are "┃"
    for t, line in zip(TIMINGS, figure_rows, strict=False):
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        ms = t.of(result.timings)  # None: another model family's stage
        assert cells[0] == t.label and line.startswith(f"│ {'  ' * depth(t)}{t.label}") and cells[1] == ("-" if ms is None else f"{ms:.2f}"), t.column
        assert cells[2] == ("yes" if t in PARTS else "") and cells[3] == (t.stage or "")
    assert len(figure_rows) == len(TIMINGS) + 3  # every figure, then the decode percentiles
