"""Throughput, both ways users mean it. A page is a job: one (image, repeat).

Steady state: pages/s while warmed workers are busy (what `--vs` compares). Per lane, job i's service time
is d_i = finished_i − max(waiting_i, free_i, ready_at of its worker session): loading, warm-up, an empty
queue and the lane's work for other runs never count; the farm's own time between two jobs does. A
lane's rate is 1 / mean(d) over its warm jobs, the run's the sum of its lanes'. A batched run's jobs
overlap, so a lane's rate is its steps' output tokens over its steady window (first finish to last
claim) over the mean tokens per page, with an interval from bins of at least one batch turnover (the
method of batch means: the rate rises and falls with a period of one turnover).

Wall clock: from the run's creation to its last result. The device between jobs (batch-1 path only):
its idle time between a lane's jobs, its time per page, and its share of a job's service time.
Benchmarks import `steady_state_throughput`, `throughput_ratio`, `wall_clock_s`, `device_idle_ms`,
`device_ms_per_page`, `device_busy_share` from here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from dsocr_workers.report.queries import RunData
from dsocr_workers.report.stats import BinnedRates, Estimate, paired_ratios, rate_sum, rate_sum_ratio
from dsocr_workers.store.models import Job, Result, WorkerSession


def lane_key(data: RunData, result: Result) -> str:
    """The worker process behind a result, or its worker fingerprint for results older than sessions."""
    worker_session = data.sessions.get(result.worker_session_id or "")
    return _process_lane(worker_session) if worker_session is not None else result.worker_id


def _process_lane(worker_session: WorkerSession) -> str:
    return f"{worker_session.host}:{worker_session.pid}:{worker_session.device}"


def waiting_since(job: Job) -> datetime:
    """When the job's message was (last) put on its queue (its row's creation for older ledgers), or its
    claim if that came first (a worker can take a message before `submit` marks its batch queued)."""
    queued = job.queued_at or job.created_at
    return min(queued, job.started_at) if job.started_at is not None else queued


@dataclass(frozen=True)
class Service:
    """One finished job on its lane, from when its worker could begin it to when it finished."""

    job: Job
    result: Result
    began: datetime  # max(started, the lane's previous finish, ready_at of the job's session)
    finished: datetime


def services(data: RunData) -> dict[str, list[Service]]:
    """Per lane, every job with a result and both timestamps, in the order they finished (cold ones too:
    a cold job still occupies its worker)."""
    # (finished, started, ready_at of its session, job, result) of every job with a result, per lane
    by_lane: dict[str, list[tuple[datetime, datetime, datetime | None, Job, Result]]] = defaultdict(list)
    for job in data.jobs:
        result = data.results.get(job.id)
        if result is not None and job.started_at is not None and job.finished_at is not None:
            worker_session = data.sessions.get(result.worker_session_id or "")
            ready_at = worker_session.ready_at if worker_session is not None else None
            by_lane[lane_key(data, result)].append((job.finished_at, job.started_at, ready_at, job, result))
    elsewhere: dict[str, list[datetime]] = defaultdict(list)  # per lane, finishes of other runs' jobs
    for session_id, finishes in data.elsewhere.items():
        if (worker_session := data.sessions.get(session_id)) is not None:
            elsewhere[_process_lane(worker_session)].extend(finishes)
    lanes: dict[str, list[Service]] = {}
    for key, done in by_lane.items():
        lanes[key] = []
        others = sorted(elsewhere.get(key, []))
        free_at: datetime | None = None  # this run's previous finish on the lane
        for finished, started, ready_at, job, result in sorted(done, key=lambda item: item[0]):
            before = bisect_right(others, started)  # other runs' jobs this lane finished before the claim
            other = others[before - 1] if before else None
            began = max(t for t in (waiting_since(job), free_at, other, ready_at) if t is not None)
            lanes[key].append(Service(job, result, began, finished))
            free_at = finished
    return lanes


def steady(result: Result, include_cold: bool) -> bool:
    """Whether a job's own times count in the steady state: warm unless `include_cold`, and never a
    profiled job (torch.profiler's cost is in its times)."""
    return (include_cold or not result.cold) and not result.profiled


# A batched lane's steady window is cut into bins of at least one turnover and this many seconds, and
# at least MIN_BINS of them.
STEADY_BIN_S = 1.0
MIN_BINS = 8


def service_times_s(data: RunData, include_cold: bool = False) -> dict[str, list[float]]:
    """Per lane, the service times (seconds) of its finished jobs, as defined above; for a lane of a
    batched run, its pages/s in the bins of its steady window (`BinnedRates`) where it has one."""
    lanes = services(data)
    times = {
        key: [(s.finished - s.began).total_seconds() for s in lane if steady(s.result, include_cold)]
        for key, lane in lanes.items()
    }
    binned = batched_rates(data, include_cold, lanes)
    return {key: binned.get(key, lane) for key, lane in times.items()}


def batched_rates(
    data: RunData, include_cold: bool = False, lanes: dict[str, list[Service]] | None = None
) -> dict[str, BinnedRates]:
    """Per lane of a batched run, its pages/s in each bin of its steady window, as defined above (lanes
    with no steps, or no window: the last claim before the first finish, are left out).
    `lanes`: the run's `services`, where the caller has them."""
    if not data.steps:
        return {}
    lanes = services(data) if lanes is None else lanes
    steps_by_lane: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    slots: dict[str, int] = defaultdict(int)  # per lane, the most pages a decode step held
    for step in data.steps:
        worker_session = data.sessions.get(step.worker_session_id)
        if worker_session is not None:
            on = _process_lane(worker_session)
            steps_by_lane[on].append((step.ended_at, step.occupancy))  # tokens chosen: `StepRecord.occupancy`
            if step.kind == "decode":
                slots[on] = max(slots[on], step.occupancy)
    rates: dict[str, BinnedRates] = {}
    for key, lane in lanes.items():
        kept = [s for s in lane if steady(s.result, include_cold)]
        tokens_per_page = np.mean([s.result.decode_tokens for s in kept]) if kept else 0.0
        claims = [s.job.started_at for s in lane if s.job.started_at is not None]
        if not kept or not claims or tokens_per_page <= 0:
            continue
        start, end = min(s.finished for s in lane), max(claims)
        window_s = (end - start).total_seconds()
        if window_s <= 0:
            continue
        offsets = [((ended - start).total_seconds(), count) for ended, count in steps_by_lane.get(key, [])]
        offsets = [(offset, count) for offset, count in offsets if 0 < offset <= window_s]
        pages = float(sum(count for _, count in offsets) / tokens_per_page)
        if pages <= 0:
            continue
        turnover = turnover_s(slots[key], pages / window_s)
        bins = max(MIN_BINS, int(window_s / max(STEADY_BIN_S, turnover)))
        tokens = np.zeros(bins)
        for offset, count in offsets:
            tokens[min(int(offset / window_s * bins), bins - 1)] += count
        rates[key] = BinnedRates((tokens / (window_s / bins) / tokens_per_page).tolist())
    return rates


def turnover_s(slots: int, pages_per_s: float) -> float:
    """The time a batch of `slots` pages takes to finish that many pages at `pages_per_s` (Little's law:
    a page's time in a full batch): the period of a batch whose pages joined together."""
    return max(slots, 1) / pages_per_s


def steady_state_throughput(data: RunData, include_cold: bool = False) -> Estimate:
    """Pages/s of the run's warmed workers together, with its 95% interval; `n` counts the jobs."""
    return rate_sum(list(service_times_s(data, include_cold).values()))


def throughput_ratio(b: RunData, a: RunData, include_cold: bool = False) -> Estimate:
    """Steady-state pages/s of run B over run A, with its 95% interval."""
    return rate_sum_ratio(
        list(service_times_s(b, include_cold).values()), list(service_times_s(a, include_cold).values())
    )


def device_idle_ms(data: RunData) -> dict[str, list[float]]:
    """Per lane, the device's idle milliseconds from one job's end on the device to the next one's start,
    between jobs of one worker session whose next job was in the ledger before the previous one ended."""
    jobs = {j.id: j for j in data.jobs}
    # (device start, device end, result) of every result that has them, per lane
    by_lane: dict[str, list[tuple[datetime, datetime, Result]]] = defaultdict(list)
    for r in data.results.values():
        if r.device_started_at is not None and r.device_finished_at is not None and r.batch_occupancy is None:
            by_lane[lane_key(data, r)].append((r.device_started_at, r.device_finished_at, r))
    idle: dict[str, list[float]] = {}
    for key, spans in by_lane.items():
        ordered = sorted(spans, key=lambda span: span[0])
        idle[key] = [
            (started - finished).total_seconds() * 1e3
            for (_, finished, before), (started, _, after) in zip(ordered, ordered[1:], strict=False)
            if after.worker_session_id == before.worker_session_id
            and waiting_since(jobs[after.job_id]) <= finished
        ]
    return idle


def device_ms_per_page(data: RunData, include_cold: bool = False) -> dict[str, list[float]]:
    """Per lane, each job's milliseconds on the device (setup start to readback end), warm jobs unless
    `include_cold`."""
    spans: dict[str, list[float]] = defaultdict(list)
    for r in data.results.values():
        started, finished = r.device_started_at, r.device_finished_at
        if (
            started is not None
            and finished is not None
            and steady(r, include_cold)
            and r.batch_occupancy is None
        ):
            spans[lane_key(data, r)].append((finished - started).total_seconds() * 1e3)
    return dict(spans)


def device_busy_share(data: RunData, lane: str | None = None) -> Estimate:
    """Σ device time / Σ service time over the warm jobs that began when the job before them on their lane
    finished, of every lane or of `lane`, with the interval of a paired bootstrap (each job's two times
    resampled together); `n` counts the jobs."""
    device_s, service_s = [], []
    for key, lane_services in services(data).items():
        if lane is not None and key != lane:
            continue
        for before, s in zip(lane_services, lane_services[1:], strict=False):
            r = s.result
            if (
                not steady(r, False)
                or r.device_started_at is None
                or r.device_finished_at is None
                or r.batch_occupancy is not None
                or s.began != before.finished
                or r.worker_session_id != before.result.worker_session_id
            ):
                continue
            device_s.append([(r.device_finished_at - r.device_started_at).total_seconds()])
            service_s.append([(s.finished - s.began).total_seconds()])
    return paired_ratios(device_s, service_s).mean


def wall_clock_s(data: RunData) -> float | None:
    """Seconds from the run's creation (submit) to its last result; None before the first result."""
    ends = [j.finished_at for j in data.jobs if j.id in data.results and j.finished_at is not None]
    return (max(ends) - data.run.created_at).total_seconds() if ends else None
