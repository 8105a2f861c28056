"""The report's table type and the small helpers every table builder shares (report/build.py for the
latency, accounting and accuracy tables; report/kernel_tables.py for the kernel tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsocr_workers.report.queries import RunData
from dsocr_workers.report.stats import Estimate
from dsocr_workers.store.models import Result

NO_DIFFERENCE = "no significant difference"
SHORT_KERNEL_CHARS = 60


class KernelName(str):
    """A kernel's full name (JSON, CSV, the HTML's hover text) that reads short in a table (`short`)."""

    @property
    def short(self) -> str:
        return short_kernel_name(self)


def short_kernel_name(name: str) -> str:
    """A kernel as a reader knows it: a C++ signature's base name, its parameters and template arguments
    dropped but the first type argument, which tells apart the kernels one template makes
    (`vectorized_elementwise_kernel<FillFunctor>`); other names (`aten::mm`, Triton's) as they are."""
    if not name.startswith("void ") and "<" not in name:  # not a C++ signature: `Memcpy HtoD (Pinned -> Device)`
        return _cut(name)
    text = name.removeprefix("void ").replace("(anonymous namespace)::", "").strip()
    end = min((i for i in (text.find("<"), text.find("(")) if i >= 0), default=len(text))
    base = text[:end].split("::")[-1].strip()
    types = [a for a in _template_arguments(text[end:]) if not a.replace(".", "").isdigit() and a not in ("true", "false")]
    argument = types[0] if types else None
    if argument is not None:
        argument = argument.split("<")[0].split("(")[0].replace("const", "").strip(" *&").split("::")[-1]
    return _cut(f"{base}<{argument}>" if argument else base)


def _template_arguments(rest: str) -> list[str]:
    """The top-level arguments of the template list `rest` opens with (none where it opens otherwise)."""
    if not rest.startswith("<"):
        return []
    arguments, depth, current = [], 0, ""
    for char in rest:
        depth += (char in "<(") - (char in ">)")
        if depth == 0:
            break
        if char == "," and depth == 1:
            arguments.append(current.strip())
            current = ""
        elif depth > 1 or char != "<":
            current += char
    return [*arguments, current.strip()]


def _cut(name: str) -> str:
    if len(name) <= SHORT_KERNEL_CHARS:
        return name
    keep = SHORT_KERNEL_CHARS - 1
    return f"{name[: keep - keep // 2]}…{name[-(keep // 2):]}"


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
