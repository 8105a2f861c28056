"""Every statistic the report prints, with its 95% confidence interval: the one place that computes
means, percentiles and intervals (scipy.stats.bootstrap, never hand-written resampling).

A bootstrap resamples the independent units: jobs (`Summary`; a job's decode steps share its page and
cache, so steps are pooled from whole resampled jobs), (image, repeat) pairs of two runs
(`paired_ratios`, `paired_difference`), or each worker's service times (`rate_sum`). Intervals are
percentile intervals with a fixed seed, so the same ledger gives the same report; percentile rather
than BCa, whose jackknife is unreliable for quantiles. With fewer than two units, or no spread, there is
no interval. A resample never exceeds the largest value measured, so a p99 interval from fewer than
about a hundred jobs is too narrow on the high side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 20261123  # fixed: a report is reproducible from its ledger
_BATCH = 250  # resamples per vectorised call: bounds memory on large runs
QUANTILES = (50, 90, 99)

# scipy calls a statistic with the resampled samples and, when vectorised, axis=-1 (the resamples of a
# batch along the other axes); the statistics here always reduce along the last axis.
Statistic = Callable[..., np.ndarray]


@dataclass(frozen=True)
class Estimate:
    """A statistic and its 95% confidence interval; `low` / `high` are None when there is none (fewer
    than two jobs, or no spread). `n` counts the units it resamples: jobs, pairs of jobs, service times."""

    value: float | None
    low: float | None = None
    high: float | None = None
    n: int = 0


def _estimate(value: float, low: float, high: float, n: int) -> Estimate:
    """nan or infinite bounds (no interval, or a resample divided by zero) give an Estimate without one."""
    if not np.isfinite(value):
        return Estimate(None, n=n)
    if not (np.isfinite(low) and np.isfinite(high)):
        return Estimate(float(value), n=n)
    return Estimate(float(value), float(low), float(high), n)


def _bootstrap(
    data: tuple[np.ndarray, ...], statistic: Statistic, *, vectorized: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds, one per output of `statistic`."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample may divide by zero: no interval
        result = stats.bootstrap(
            data,
            statistic,
            n_resamples=RESAMPLES,
            batch=_BATCH,
            vectorized=vectorized,
            paired=False,
            confidence_level=CONFIDENCE,
            method="percentile",
            rng=np.random.default_rng(SEED),
        )
    interval = result.confidence_interval
    return np.atleast_1d(interval.low), np.atleast_1d(interval.high)


class _Jobs:
    """Values grouped by job. A resample is an array of job indices (a job drawn twice counts twice);
    `stats` gives the mean and percentiles of the values of the jobs drawn, pooled."""

    def __init__(self, per_job: Sequence[Sequence[float]]) -> None:
        arrays = [np.asarray(v, dtype=float) for v in per_job if len(v)]
        self.count = len(arrays)
        self.pooled = np.concatenate(arrays) if arrays else np.empty(0)
        # One value per job: a batch of resamples is plain fancy indexing, vectorised by numpy.
        self.one_each = all(a.size == 1 for a in arrays)
        # Many values per job (decode steps): concatenating the drawn jobs is slow on a long run, so a
        # resample is weights instead: how often each job was drawn, applied to the pooled values sorted once.
        self.sizes = np.asarray([a.size for a in arrays], dtype=np.intp)
        self.sums = np.asarray([a.sum() for a in arrays])
        order = np.argsort(self.pooled, kind="stable")
        self.sorted = self.pooled[order]
        self.owner = np.repeat(np.arange(self.count), self.sizes)[order]
        self._bands: dict[float, _Band] = {}  # per quantile, the sorted values around it

    def _band(self, quantile: float) -> _Band:
        """The sorted values within BAND of the pooled values' `quantile`, and each job's count below them."""
        if quantile not in self._bands:
            n = self.sorted.size
            centre = round((n - 1) * quantile / 100)
            half = max(BAND_MIN, int(BAND * n))
            start, end = max(0, centre - half), min(n, centre + half + 1)
            below = np.bincount(self.owner[:start], minlength=self.count)
            self._bands[quantile] = _Band(start, below, self.owner[start:end])
        return self._bands[quantile]

    def _percentile(self, drawn: np.ndarray, total: int, quantile: float) -> float:
        """np.percentile's (linear) `quantile` of the pooled values of the jobs `drawn` times each. Its
        ranks are counted within the band around the pooled quantile (a resample's quantile lies there
        but for a far outlier: then over every value), so a resample of a long run's decode steps costs
        a few thousand operations, not a pass over a million values."""
        h = (total - 1) * quantile / 100
        below = int(np.floor(h))
        above = min(below + 1, total - 1)
        band = self._band(quantile)
        base = int(drawn @ band.below)  # drawn values below the band
        rank_end = base + np.cumsum(drawn[band.owner])  # 1 + the last drawn rank of each value in the band
        start = band.start
        if not (base <= below and rank_end.size and above < rank_end[-1]):  # outside the band: every value
            rank_end, start = np.cumsum(drawn[self.owner]), 0
        x_below, x_above = self.sorted[start + np.searchsorted(rank_end, [below, above], side="right")]
        return float(x_below + (h - below) * (x_above - x_below))

    @property
    def varies(self) -> bool:
        return self.pooled.size > 1 and bool(np.ptp(self.pooled) > 0)

    def stats(self, idx: np.ndarray, quantiles: Sequence[float]) -> np.ndarray:
        """[mean, *percentiles] of the jobs `idx` (a batch of resamples along the last axis when
        `one_each`), as np.percentile's default (linear) method computes them on the pooled values."""
        if self.one_each:
            x = self.pooled[idx]
            return np.stack([np.mean(x, axis=-1), *np.percentile(x, quantiles, axis=-1)])
        drawn = np.bincount(idx, minlength=self.count)
        total = int(drawn @ self.sizes)
        return np.asarray(
            [drawn @ self.sums / total, *(self._percentile(drawn, total, q) for q in quantiles)]
        )


# A resample's percentile is looked for among the pooled values within this share of their count (and at
# least BAND_MIN values) either side of the pooled percentile: resampling whole jobs moves a percentile of
# thousands of jobs' values by far less.
BAND = 0.02
BAND_MIN = 2000


@dataclass(frozen=True)
class _Band:
    start: int  # the band's first sorted position
    below: np.ndarray  # per job, its values before `start`
    owner: np.ndarray  # the job of each value in the band, in sorted order


@dataclass(frozen=True)
class Summary:
    """Mean, p50, p90 and p99 of one metric, each with its interval. `n` values from `jobs` jobs."""

    n: int
    jobs: int
    mean: Estimate
    p50: Estimate
    p90: Estimate
    p99: Estimate

    @classmethod
    def from_values(cls, values: Sequence[float | None]) -> Summary:
        """One value per job; None (not measured) is left out."""
        return cls.from_jobs([[v] for v in values if v is not None])

    @classmethod
    def from_jobs(cls, per_job: Sequence[Sequence[float]]) -> Summary:
        """Values pooled over jobs, intervals from resampling whole jobs."""
        jobs = _Jobs(per_job)
        n = jobs.pooled.size
        if n == 0:
            return cls(0, 0, *(Estimate(None) for _ in range(4)))
        values = jobs.stats(np.arange(jobs.count), QUANTILES)
        low = high = np.full(4, np.nan)  # nan: no interval
        if jobs.count >= 2 and jobs.varies:
            low, high = _bootstrap(
                (np.arange(jobs.count),),
                lambda idx, axis=-1: jobs.stats(idx, QUANTILES),
                vectorized=jobs.one_each,
            )
        estimates = [_estimate(values[i], low[i], high[i], jobs.count) for i in range(4)]
        return cls(n, jobs.count, *estimates)


@dataclass(frozen=True)
class Ratio:
    """B/A of the mean and of the median over paired jobs."""

    mean: Estimate
    p50: Estimate


def paired_ratios(b: Sequence[Sequence[float]], a: Sequence[Sequence[float]]) -> Ratio:
    """`b[i]` and `a[i]` are the values of the same (image, repeat) in run B and run A (one value, or a
    job's decode steps). Pairs where either side has no value are left out."""
    kept = [(vb, va) for vb, va in zip(b, a, strict=True) if len(vb) and len(va)]
    jobs_b, jobs_a = _Jobs([vb for vb, _ in kept]), _Jobs([va for _, va in kept])
    n = len(kept)
    if n == 0:
        return Ratio(Estimate(None), Estimate(None))

    def ratio(idx: np.ndarray, axis: int = -1) -> np.ndarray:
        return jobs_b.stats(idx, (50,)) / jobs_a.stats(idx, (50,))  # [mean, median] of B over A

    with np.errstate(divide="ignore", invalid="ignore"):
        values = ratio(np.arange(n))
    low = high = np.full(2, np.nan)
    if n >= 2 and (jobs_b.varies or jobs_a.varies):
        low, high = _bootstrap((np.arange(n),), ratio, vectorized=jobs_b.one_each and jobs_a.one_each)
    return Ratio(*(_estimate(values[i], low[i], high[i], n) for i in range(2)))


class BinnedRates(list[float]):
    """A worker's rate measured in equal time bins (pages/s in each): its rate is their mean. The other
    kind of sample, plain service times (seconds per job), gives 1 / their mean. A batched worker's jobs
    overlap: they have no service times of their own (report/throughput.py)."""


def _rate(sample: np.ndarray, binned: bool, axis: int = -1) -> np.ndarray:
    return np.mean(sample, axis=axis) if binned else 1.0 / np.mean(sample, axis=axis)


def _rates(groups: Sequence[Sequence[Sequence[float]]], combine: Callable[[list], float]) -> Estimate:
    """combine([Σ_s rate(s) for each group]) where a group is a list of independent samples (one per
    worker) and rate(s) is 1 / mean(s) for service times, mean(s) for `BinnedRates`. Samples with no
    spread (or a single value) cannot move under resampling: they enter as constants, the others are
    resampled independently of each other."""
    arrays = [
        [(np.asarray(s, dtype=float), isinstance(s, BinnedRates)) for s in group if len(s)]
        for group in groups
    ]
    n = sum(s.size for group in arrays for s, _ in group)
    if any(not group for group in arrays):
        return Estimate(None, n=n)
    with np.errstate(divide="ignore"):
        value = combine([sum(float(_rate(s, binned)) for s, binned in group) for group in arrays])
        moving = [
            (g, s, binned)
            for g, group in enumerate(arrays)
            for s, binned in group
            if s.size >= 2 and np.ptp(s) > 0
        ]
        fixed = [
            sum(float(_rate(s, binned)) for s, binned in group if s.size < 2 or np.ptp(s) == 0)
            for group in arrays
        ]
    if not moving:
        return _estimate(value, np.nan, np.nan, n)

    def statistic(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
        sums: list = list(fixed)
        for (g, _, binned), sample in zip(moving, samples, strict=True):
            sums[g] = sums[g] + _rate(sample, binned, axis)
        return np.asarray(combine(sums))

    low, high = _bootstrap(tuple(s for _, s, _ in moving), statistic, vectorized=True)
    return _estimate(value, low[0], high[0], n)


def rate_sum(samples: Sequence[Sequence[float]]) -> Estimate:
    """Σ over samples of 1 / mean(sample): the rate of workers running side by side, each sample one
    worker's service times (or its `BinnedRates`: their mean)."""
    return _rates([samples], lambda sums: sums[0])


def rate_sum_ratio(b: Sequence[Sequence[float]], a: Sequence[Sequence[float]]) -> Estimate:
    """rate_sum(b) / rate_sum(a), every worker of both runs resampled independently."""
    return _rates([b, a], lambda sums: sums[0] / sums[1])


def paired_difference(b: Sequence[float], a: Sequence[float]) -> Estimate:
    """Mean of B − A over pairs (`b[i]`, `a[i]` the same (image, repeat) in run B and run A), with the
    interval of a paired bootstrap: a resample draws pairs."""
    differences = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    n = differences.size
    if n == 0:
        return Estimate(None)
    value = float(differences.mean())
    if n < 2 or np.ptp(differences) == 0:
        return Estimate(value, n=n)
    low, high = _bootstrap(
        (np.arange(n),), lambda idx, axis=-1: np.mean(differences[idx], axis=axis), vectorized=True
    )
    return _estimate(value, low[0], high[0], n)


def plain_percentiles(values: Sequence[float], quantiles: Sequence[float]) -> list[float | None]:
    """The `quantiles` of `values` themselves, no interval (None each when there are none): for values
    that are not independent draws, such as a batched engine's steps (each one's time depends on the
    pages in flight, which the steps around it share), where resampling them would make one up."""
    if not len(values):
        return [None for _ in quantiles]
    return [float(q) for q in np.percentile(np.asarray(values, dtype=float), quantiles)]
