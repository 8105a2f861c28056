"""A report as one self-contained HTML page: its warnings, the plots (report/plots.py) as base64 PNG
`data:` images, then every table of the terminal report with the same cell text (render.py).

Nothing is fetched when the page opens — no scripts, fonts or stylesheets from elsewhere — so the file
can be mailed, attached to an issue or opened offline. Imported only for `--html`: it needs
matplotlib (the `report` extra), the rest of the report does not.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape

from dsocr_workers.report.build import Report
from dsocr_workers.report.plots import Plot, Side, all_plots
from dsocr_workers.report.render import cell_text
from dsocr_workers.report.stats import Estimate
from dsocr_workers.report.tables import KernelName, Table

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1240px;
       padding: 0 16px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; } h3 { font-size: 15px; margin: 20px 0 6px; }
.warning { border: 2px solid #c00; background: #fee; color: #900; font-weight: bold; padding: 8px 12px; margin: 8px 0; }
.meta { color: #666; }
nav a { margin-right: 14px; }
figure { margin: 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 13px; margin-top: 4px; }
table { border-collapse: collapse; font-size: 12px; margin-bottom: 8px; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 3px 8px; vertical-align: top; }
th { text-align: left; background: #f4f4f4; }
td.number { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code { white-space: nowrap; }
"""
OPTION = re.compile(r"--[a-z][a-z-]*")


def _options_whole(text: str) -> str:
    """A command-line option in running text never breaks at its hyphens (`--include-cold`)."""
    return OPTION.sub(lambda m: f"<code>{m.group(0)}</code>", text)


def _anchor(title: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")


def _figure(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (
        f'<section class="plot"><h2 id="{_anchor(plot.title)}">{escape(plot.title)}</h2><figure>'
        f'<img alt="{escape(plot.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_options_whole(escape(plot.caption))}</figcaption></figure></section>"
    )


def _hover(tag: str, value: object) -> str:
    """A kernel's cell shows its short name; its full name is the cell's hover text."""
    return f'{tag[:-1]} title="{escape(str(value))}">' if isinstance(value, KernelName) else tag


def _table(table: Table) -> str:
    """Cells as the terminal shows them; numeric columns (after the first) right-aligned, as there."""
    numeric = [
        i > 0 and all(isinstance(row[i], int | float | Estimate) for row in table.rows if row[i] is not None)
        for i in range(len(table.columns))
    ]
    head = "".join(f"<th>{escape(c)}</th>" for c in table.columns)
    tags = ['<td class="number">' if n else "<td>" for n in numeric]
    rows = [
        "".join(f"{_hover(tag, v)}{escape(cell_text(v))}</td>" for tag, v in zip(tags, row, strict=True))
        for row in table.rows
    ]
    body = "".join(f"<tr>{cells}</tr>" for cells in rows)
    return f'<h3 id="{_anchor(table.title)}">{escape(table.title)}</h3><table><tr>{head}</tr>{body}</table>'


def html_report(
    report: Report, sides: Sequence[Side], *, include_cold: bool, include_profiled: bool = False
) -> str:
    """The page of `report` (built from `sides`' runs by report/build.py) with the plots of those runs."""
    # Without a single result every plot would be empty axes, scaled to nothing: none is drawn.
    plots = (
        all_plots(sides, include_cold, include_profiled) if any(side.data.results for side in sides) else []
    )
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    cold = "cold results included (--include-cold)" if include_cold else "cold results left out of statistics"
    links = " ".join(
        f'<a href="#{_anchor(t)}">{escape(t)}</a>' for t in [p.title for p in plots] + ["Tables"]
    )
    parts = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(report.title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(report.title)}</h1>",
        *(f'<p class="warning">WARNING: {escape(w)}</p>' for w in report.warnings),
        f'<p class="meta">Generated {generated} by dsocr report; {cold}.</p>',
        f"<nav>{links}</nav>",
        *(_figure(p) for p in plots),
        *([] if plots else ['<p class="meta">No plots: no job of this report has a result yet.</p>']),
        '<h2 id="tables">Tables</h2>',
        *(_table(t) for t in report.tables),
        "</body></html>\n",
    ]
    return "\n".join(parts)
