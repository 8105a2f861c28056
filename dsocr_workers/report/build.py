"""Turning ledger rows into report tables: one run, or run B against run A paired per image.

Statistics come from report/stats.py (every one with its 95% interval) and throughput from
report/throughput.py. Cold results (a job that met a compilation, a new cache bucket, …) are left out
of every latency statistic and of steady-state throughput unless `include_cold`; the report counts
them by reason.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsocr_workers.report.queries import RunData
from dsocr_workers.report.stats import Estimate, Summary, paired_ratios, rate_sum
from dsocr_workers.report.throughput import (
    lane_key,
    service_times_s,
    steady_state_throughput,
    throughput_ratio,
    wall_clock_s,
)
from dsocr_workers.store.models import Result

RANDOM_WEIGHTS_WARNING = (
    "RANDOM WEIGHTS: run {run} used the preset {model}; timings are real, the text and boxes are meaningless"
)
NO_DIFFERENCE = "no significant difference"
MIB = 2**20


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]  # cells: str, int, float, None, or an Estimate (value with its interval)


@dataclass
class Report:
    title: str
    warnings: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


@dataclass(frozen=True)
class Metric:
    label: str
    values: Callable[[Result], list[float]]  # one job's values: one, none (not measured) or its decode steps


def _column(name: str, scale: float = 1.0) -> Callable[[Result], list[float]]:
    return lambda r: [] if getattr(r, name) is None else [getattr(r, name) * scale]


LATENCY = [
    Metric("TTFT ms", _column("ttft_ms")),
    Metric("preprocess ms", _column("preprocess_ms")),
    Metric("prefill ms", _column("prefill_ms")),
    Metric("vision ms", _column("vision_ms")),
    Metric("  sam ms", _column("sam_ms")),
    Metric("  clip ms", _column("clip_ms")),
    Metric("  projector ms", _column("projector_ms")),
    Metric("lm prefill ms", _column("lm_prefill_ms")),
    Metric("decode ms/token", lambda r: list(r.decode_step_ms)),  # kept steps, pooled over jobs
    Metric("decode ms", _column("decode_ms")),
    Metric("end-to-end ms", _column("e2e_ms")),
]
OUTPUT = [
    Metric("tokens out", _column("decode_tokens")),
    Metric("wasted steps", _column("wasted_steps")),  # computed after EOS, discarded
    Metric("boxes per page", _column("box_count")),
]
# Per job, allocator statistics reset at its start; CUDA only, so a CPU run shows none of these rows.
MEMORY = [
    Metric("peak memory MiB", _column("peak_memory_bytes", 1 / MIB)),
    Metric("  weights MiB", _column("weights_bytes", 1 / MIB)),
    Metric("  KV cache MiB", _column("kv_cache_bytes", 1 / MIB)),
    Metric("  activation peak MiB", _column("activation_peak_bytes", 1 / MIB)),
]
# The parts of e2e, in the order they happen (engine/result.py StageTimings: their sum is e2e_ms).
PARTS = [
    ("preprocess", "preprocess_ms"),
    ("setup", "setup_ms"),
    ("prefill", "prefill_ms"),
    ("first token", "first_token_ms"),
    ("decode", "decode_ms"),
    ("wasted decode", "wasted_decode_ms"),
    ("readback", "readback_ms"),
    ("postprocess", "postprocess_ms"),
    ("host gap", "host_gap_ms"),
]


def measured(data: RunData, include_cold: bool) -> list[Result]:
    """The results statistics are computed over, in job order: warm ones unless `include_cold`."""
    results = (data.results.get(j.id) for j in data.jobs)
    return [r for r in results if r is not None and (include_cold or not r.cold)]


def summarize(metric: Metric, results: list[Result]) -> Summary:
    return Summary.from_jobs([metric.values(r) for r in results])


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


def run_facts(data: RunData, include_cold: bool) -> dict[str, Any]:
    counts = Counter(j.state for j in data.jobs)
    cold = sum(r.cold for r in data.results.values())
    return {
        "run": data.run.id,
        "name": data.run.name,
        "model": data.run.model_label,
        "created": data.run.created_at.isoformat(sep=" ", timespec="seconds"),
        "file list": data.run.filelist,
        "parameters": ", ".join(f"{k}={v}" for k, v in sorted(data.run.parameters.items()) if v is not None),
        "tags": ", ".join(f"{k}={v}" for k, v in sorted(data.run.tags.items())),
        "jobs": len(data.jobs),
        "ok": counts.get("done", 0),
        "failed": counts.get("failed", 0),
        "poisoned": counts.get("poisoned", 0),
        "not finished": sum(counts.get(s, 0) for s in ("pending", "queued", "running")),
        "results": len(data.results),
        "cold results": cold,
        "left out of statistics": 0 if include_cold else cold,
    }


def _throughput(data: RunData, include_cold: bool) -> dict[str, Any]:
    wall = wall_clock_s(data)
    done = len(data.results)
    return {
        "pages/s (steady state)": steady_state_throughput(data, include_cold),
        "wall clock s (submit to last result)": wall,
        "pages/s (wall clock)": done / wall if wall else None,
    }


def _warnings(*runs: RunData) -> list[str]:
    return [
        RANDOM_WEIGHTS_WARNING.format(run=d.run.id, model=d.run.model)
        for d in runs
        if d.run.random_weights or any(r.random_weights for r in d.results.values())
    ]


def single_report(data: RunData, *, per_image: bool = False, include_cold: bool = False) -> Report:
    results = measured(data, include_cold)
    report = Report(f"dsocr report: run {data.run.id} ({data.run.name})", _warnings(data))
    facts = run_facts(data, include_cold)
    report.tables.append(Table("Run", ["field", "value"], [[k, v] for k, v in facts.items()]))
    throughput = _throughput(data, include_cold)
    report.tables.append(Table("Throughput", ["measure", "value"], [[k, v] for k, v in throughput.items()]))
    rows = []
    for metric in LATENCY + OUTPUT + MEMORY:
        s = summarize(metric, results)
        if s.n or metric not in MEMORY:
            rows.append([metric.label, s.jobs, s.n, s.mean, s.p50, s.p90, s.p99])
    columns = ["metric", "jobs", "n", "mean", "p50", "p90", "p99"]
    report.tables.append(Table("Latency and output", columns, rows))
    report.tables.append(_accounting(results))
    if facts["cold results"]:
        report.tables.append(_cold(data, include_cold))
    report.tables.append(_sessions(data, include_cold))
    report.tables.append(_environment(data))
    failures = [
        [j.image, j.repeat, j.state, j.attempts, j.last_error_class, j.last_error_message]
        for j in data.jobs
        if j.state in ("failed", "poisoned")
    ]
    if failures:
        report.tables.append(
            Table("Failures", ["image", "repeat", "state", "attempts", "error", "message"], failures)
        )
    if per_image:
        report.tables.append(_per_image(data))
    return report


def _accounting(results: list[Result]) -> Table:
    """Mean per job of each part of e2e: means add up, so the parts' column sums to the e2e row."""
    e2e = Summary.from_values([r.e2e_ms for r in results]).mean

    def share(mean: float | None) -> float | None:
        return None if mean is None or not e2e.value else 100 * mean / e2e.value

    parts = [(label, Summary.from_values([getattr(r, name) for r in results]).mean) for label, name in PARTS]
    total = sum(mean.value for _, mean in parts if mean.value is not None) if results else None
    rows: list[list[Any]] = [[label, mean, share(mean.value)] for label, mean in parts]
    rows.append(["sum of parts", total, share(total)])
    rows.append(["end-to-end", e2e, share(e2e.value)])
    return Table("Accounting: parts of end-to-end", ["part", "mean ms", "share of e2e %"], rows)


def _cold(data: RunData, include_cold: bool) -> Table:
    reasons = Counter(r.cold_reason or "(no reason recorded)" for r in data.results.values() if r.cold)
    in_statistics = "yes (--include-cold)" if include_cold else "no (--include-cold puts them back)"
    rows = [[reason, count, in_statistics] for reason, count in reasons.most_common()]
    return Table("Cold results", ["reason", "jobs", "in statistics"], rows)


def _sessions(data: RunData, include_cold: bool) -> Table:
    """One row per worker process (a lane: one device), with what loading and warming its model(s) cost
    (its worker sessions); results older than sessions are grouped by worker fingerprint."""
    grouped: dict[str, list[Result]] = defaultdict(list)
    for r in data.results.values():
        grouped[lane_key(data, r)].append(r)
    times = service_times_s(data, include_cold)
    rows = []
    for key, results in sorted(grouped.items()):
        ids = dict.fromkeys(r.worker_session_id for r in results if r.worker_session_id in data.sessions)
        sessions = [data.sessions[i] for i in ids if i is not None]
        first, w = (sessions[0] if sessions else None), data.workers.get(results[0].worker_id)
        counted = [r for r in results if include_cold or not r.cold]
        rows.append(
            [
                first.host if first else w.host if w else None,
                first.pid if first else None,
                first.device if first else results[0].device,
                first.engine if first else results[0].engine,
                len(sessions),
                sum(s.load_ms or 0 for s in sessions) / 1000 if sessions else None,
                sum(s.warmup_ms or 0 for s in sessions) / 1000 if sessions else None,
                "; ".join(s.warmup for s in sessions if s.warmup) or None,
                len(results),
                sum(r.cold for r in results),
                rate_sum([times.get(key, [])]),
                Summary.from_values([r.e2e_ms for r in counted]).p50,
            ]
        )
    columns = ["host", "pid", "device", "engine", "sessions", "load s", "warm-up s", "warm-up", "jobs",
               "cold jobs", "pages/s (steady state)", "e2e p50 ms"]  # fmt: skip
    return Table("Worker processes", columns, rows)


def _environment(data: RunData) -> Table:
    columns = ["worker", "host", "device", "GPU", "GPU UUID", "driver", "CUDA", "torch", "transformers", "python",
               "dsocr", "git", "model"]  # fmt: skip
    rows = [
        [
            w.id[:12],
            w.host,
            w.device,
            w.gpu_name,
            w.gpu_uuid,
            w.driver,
            w.cuda,
            w.torch,
            w.transformers,
            w.python,
            w.project_version,
            (w.git_sha or "")[:12],
            w.model_label,
        ]  # fmt: skip
        for w in sorted(data.workers.values(), key=lambda w: w.id)
    ]
    return Table("Environment", columns, rows)


def _per_image(data: RunData) -> Table:
    rows = []
    for j in data.jobs:
        r = data.results.get(j.id)
        peak = r.peak_memory_bytes if r else None
        rows.append(
            [j.image, j.repeat, j.state, j.attempts] + (
                [r.device, (r.worker_session_id or r.worker_id)[:12], r.ttft_ms, r.prefill_ms, r.decode_tokens, r.wasted_steps,
                 r.decode_ms_per_token_p50, r.e2e_ms, None if peak is None else peak / MIB, r.box_count,
                 r.cold_reason if r.cold else None, r.stop_reason]
                if r else [None] * 11 + [j.last_error_class]
            )
        )  # fmt: skip
    columns = ["image", "repeat", "state", "attempts", "device", "session", "TTFT ms", "prefill ms", "tokens",
               "wasted steps", "ms/token p50", "e2e ms", "peak MiB", "boxes", "cold", "stop / error"]  # fmt: skip
    return Table("Per image", columns, rows)


def _by_image(data: RunData, results: list[Result]) -> dict[tuple[str, int], Result]:
    jobs = {j.id: j for j in data.jobs}
    return {(jobs[r.job_id].image, jobs[r.job_id].repeat): r for r in results}


def comparison_report(
    a: RunData, b: RunData, *, per_image: bool = False, include_cold: bool = False
) -> Report:
    """B against A. Latency over the (image, repeat) pairs measured in both runs, ratios B/A with the
    interval of a paired bootstrap; throughput from each run's steady state."""
    report = Report(f"dsocr report: run {b.run.id} (B) vs {a.run.id} (A)", _warnings(a, b))
    facts_a, facts_b = run_facts(a, include_cold), run_facts(b, include_cold)
    report.tables.append(Table("Runs", ["field", "A", "B"], [[k, facts_a[k], facts_b[k]] for k in facts_a]))
    throughput_a, throughput_b = _throughput(a, include_cold), _throughput(b, include_cold)
    rows = [[k, throughput_a[k], throughput_b[k], None, None] for k in throughput_a]
    ratio = throughput_ratio(b, a, include_cold)
    rows[0][3:] = [ratio, verdict(ratio)]  # only the steady state is compared: wall clock includes loading
    report.tables.append(Table("Throughput", ["measure", "A", "B", "B/A", "verdict"], rows))

    by_a, by_b = _by_image(a, measured(a, include_cold)), _by_image(b, measured(b, include_cold))
    pairs = sorted(set(by_a) & set(by_b))
    paired_a, paired_b = [by_a[k] for k in pairs], [by_b[k] for k in pairs]
    rows = []
    for metric in LATENCY + MEMORY[:1]:
        sa, sb = summarize(metric, paired_a), summarize(metric, paired_b)
        if not (sa.n or sb.n):
            continue
        ratios = paired_ratios([metric.values(r) for r in paired_b], [metric.values(r) for r in paired_a])
        rows.append([metric.label, "mean", len(pairs), sa.mean, sb.mean, ratios.mean, verdict(ratios.mean)])
        rows.append([metric.label, "p50", len(pairs), sa.p50, sb.p50, ratios.p50, verdict(ratios.p50)])
    columns = ["metric", "statistic", "pairs", "A", "B", "B/A", "verdict"]
    report.tables.append(Table("Paired latency", columns, rows))

    all_a, all_b = _by_image(a, list(a.results.values())), _by_image(b, list(b.results.values()))
    report.tables.append(_agreement(all_a, all_b))
    if per_image:
        report.tables.append(_per_image_pairs(all_a, all_b))
    return report


def _agreement(by_a: dict[tuple[str, int], Result], by_b: dict[tuple[str, int], Result]) -> Table:
    """Every result, cold or not: outputs do not depend on warm-up."""
    pairs = sorted(set(by_a) & set(by_b))
    identical = sum(by_a[k].markup == by_b[k].markup for k in pairs)
    deltas = [by_b[k].box_count - by_a[k].box_count for k in pairs]
    rows: list[list[Any]] = [
        ["paired images", len(pairs)],
        ["only in A", len(set(by_a) - set(by_b))],
        ["only in B", len(set(by_b) - set(by_a))],
        ["identical markup %", 100.0 * identical / len(pairs) if pairs else None],
        ["box count delta B-A (mean)", float(np.mean(deltas)) if deltas else None],
        ["box count |delta| (mean)", float(np.mean(np.abs(deltas))) if deltas else None],
        ["images with a different box count", sum(d != 0 for d in deltas)],
    ]
    return Table("Output agreement", ["measure", "value"], rows)


def _per_image_pairs(by_a: dict[tuple[str, int], Result], by_b: dict[tuple[str, int], Result]) -> Table:
    rows = []
    for key in sorted(set(by_a) & set(by_b)):
        ra, rb = by_a[key], by_b[key]
        rows.append(
            [*key, ra.e2e_ms, rb.e2e_ms, rb.e2e_ms / ra.e2e_ms if ra.e2e_ms else None, ra.cold, rb.cold,
             ra.decode_tokens, rb.decode_tokens, ra.markup == rb.markup, ra.box_count, rb.box_count]
        )  # fmt: skip
    columns = ["image", "repeat", "A e2e ms", "B e2e ms", "B/A", "A cold", "B cold", "A tokens", "B tokens",
               "same markup", "A boxes", "B boxes"]  # fmt: skip
    return Table("Per image", columns, rows)
