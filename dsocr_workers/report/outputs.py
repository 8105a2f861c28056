"""A report from the ledger to where it goes (`dsocr report`, and the closing report of `dsocr run`): the
runs read, the document built, then an HTML page with plots, one CSV file per table, or text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsocr_workers.errors import InputError
from dsocr_workers.report.build import comparison_report, single_report
from dsocr_workers.report.kernel_tables import KERNEL_ROWS
from dsocr_workers.report.queries import load_run
from dsocr_workers.report.render import only_table, render, write_csv_tables
from dsocr_workers.store.db import open_ledger


@dataclass(frozen=True)
class ReportRequest:
    """What `dsocr report` is asked for; the defaults are `dsocr run`'s closing report."""

    run: str  # id, unique prefix, or latest (A with `vs`)
    vs: str | None = None  # B: compared with A, side by side and paired per image
    per_image: bool = False
    include_cold: bool = False  # cold results back into the statistics and throughput
    include_profiled: bool = False  # profiled results (submit --profile) back into the latency statistics
    exclude_loops: bool = False  # looping results out of the latency statistics
    kernels: int | None = None  # kernels shown per stage in the kernel tables (None: KERNEL_ROWS)
    fmt: str = "table"  # report/render.py FORMATS
    table: str | None = None  # only this table, by title
    width: int | None = None  # of the terminal tables
    out: Path | None = None  # a file; with csv and several tables, a folder of one file per table
    html: Path | None = None  # also the self-contained HTML page with plots (needs matplotlib)


def write_report(
    database_url: str, request: ReportRequest, on_written: Callable[[Path], None] = lambda path: None
) -> str | None:
    """The report's text for stdout, or None where it went to `request.out`. Each file is told to
    `on_written` once it is written (the HTML page first)."""
    if request.html is not None:  # before the ledger is read: a missing extra is the user's first news
        try:
            from dsocr_workers.report.html import html_report
            from dsocr_workers.report.plots import sides_of
        except ModuleNotFoundError as exc:
            package = (exc.name or "matplotlib").partition(".")[0]
            raise InputError(f"--html needs {package}: pip install 'dsocr-workers[report]'") from exc
    with open_ledger(database_url).transaction() as tx:
        a = load_run(tx, request.run)
        b = load_run(tx, request.vs) if request.vs else None
        if b is not None:
            document = comparison_report(
                a,
                b,
                per_image=request.per_image,
                include_cold=request.include_cold,
                exclude_loops=request.exclude_loops,
                include_profiled=request.include_profiled,
                kernels=request.kernels or KERNEL_ROWS,
            )
        else:
            document = single_report(
                a,
                per_image=request.per_image,
                include_cold=request.include_cold,
                exclude_loops=request.exclude_loops,
                include_profiled=request.include_profiled,
                kernels=request.kernels or KERNEL_ROWS,
            )
    if request.html is not None:
        sides = sides_of(a, b) if b is not None else sides_of(a)
        page = html_report(
            document, sides, include_cold=request.include_cold, include_profiled=request.include_profiled
        )
        request.html.write_text(page, encoding="utf-8")
        on_written(request.html)
    if request.table is not None:
        document = only_table(document, request.table)
    if request.fmt == "csv" and request.out is not None and len(document.tables) > 1:
        for path in write_csv_tables(document, request.out):
            on_written(path)
        return None
    text = render(document, request.fmt, width=request.width)
    if request.out is None:
        return text
    request.out.write_text(text, encoding="utf-8")
    on_written(request.out)
    return None
