"""R1 baseline: N jobs, 3 workers, no fault: every job done once, nothing lost or duplicated."""

from __future__ import annotations

import time

import pytest
from reliability_harness import FAST_JOB, check_invariants, make_pages, record


def baseline(new_farm, tmp_path, jobs: int, scenario: str) -> None:
    farm = new_farm()
    listing = make_pages(tmp_path / "pages", jobs)
    start = time.monotonic()
    run_id = farm.submit(listing, *FAST_JOB)
    for _ in range(3):
        farm.start_worker()
    wall = farm.wait_until_final(run_id, timeout=60 + jobs * 2)
    tally = check_invariants(farm, run_id, max_attempts=3)
    assert tally.done == jobs and tally.results == jobs
    assert tally.max_attempts_seen == 1
    assert all(w.alive() for w in farm.workers)
    record(scenario, workers=3, faults=0, lost=jobs - tally.done, duplicated=tally.duplicates,
           wall_s=round(wall, 1), since_submit_s=round(time.monotonic() - start, 1), tally=tally)  # fmt: skip


def test_r1_baseline_ci(new_farm, tmp_path):
    baseline(new_farm, tmp_path, 60, "R1 baseline (CI)")


@pytest.mark.slow
def test_r1_baseline_300(new_farm, tmp_path):
    baseline(new_farm, tmp_path, 300, "R1 baseline")
