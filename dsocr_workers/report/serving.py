"""The serving table: a run as the serving benchmarks print one (`vllm bench serve`, AIPerf): request
throughput, output tokens/s, TTFT, TPOT, inter-token latency and end-to-end, with the batch the jobs
decoded in, and what it makes a day per GPU and for the run's GPUs together.

Throughput is the run's steady state (report/throughput.py) with its 95% interval; output tokens/s is
that rate times the mean tokens out of a page. A batched job's TTFT runs from its claim, so it holds its
page's preparation and its wait for a slot. A day is 86,400 s of that steady state, not a measured day.

The Batch steps table (a batched run's `batch_steps`): the device's side of the same jobs, step by
step: pages joined, decode steps, pages per step, a decode step's time and what its attention read (KV
positions per page, and the longest page's: pages that joined one by one spread over the range, a wave
grows together) by occupancy band, the prefill steps' share, and the time in steps per GPU against the
run's wall span (the rest went to the host or to waiting for work). A step's time statistics leave out
the steps a `--profile N` run sampled (run under torch.profiler); the counts and sums hold every step as
it ran.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dsocr_workers.farm.run_options import recorded_prefill
from dsocr_workers.report.queries import RunData, StepTime
from dsocr_workers.report.stats import Estimate, Summary, plain_percentiles
from dsocr_workers.report.tables import Table, verdict
from dsocr_workers.report.throughput import steady, steady_state_throughput, throughput_ratio
from dsocr_workers.stages import BY_COLUMN
from dsocr_workers.store.models import Result

TTFT, TPOT, E2E, QUEUE_WAIT = (BY_COLUMN[c] for c in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_wait_ms"))

SECONDS_PER_DAY = 86_400
# Beside the stage registry's figures (TTFT, TPOT, end-to-end, queue wait: the legend has them from there).
TERMS = [
    ("ITL", "inter-token latency: every gap between two consecutive tokens of a job, pooled over jobs"),
    (
        "batch occupancy",
        "pages decoding in a job's batch per decode step, averaged over its steps (1 on the batch-1 path)",
    ),
    (
        "pages/day",
        "steady-state pages/s x 86,400: what warm workers with a full queue keep up, per GPU and for "
        "the run's GPUs together",
    ),
    (
        "prefill / sam / join / decode step",
        "a batched engine's step on the device: a page's whole prefill into its slot; or, split (--prefill "
        "split, while more pages decode than wait to join), its two parts in two steps: sam (its upload "
        "and SAM), then join (view encoder, projector, LM prefill, first token); or one decode step over "
        "the pages in the batch (its occupancy); the prefill step ms and share take every step that prefills",
    ),
]
# Decode steps by their occupancy: (label, fewest pages, most).
OCCUPANCY_BANDS = (("1", 1, 1), ("2-7", 2, 7), ("8-31", 8, 31), ("32-63", 32, 63), ("64+", 64, math.inf))


@dataclass(frozen=True)
class Serving:
    concurrency: int  # the run's --concurrency
    prefill: str  # the run's --prefill (a run recorded before it: whole); BATCH_1_PREFILL at concurrency 1
    gpus: int  # devices (host, device) whose workers finished its jobs
    pages_per_s: Estimate
    tokens_per_page: float | None  # mean tokens out
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    queue_wait_ms: Summary
    occupancy: Summary

    @property
    def output_tokens_per_s(self) -> float | None:
        rate = self.pages_per_s.value
        return None if rate is None or self.tokens_per_page is None else rate * self.tokens_per_page

    @property
    def pages_per_day(self) -> float | None:
        return None if self.pages_per_s.value is None else self.pages_per_s.value * SECONDS_PER_DAY

    @property
    def pages_per_day_per_gpu(self) -> float | None:
        day = self.pages_per_day
        return None if day is None or not self.gpus else day / self.gpus


BATCH_1_PREFILL = "whole (batch-1)"


def serving(data: RunData, include_cold: bool = False) -> Serving:
    results = [r for r in data.results.values() if steady(r, include_cold)]
    gpus = len({(r.worker_id, r.device) for r in data.results.values()})  # worker: a host's environment
    tokens = [r.decode_tokens for r in results]

    def each(read) -> Summary:  # type: ignore[no-untyped-def]
        return Summary.from_values([read(r) for r in results])

    concurrency = int((data.run.parameters or {}).get("concurrency", 1))
    return Serving(
        concurrency=concurrency,
        # The batch-1 path prefills each page in one forward, whatever --prefill says (it splits a batch's).
        prefill=recorded_prefill(data.run.parameters or {}) if concurrency > 1 else BATCH_1_PREFILL,
        gpus=gpus,
        pages_per_s=steady_state_throughput(data, include_cold),
        tokens_per_page=sum(tokens) / len(tokens) if tokens else None,
        ttft_ms=each(TTFT.of),
        tpot_ms=each(_tpot),
        itl_ms=Summary.from_jobs([list(r.decode_step_ms) for r in results]),
        e2e_ms=each(E2E.of),
        queue_wait_ms=each(QUEUE_WAIT.of),
        occupancy=each(lambda r: 1.0 if r.batch_occupancy is None else r.batch_occupancy),
    )


def _tpot(result: Result) -> float | None:
    """Its TPOT; for rows written before the column, the mean kept decode step (the same on the batch-1
    path)."""
    if (tpot := TPOT.of(result)) is not None:
        return tpot
    steps = list(result.decode_step_ms)
    return sum(steps) / len(steps) if steps else None


def _rows(figures: Serving) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        ("concurrency (jobs in flight per GPU)", figures.concurrency),
        ("prefill (split or whole)", figures.prefill),
        ("GPUs (devices that finished its jobs)", figures.gpus),
        ("request throughput pages/s", figures.pages_per_s),
        ("output tokens/s", figures.output_tokens_per_s),
        ("mean tokens out per page", figures.tokens_per_page),
    ]
    for label, summary in (
        ("TTFT ms", figures.ttft_ms),
        ("TPOT ms", figures.tpot_ms),
        ("ITL ms", figures.itl_ms),
        ("end-to-end ms", figures.e2e_ms),
    ):
        # As `vllm bench serve` names them: "mean TTFT ms", "p99 ITL ms".
        rows += [
            (f"mean {label}", summary.mean),
            (f"p50 {label}", summary.p50),
            (f"p90 {label}", summary.p90),
            (f"p99 {label}", summary.p99),
        ]
    rows += [
        ("p50 queue wait ms (for a slot of the batch)", figures.queue_wait_ms.p50),
        ("p90 queue wait ms", figures.queue_wait_ms.p90),
        ("mean batch occupancy", figures.occupancy.mean),
        ("pages/day per GPU", figures.pages_per_day_per_gpu),
        ("pages/day (the run's GPUs)", figures.pages_per_day),
    ]
    return rows


NOTE = "steady state of warm jobs (unless --include-cold); a day is 86,400 s of it, not a measured day"


def serving_table(data: RunData, include_cold: bool = False) -> Table:
    return Table(
        "Serving", ["measure", "value"], [list(row) for row in _rows(serving(data, include_cold))], NOTE
    )


def serving_pairs_table(a: RunData, b: RunData, include_cold: bool = False) -> Table:
    """Both runs' serving figures side by side; the throughputs' ratio with its interval (the other rows
    are each run's own distribution: a run at another concurrency has other pages in flight, not pairs)."""
    rows_a, rows_b = _rows(serving(a, include_cold)), _rows(serving(b, include_cold))
    rows = [[label, va, vb, None, None] for (label, va), (_, vb) in zip(rows_a, rows_b, strict=True)]
    ratio = throughput_ratio(b, a, include_cold)
    for row in rows:
        if row[0] == "request throughput pages/s":
            row[3:] = [ratio, verdict(ratio)]
    return Table("Serving", ["measure", "A", "B", "B/A", "verdict"], rows, NOTE)


@dataclass(frozen=True)
class BandSteps:
    """The decode steps of one occupancy band."""

    steps: int
    p50_ms: float | None
    p90_ms: float | None
    # What their attention read (steps recorded with it): KV positions per page, and the longest page's
    kv_per_page: float | None = None
    kv_longest: float | None = None


@dataclass(frozen=True)
class BatchSteps:
    """A run's batched engine steps (`batch_steps`), summed up."""

    prefill_steps: int  # a page's whole prefill in one step
    split_prefills: int  # a page's prefill in two steps (its sam and join steps)
    decode_steps: int
    profiled_steps: int  # run under torch.profiler (--profile): out of the per-step times
    mean_occupancy: float | None  # pages per decode step
    prefill_p50_ms: float | None  # of the steps that prefill: whole, sam and join
    prefill_p90_ms: float | None
    # Above the p50 where some prefills waited on the device inside their step (host contention).
    prefill_mean_ms: float | None
    decode_bands: dict[str, BandSteps]  # by OCCUPANCY_BANDS label; a band without steps is left out
    prefill_ms: float  # device time in the steps that prefill
    decode_ms: float
    wall_span_s: float | None  # the run's first claim to its last finish
    gpus: int  # devices whose engines ran the steps

    @property
    def step_s(self) -> float:
        return (self.prefill_ms + self.decode_ms) / 1e3

    @property
    def prefill_share(self) -> float | None:
        total = self.prefill_ms + self.decode_ms
        return self.prefill_ms / total if total else None

    @property
    def step_share_of_span(self) -> float | None:
        """Device time in steps per GPU over the run's wall span."""
        return self.step_s / (self.wall_span_s * self.gpus) if self.wall_span_s and self.gpus else None


def band_of(occupancy: int) -> str:
    """The OCCUPANCY_BANDS label of a step of `occupancy` pages."""
    return next(label for label, fewest, most in OCCUPANCY_BANDS if fewest <= occupancy <= most)


def batch_steps(data: RunData) -> BatchSteps:
    """Counts, occupancy and device time over every step; a step's time statistics (percentiles, the
    prefill's mean) over the steps not run under torch.profiler."""
    prefill = [s.duration_ms for s in data.steps if s.kind != "decode"]
    timed_prefill = [s.duration_ms for s in data.steps if s.kind != "decode" and not s.profiled]
    decode = [s for s in data.steps if s.kind == "decode"]
    bands: dict[str, BandSteps] = {}
    for label, fewest, most in OCCUPANCY_BANDS:
        steps = [s for s in decode if fewest <= s.occupancy <= most]
        if steps:
            p50, p90 = plain_percentiles([s.duration_ms for s in steps if not s.profiled], (50, 90))
            read = [
                (s.occupancy, s.kv_positions, s.kv_longest)
                for s in steps
                if s.kv_positions is not None and s.kv_longest is not None
            ]
            kv_per_page = sum(r[1] for r in read) / sum(r[0] for r in read) if read else None
            kv_longest = sum(r[2] for r in read) / len(read) if read else None
            bands[label] = BandSteps(len(steps), p50, p90, kv_per_page, kv_longest)
    claims = [j.started_at for j in data.jobs if j.id in data.results and j.started_at]
    finishes = [j.finished_at for j in data.jobs if j.id in data.results and j.finished_at]
    wall_span_s = (max(finishes) - min(claims)).total_seconds() if claims and finishes else None
    return BatchSteps(
        prefill_steps=sum(s.kind == "prefill" for s in data.steps),
        split_prefills=sum(s.kind == "join" for s in data.steps),
        decode_steps=len(decode),
        profiled_steps=sum(s.profiled for s in data.steps),
        mean_occupancy=sum(s.occupancy for s in decode) / len(decode) if decode else None,
        prefill_p50_ms=(quantiles := plain_percentiles(timed_prefill, (50, 90)))[0],
        prefill_p90_ms=quantiles[1],
        prefill_mean_ms=sum(timed_prefill) / len(timed_prefill) if timed_prefill else None,
        decode_bands=bands,
        prefill_ms=sum(prefill),
        decode_ms=sum(s.duration_ms for s in decode),
        wall_span_s=wall_span_s,
        gpus=len({_gpu(data, step) for step in data.steps}),
    )


def _gpu(data: RunData, step: StepTime) -> object:
    """The device a step ran on, as the Serving table counts GPUs (worker fingerprint, device); its worker
    session's id where the report lacks that session (it reads the sessions of the run's results)."""
    session = data.sessions.get(step.worker_session_id)
    return step.worker_session_id if session is None else (session.worker_id, session.device)


def _step_rows(figures: BatchSteps, bands: Iterable[str]) -> list[tuple[str, object]]:
    share, of_span = figures.prefill_share, figures.step_share_of_span
    rows: list[tuple[str, object]] = [
        ("prefill steps (a page joining whole)", figures.prefill_steps),
        ("split prefills (a page joining in a sam and a join step)", figures.split_prefills),
        ("decode steps", figures.decode_steps),
        ("profiled steps (--profile: out of the step times)", figures.profiled_steps),
        ("mean occupancy (pages per decode step)", figures.mean_occupancy),
        ("p50 prefill step ms", figures.prefill_p50_ms),
        ("p90 prefill step ms", figures.prefill_p90_ms),
        ("mean prefill step ms", figures.prefill_mean_ms),
    ]
    for label in bands:
        band = figures.decode_bands.get(label, BandSteps(0, None, None))
        rows += [
            (f"occupancy {label}: decode steps", band.steps),
            (f"occupancy {label}: p50 decode step ms", band.p50_ms),
            (f"occupancy {label}: p90 decode step ms", band.p90_ms),
            (f"occupancy {label}: KV positions a page's attention read, mean", band.kv_per_page),
            (f"occupancy {label}: the longest page's KV positions, mean", band.kv_longest),
        ]
    rows += [
        ("prefill share of the time in steps %", None if share is None else share * 100),
        ("device time in steps s", figures.step_s),
        ("wall span s (first claim to last finish)", figures.wall_span_s),
        ("time in steps per GPU, % of the wall span", None if of_span is None else of_span * 100),
    ]
    return rows


STEPS_NOTE = (
    "every step of the run's batched engines, cold ones included; percentiles of the steps themselves, "
    "without an interval (steps in flight together are no independent draws), and the prefill's mean, over "
    "the steps not run under torch.profiler (--profile); a step that served jobs of two runs (the same "
    "settings share a worker's batch) counts in both"
)


def batch_steps_table(data: RunData) -> Table:
    figures = batch_steps(data)
    rows = [list(row) for row in _step_rows(figures, figures.decode_bands)]
    return Table("Batch steps", ["measure", "value"], rows, STEPS_NOTE)


def batch_steps_pairs_table(a: RunData, b: RunData) -> Table:
    """Both runs' steps side by side, in the occupancy bands either has."""
    figures_a, figures_b = batch_steps(a), batch_steps(b)
    either = figures_a.decode_bands.keys() | figures_b.decode_bands.keys()
    bands = [label for label, _, _ in OCCUPANCY_BANDS if label in either]
    rows_a, rows_b = _step_rows(figures_a, bands), _step_rows(figures_b, bands)
    rows = [[label, va, vb] for (label, va), (_, vb) in zip(rows_a, rows_b, strict=True)]
    return Table("Batch steps", ["measure", "A", "B"], rows, STEPS_NOTE)
