"""Checks of a job's time accounting shared by the farm's end-to-end tests."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from dsocr_workers.store.models import Result


def typical_host_gap_is_small(results: Sequence[Result]) -> bool:
    """The time between a job's stages that no stage accounts for, in the median job: at most 20 ms or a
    tenth of its end-to-end time. A stage left out of the accounting widens every job's gap; a job whose
    process the OS preempted between stages (the suite runs 3 processes wide on 2 cores) only its own."""
    return median(r.host_gap_ms for r in results) <= max(20.0, 0.1 * median(r.e2e_ms for r in results))
