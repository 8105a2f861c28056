"""A report as terminal tables (rich), CSV, JSON or Markdown."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from dsocr_workers.report.build import Report

FORMATS = ("table", "csv", "json", "md")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def render(report: Report, fmt: str, *, width: int | None = None) -> str:
    if fmt == "table":
        return render_table(report, width=width)
    if fmt == "csv":
        return render_csv(report)
    if fmt == "json":
        return render_json(report)
    if fmt == "md":
        return render_markdown(report)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


def render_table(report: Report, *, width: int | None = None, color: bool = False) -> str:
    from rich import box
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    console = Console(file=io.StringIO(), width=width or 160, force_terminal=color, no_color=not color)
    console.print(f"[bold]{report.title}[/bold]")
    for warning in report.warnings:
        console.print(Panel(warning, style="bold red", title="WARNING"))
    for section in report.tables:
        table = Table(title=section.title, box=box.SIMPLE_HEAD, title_justify="left")
        for i, column in enumerate(section.columns):
            numeric = all(isinstance(row[i], int | float) for row in section.rows if row[i] is not None)
            table.add_column(column, justify="right" if numeric and i > 0 else "left", overflow="fold")
        for row in section.rows:
            table.add_row(*(_cell(v) for v in row))
        console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def render_csv(report: Report) -> str:
    """Every table as a block: `# title`, the header, the rows, a blank line."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for warning in report.warnings:
        writer.writerow([f"# {warning}"])
    for section in report.tables:
        writer.writerow([f"# {section.title}"])
        writer.writerow(section.columns)
        writer.writerows([["" if v is None else v for v in row] for row in section.rows])
        writer.writerow([])
    return out.getvalue()


def render_json(report: Report) -> str:
    document = {
        "title": report.title,
        "warnings": report.warnings,
        "tables": {
            t.title: [dict(zip(t.columns, row, strict=True)) for row in t.rows] for t in report.tables
        },
    }
    return json.dumps(document, indent=2, default=str) + "\n"


def render_markdown(report: Report) -> str:
    def escape(value: Any) -> str:
        return _cell(value).replace("|", "\\|").replace("\n", " ")

    lines = [f"# {report.title}", ""]
    lines += [f"> **WARNING: {w}**\n" for w in report.warnings]
    for section in report.tables:
        lines += [f"## {section.title}", "", "| " + " | ".join(section.columns) + " |"]
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(section.columns) - 1)) + "|")
        lines += ["| " + " | ".join(escape(v) for v in row) + " |" for row in section.rows]
        lines.append("")
    return "\n".join(lines)
