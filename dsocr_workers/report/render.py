"""A report as terminal tables (rich), CSV, JSON or Markdown.

CSV holds one table: `--table NAME` picks it, or one file per table is written into a folder.
An `Estimate` cell reads "value [low, high]" in tables and Markdown ("[n<2]" or "[–]" where there is no
interval); CSV and JSON stay machine-readable: its column becomes three, `<column>`,
`<column>_ci_low` and `<column>_ci_high`, numbers (empty / null without an interval). A table's note
goes under it (terminal), under its heading (Markdown), after its title line (CSV, `# note: …`) and
into `notes` by table title (JSON).
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsocr_workers.errors import InputError
from dsocr_workers.report.build import Report
from dsocr_workers.report.stats import Estimate
from dsocr_workers.report.tables import KernelName, Table

FORMATS = ("table", "csv", "json", "md")


def cell_text(value: Any) -> str:
    if isinstance(value, Estimate):
        if value.value is None:
            return ""
        if value.low is None or value.high is None:
            return f"{cell_text(value.value)} [{'n<2' if value.n < 2 else '–'}]"
        return f"{cell_text(value.value)} [{cell_text(value.low)}, {cell_text(value.high)}]"
    if value is None:
        return ""
    if isinstance(value, KernelName):
        return value.short
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def render(report: Report, fmt: str, *, width: int | None = None) -> str:
    if fmt == "table":
        return render_table(report, width=width)
    if fmt == "csv":
        if len(report.tables) != 1:
            raise InputError(
                "csv holds one table: pick one with --table NAME, or give --out DIR/ for one file per table "
                f"(tables: {', '.join(t.title for t in report.tables)})"
            )
        return render_csv(report)
    if fmt == "json":
        return render_json(report)
    if fmt == "md":
        return render_markdown(report)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


def only_table(report: Report, title: str) -> Report:
    """The report with one of its tables (its title, any case)."""
    chosen = [t for t in report.tables if t.title.casefold() == title.casefold()]
    if not chosen:
        raise InputError(
            f"--table {title!r}: this report's tables are {', '.join(t.title for t in report.tables)}"
        )
    return replace(report, tables=chosen, terms=[])  # one table, for a script: no legend


def table_file_name(title: str) -> str:
    """`Latency and output` → `latency-and-output.csv`."""
    return re.sub(r"[^a-z0-9]+", "-", title.casefold()).strip("-") + ".csv"


def write_csv_tables(report: Report, directory: Path) -> list[Path]:
    """One CSV file per table in `directory` (created), each with the report's warnings."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for table in report.tables:
        path = directory / table_file_name(table.title)
        path.write_text(render_csv(replace(report, tables=[table])), encoding="utf-8")
        written.append(path)
    return written


# Without a width (output piped, redirected or written to a file) a table is as wide as its content: no
# line is cut to a guessed terminal width, and none is padded out to one.
NATURAL_WIDTH = 10_000


def render_table(report: Report, *, width: int | None = None, color: bool = False) -> str:
    """Terminal tables at most `width` characters wide (a terminal's width), their text wrapped to fit, or
    where even that does not fit, a block per row; without a width as wide as their content. The legend of
    the report's terms closes it."""
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.panel import Panel
    from rich.table import Table as RichTable
    from rich.text import Text

    out = io.StringIO()

    def console(at_least: int = 0) -> Console:
        return Console(
            file=out, width=max(width or NATURAL_WIDTH, at_least), force_terminal=color, no_color=not color
        )

    wide = console(NATURAL_WIDTH)
    console().print(f"[bold]{report.title}[/bold]")
    for warning in report.warnings:
        console().print(Panel(warning, style="bold red", title="WARNING", expand=False))
    for section in report.tables:
        table = RichTable(title=section.title, box=box.SIMPLE_HEAD, title_justify="left")
        for i, column in enumerate(section.columns):
            numeric = all(
                isinstance(row[i], int | float | Estimate) for row in section.rows if row[i] is not None
            )
            # Text wraps between words where the table would not fit otherwise; a word, a figure or an
            # interval never breaks (the longest is the column's least width).
            units = [*column.split(), *(unit for row in section.rows for unit in _unbroken(row[i]))]
            table.add_column(column, justify="right" if numeric and i > 0 else "left", overflow="fold",
                             min_width=max(map(len, units), default=1))
        for row in section.rows:
            table.add_row(*(Text(cell_text(v)) for v in row))  # Text: "[n<2]" is not console markup
        if section.note:
            table.caption = Text(section.note, style="bold red")
        measured = Measurement.get(wide, wide.options, table)
        if width is None or measured.minimum <= width:
            console(min(width or NATURAL_WIDTH, measured.maximum)).print(table)
            continue
        # Too many columns for the terminal even wrapped: one block per row, a line per column (as psql's
        # expanded display), so that no line runs past the terminal.
        for index, row in enumerate(section.rows, start=1):
            block = RichTable(title=f"{section.title} [{index} of {len(section.rows)}]", box=None,
                              title_justify="left", show_header=False)
            block.add_column("column", style="bold", overflow="fold")
            block.add_column("value", overflow="fold")
            for column, value in zip(section.columns, row, strict=True):
                block.add_row(Text(column), Text(cell_text(value)))
            console().print(block)
        if section.note:
            console().print(Text(section.note, style="bold red"))
    if report.terms:
        legend = RichTable(title="Terms", box=None, title_justify="left", show_header=False)
        legend.add_column("term", no_wrap=True, style="bold")
        legend.add_column("meaning", overflow="fold")
        for term, meaning in report.terms:
            legend.add_row(Text(term), Text(meaning))
        console().print(legend)
    return "".join(line.rstrip() + "\n" for line in out.getvalue().splitlines())


def _unbroken(value: Any) -> list[str]:
    """The parts of a cell a line break may not split: a figure or an interval whole, else each word."""
    text = cell_text(value)
    return [text] if isinstance(value, int | float | Estimate) else text.split()


def _number(value: Any) -> Any:
    """Floats to 6 significant digits: exports stay readable without losing what was measured."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def _expanded(table: Table) -> tuple[list[str], list[list[Any]]]:
    """Every column that holds an Estimate becomes `<column>`, `<column>_ci_low`, `<column>_ci_high`."""
    estimates = [any(isinstance(row[i], Estimate) for row in table.rows) for i in range(len(table.columns))]
    columns: list[str] = []
    for column, expand in zip(table.columns, estimates, strict=True):
        columns += [column, f"{column}_ci_low", f"{column}_ci_high"] if expand else [column]
    rows = []
    for row in table.rows:
        cells: list[Any] = []
        for value, expand in zip(row, estimates, strict=True):
            if isinstance(value, Estimate):
                cells += [value.value, value.low, value.high]
            else:
                cells += [value, None, None] if expand else [value]
        rows.append([_number(v) for v in cells])
    return columns, rows


def render_csv(report: Report) -> str:
    """A one-table report as CSV: `#` lines first (the warnings, the table's title, its note), then the
    header and the rows. Readers skip the `#` lines (pandas: `comment="#"`)."""
    (section,) = report.tables
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for warning in report.warnings:
        writer.writerow([f"# {warning}"])
    columns, rows = _expanded(section)
    writer.writerow([f"# {section.title}"])
    if section.note:
        writer.writerow([f"# note: {section.note}"])
    writer.writerow(columns)
    writer.writerows([["" if v is None else v for v in row] for row in rows])
    return out.getvalue()


def render_json(report: Report) -> str:
    tables = {}
    for table in report.tables:
        columns, rows = _expanded(table)
        tables[table.title] = [dict(zip(columns, row, strict=True)) for row in rows]
    notes = {table.title: table.note for table in report.tables if table.note}
    document = {
        "title": report.title,
        "warnings": report.warnings,
        "tables": tables,
        "notes": notes,
        "terms": dict(report.terms),
    }
    if report.differences:  # a comparison of runs that are not like for like
        document["unlike_runs"] = report.differences
    return json.dumps(document, indent=2, default=str) + "\n"


def render_markdown(report: Report) -> str:
    def escape(value: Any) -> str:
        return cell_text(value).replace("|", "\\|").replace("\n", " ")

    lines = [f"# {report.title}", ""]
    lines += [f"> **WARNING: {w}**\n" for w in report.warnings]
    for section in report.tables:
        lines += [f"## {section.title}", ""]
        lines += [f"> **{section.note}**", ""] if section.note else []
        lines += ["| " + " | ".join(section.columns) + " |"]
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(section.columns) - 1)) + "|")
        lines += ["| " + " | ".join(escape(v) for v in row) + " |" for row in section.rows]
        lines.append("")
    if report.terms:
        lines += ["## Terms", ""] + [f"- **{term}**: {meaning}" for term, meaning in report.terms] + [""]
    return "\n".join(lines)
