"""The report's statistics (report/stats.py) against plain numpy on the same data."""

from __future__ import annotations

import numpy as np
import pytest

from dsocr_workers.report.stats import QUANTILES, Summary, _Jobs, paired_ratios, rate_sum, rate_sum_ratio


def test_pooled_statistics_of_a_resample_equal_numpy_on_the_concatenated_jobs():
    rng = np.random.default_rng(3)
    per_job = [rng.lognormal(2.8, 0.3, size=rng.integers(1, 40)) for _ in range(25)]
    jobs = _Jobs(per_job)
    for _ in range(100):
        idx = rng.integers(0, 25, size=25)
        pooled = np.concatenate([per_job[i] for i in idx])
        expected = [pooled.mean(), *np.percentile(pooled, [*QUANTILES, 0, 100])]
        assert jobs.stats(idx, [*QUANTILES, 0, 100]) == pytest.approx(expected)


@pytest.mark.parametrize("band", [(0.02, 2000), (0.0, 1)])
def test_a_long_runs_percentiles_counted_in_their_band_are_numpys(band, monkeypatch):
    """Hundreds of jobs of hundreds of decode steps: a resample's percentiles are counted among the values
    around the pooled ones; with a band of one value (most resamples' percentiles fall outside it: counted
    over every value instead) and with the shipped band, they are numpy's on the concatenated jobs."""
    from dsocr_workers.report import stats

    monkeypatch.setattr(stats, "BAND", band[0])
    monkeypatch.setattr(stats, "BAND_MIN", band[1])
    rng = np.random.default_rng(5)
    per_job = [rng.normal(7, 0.5, size=rng.integers(200, 400)) * rng.lognormal(0, 0.05) for _ in range(300)]
    per_job[7] = per_job[7] * 3  # a far slower job: resamples that draw it often move p99
    jobs = _Jobs(per_job)
    for _ in range(40):
        idx = rng.integers(0, 300, size=300)
        pooled = np.concatenate([per_job[i] for i in idx])
        expected = [pooled.mean(), *np.percentile(pooled, [*QUANTILES, 0, 100])]
        assert jobs.stats(idx, [*QUANTILES, 0, 100]) == pytest.approx(expected, rel=1e-12)


def test_summary_intervals_cover_the_value_and_narrow_with_more_jobs():
    rng = np.random.default_rng(4)
    few, many = (
        Summary.from_values(list(rng.normal(100, 10, 10))),
        Summary.from_values(list(rng.normal(100, 10, 400))),
    )
    for s in (few, many):
        for e in (s.mean, s.p50, s.p90, s.p99):
            assert e.low <= e.value <= e.high and e.n == s.jobs
    assert (many.mean.high - many.mean.low) < (few.mean.high - few.mean.low) / 3
    assert 97 < many.mean.low < 100 < many.mean.high < 103


def test_pooled_steps_resample_jobs_not_steps():
    # Each job's steps sit around its own level: 5 jobs × 200 steps hold 5 independent values, not 1000.
    rng = np.random.default_rng(5)
    per_job = [rng.normal(level, 0.1, 200) for level in rng.normal(20, 2, 5)]
    clustered = Summary.from_jobs(per_job)
    as_if_independent = Summary.from_values(list(np.concatenate(per_job)))
    assert (clustered.n, clustered.jobs, clustered.mean.n) == (1000, 5, 5)
    width = clustered.mean.high - clustered.mean.low
    assert width > 5 * (as_if_independent.mean.high - as_if_independent.mean.low)


def test_no_interval_with_one_job_or_no_spread():
    assert Summary.from_jobs([[1.0, 2.0, 3.0]]).mean.low is None  # one job, however many steps
    same = Summary.from_values([5.0, 5.0, 5.0])
    assert (same.mean.value, same.mean.low, same.mean.high) == (5.0, None, None)
    assert Summary.from_values([None, None]).mean.value is None


def test_paired_ratio_and_rates():
    rng = np.random.default_rng(6)
    a = rng.lognormal(0, 0.5, 30)
    ratio = paired_ratios([[x] for x in 2 * a * rng.lognormal(0, 0.02, 30)], [[x] for x in a])
    assert 1.9 < ratio.mean.low < ratio.mean.value < ratio.mean.high < 2.1 and ratio.mean.n == 30
    assert rate_sum([[1.0, 1.0], [0.5]]).value == pytest.approx(3.0)  # 1/s + 2/s
    moving = rate_sum([[0.9, 1.1, 1.0], [0.5]])
    assert moving.value == pytest.approx(3.0) and moving.low < 3.0 < moving.high
    assert rate_sum_ratio([[1.0], [1.0]], [[1.0]]).value == pytest.approx(2.0)
    assert rate_sum([[]]).value is None
