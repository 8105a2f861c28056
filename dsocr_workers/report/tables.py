"""The report's table type and the small helpers every table builder shares (report/build.py for the
latency, accounting and accuracy tables; report/kernel_tables.py for the kernel tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsocr_workers.report.queries import RunData
from dsocr_workers.report.stats import Estimate
from dsocr_workers.store.models import Result

NO_DIFFERENCE = "no significant difference"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]  # cells: str, int, float, None, or an Estimate (value with its interval)
    note: str | None = None  # what the figures mean (or do not), printed with the table


def in_job_order(data: RunData) -> list[Result]:
    results = (data.results.get(j.id) for j in data.jobs)
    return [r for r in results if r is not None]


def verdict(ratio: Estimate) -> str:
    """What a B/A ratio says, plainly."""
    if ratio.value is None:
        return "–"
    if ratio.low is None or ratio.high is None:
        return "no interval (n<2)" if ratio.n < 2 else "no interval (no spread)"
    if ratio.low > 1:
        return "B higher"
    if ratio.high < 1:
        return "B lower"
    return NO_DIFFERENCE
