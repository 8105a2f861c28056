"""Checks of a job's time accounting shared by the farm's end-to-end tests."""

from __future__ import annotations

from collections.abc import Sequence

from dsocr_workers.store.models import Result


def some_host_gap_is_small(results: Sequence[Result]) -> bool:
    """The time between a job's stages that no stage accounts for is, in at least one job, at most 20 ms or
    a tenth of that job's end-to-end time. A stage left out of the accounting widens every job's gap; the
    OS preempting a process between stages (the suite runs 3 processes wide on 2 cores) widens only some."""
    return any(r.host_gap_ms <= max(20.0, 0.1 * r.e2e_ms) for r in results)
