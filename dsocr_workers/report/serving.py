"""The serving table (issue 34): a run as the serving benchmarks print one (`vllm bench serve`, AIPerf):
request throughput, output tokens/s, TTFT, TPOT, inter-token latency and end-to-end, with the batch the
jobs decoded in, and what it makes a day per GPU and for the run's GPUs together.

Throughput is the run's steady state (report/throughput.py: per worker process 1 / mean service time,
summed; at --concurrency above 1 a job's service time runs from the previous finish on its lane, so the
sum is the lane's finishing rate), with its 95% interval; output tokens/s is that rate times the mean
tokens out of a page. TTFT is the job's (for a batched job from its claim to its first token, which holds
its page's preparation and its wait for a slot), TPOT its time per output token after the first,
ITL every gap between two of its tokens, pooled over jobs. A day is 86,400 s of that steady state: the
rate a fleet of warm workers with a full queue would keep, not a measured day.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsocr_workers.report.queries import RunData
from dsocr_workers.report.stats import Estimate, Summary
from dsocr_workers.report.tables import Table, verdict
from dsocr_workers.report.throughput import steady, steady_state_throughput, throughput_ratio
from dsocr_workers.stages import BY_COLUMN
from dsocr_workers.store.models import Result

TTFT, TPOT, E2E, QUEUE_WAIT = (BY_COLUMN[c] for c in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_wait_ms"))

SECONDS_PER_DAY = 86_400
# Beside the stage registry's figures (TTFT, TPOT, end-to-end, queue wait: the legend has them from there).
TERMS = [
    ("ITL", "inter-token latency: every gap between two consecutive tokens of a job, pooled over jobs"),
    ("batch occupancy", "pages decoding in a job's batch per decode step, averaged over its steps (1 on the "
                        "batch-1 path)"),
    ("pages/day", "steady-state pages/s x 86,400: what warm workers with a full queue keep up, per GPU and for "
                  "the run's GPUs together"),
]  # fmt: skip


@dataclass(frozen=True)
class Serving:
    concurrency: int  # the run's --concurrency
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


def serving(data: RunData, include_cold: bool = False) -> Serving:
    results = [r for r in data.results.values() if steady(r, include_cold)]
    gpus = len({(r.worker_id, r.device) for r in data.results.values()})  # worker: a host's environment
    tokens = [r.decode_tokens for r in results]

    def each(read) -> Summary:  # type: ignore[no-untyped-def]
        return Summary.from_values([read(r) for r in results])

    return Serving(
        concurrency=int((data.run.parameters or {}).get("concurrency", 1)),
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
    """Its TPOT; for rows written before the column, the mean kept decode step (the same on the batch-1 path)."""
    if (tpot := TPOT.of(result)) is not None:
        return tpot
    steps = list(result.decode_step_ms)
    return sum(steps) / len(steps) if steps else None


def _rows(figures: Serving) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        ("concurrency (jobs in flight per GPU)", figures.concurrency),
        ("GPUs (devices that finished its jobs)", figures.gpus),
        ("request throughput pages/s", figures.pages_per_s),
        ("output tokens/s", figures.output_tokens_per_s),
        ("mean tokens out per page", figures.tokens_per_page),
    ]
    for label, summary in (("TTFT ms", figures.ttft_ms), ("TPOT ms", figures.tpot_ms), ("ITL ms", figures.itl_ms),
                           ("end-to-end ms", figures.e2e_ms)):  # fmt: skip
        # As `vllm bench serve` names them: "mean TTFT ms", "p99 ITL ms".
        rows += [(f"mean {label}", summary.mean), (f"p50 {label}", summary.p50), (f"p90 {label}", summary.p90),
                 (f"p99 {label}", summary.p99)]  # fmt: skip
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
    return Table("Serving", ["measure", "value"], [list(row) for row in _rows(serving(data, include_cold))], NOTE)


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
