"""Trust benchmark (issue 8 items 3, 5 and 8): can the engine's numbers be believed, and how many repeats do they need?

One process, one GPU, one page (the synthetic 1600x2000 page of bench_engine / ../shared/anchors.md:
gundam, 2x3 tiles), the `full` preset (RANDOM weights) in bf16, per engine (default eager, then fast):

  load, warm-up jobs (reported apart), then, each section bounded in time:
  2. Instrumentation on vs off. Interleaved pairs of whole jobs, the order inside each pair drawn at
     random; "on" = StageClock(nvtx_enabled=True, timing_enabled=True), "off" = both False (no NVTX
     range, no CUDA event, no per-step mark). Host wall time per job between two synchronisations (a
     job ends with its read-back anyway). Statistic: the mean over pairs of on/off - 1; its 95% interval
     is the wider envelope of a BCa bootstrap (scipy.stats.bootstrap) and a t interval. Verdict:
     "<=2% shown" only if the upper bound is below 2%; ">2% shown" if the lower bound is above 2%;
     otherwise "unresolved (noise +-x%)" with x the interval's half-width.
  3. EOS path cost. Pairs (random order) of: EOS forced at decode step N (the step hook `force_eos_at(N)`,
     max_new_tokens = the rest of the same KV-cache bucket, so EOS is what stops it) vs ignore_eos with
     max_new_tokens = N + 1 (the same N kept steps, no EOS check). Per arm: e2e, host wall, decode ms
     (kept steps), wasted steps and wasted_decode_ms, readback ms; the paired difference (forced - ignore)
     with 95% intervals as above.
  1. Timing cross-check (run last: an attached profiler can leave costs behind). Jobs under
     torch.profiler (CPU + CUDA activities) with a StageClock subclass that also opens a
     `record_function("dsocr::<stage>")` around each stage. Per stage, the GPU work of the stage is the
     kernels / memcpys / memsets whose launch (CUDA runtime or driver call, matched by correlation id)
     happened inside the stage's range on the host; the profiler's stage time is their SPAN, from the
     first one's start to the last one's end (the busy time, the union of their intervals, is shown too,
     and kineto's own gpu_user_annotation span where the trace has it). Ratio = CUDA-event ms / span;
     PASS within 5% for stages of at least --xcheck-min-ms (shorter ones: launch latency and event
     granularity dominate; shown, not judged). A second ratio uses the stage rebuilt from the trace's
     cudaEventRecord calls (the "window", see stage_gpu_times), which adds the GPU's idle time at the
     stage's edges; both verdicts are printed. The first profiled job is a profiler warm-up, discarded.
  4. Repeats needed for a +-2% 95% interval on decode ms/token: from the instrumented jobs of section 2,
     one value per job (the median of its per-step ms), the normal approximation with a t quantile:
     the smallest n with t(0.975, n-1) * CV / sqrt(n) <= 2% (CV = sd / mean over jobs); checked with the
     bootstrap: the median 95% half-width of the mean over random subsets of n jobs, n up to the jobs run.
     Jobs of one process on one GPU: run-to-run (process, host, other tenants) noise is not in it.

Every section is written to --out (default $OUT, else benchmarks/results) as trust-<UTC date>.json/.md
as soon as it ends; a failing section records its error and the rest go on. Jobs flagged cold by the
engine (InferenceResult.cold_reasons) are left out of the statistics and counted.

    python benchmarks/bench_trust.py --budget-s 390                      # one H200, ~7 minutes
    python benchmarks/bench_trust.py --device cpu --model tiny --tokens 8 --xcheck-tokens 4 \
        --eos-step 4 --budget-s 120                                       # CPU smoke of the script
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import gc
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, environment_line, fmt, synthetic_page  # noqa: E402
from dsocr_workers.engine.clock import HOST_STAGES, STAGES, StageClock  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions  # noqa: E402

ANNOTATION = "dsocr::"
# Same-length timing jobs: no n-gram ban (as bench_engine and the anchors' vendor decode).
PLAIN = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)
WARMUP = {"eager": 1, "fast": 2}
TOLERANCE_XCHECK = 0.05
TARGET_OVERHEAD = 0.02
TARGET_HALF_WIDTH = 0.02
CONFIDENCE = 0.95
SEED = 20261123
# Share of an engine's time (after load and warm-up) per section, in the order they run.
SECTION_WEIGHTS = {"instrumentation": 0.45, "eos_path": 0.35, "timing_crosscheck": 0.20}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


class ProfiledClock(StageClock):
    """The engine's StageClock, plus one profiler range per stage so the trace knows the stages."""

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with record_function(f"{ANNOTATION}{name}"), super().stage(name):
            yield


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_job(
    session: Any, page: Path, args: argparse.Namespace, tokens: int, options: DecodeOptions,
    clock: StageClock | None = None, after_step: Any = None,
) -> tuple[Any, float]:
    """One job and its host wall ms between two synchronisations."""
    sync()
    start = time.perf_counter()
    result = session.run_inference(page, mode=args.mode, max_new_tokens=tokens, infer=options, clock=clock,
                                   after_step=after_step)  # fmt: skip
    sync()
    return result, (time.perf_counter() - start) * 1e3


def cold(result: Any) -> list[str]:
    return list(getattr(result, "cold_reasons", ()) or ())


def median_step_ms(result: Any) -> float | None:
    steps = result.timings.decode_step_ms
    return float(statistics.median(steps)) if steps else None


# ---------------------------------------------------------------------------------------------------
# statistics (scipy.stats: no hand-written resampling)


def _bootstrap(values: np.ndarray, method: str) -> tuple[float, float] | None:
    kwargs: dict[str, Any] = {"confidence_level": CONFIDENCE, "n_resamples": 9999, "method": method}
    with np.errstate(all="ignore"):
        try:
            result = stats.bootstrap((values,), np.mean, rng=np.random.default_rng(SEED), **kwargs)
        except TypeError:  # scipy < 1.15 names the generator random_state
            result = stats.bootstrap((values,), np.mean, random_state=np.random.default_rng(SEED), **kwargs)
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return (low, high) if math.isfinite(low) and math.isfinite(high) else None


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean with a 95% interval: the envelope of the BCa bootstrap and the t interval (the wider wins,
    so a small sample's optimistic bootstrap cannot make a verdict on its own)."""
    x = np.asarray(values, dtype=float)
    out: dict[str, Any] = {"n": int(x.size)}
    if x.size == 0:
        return out
    out.update(mean=float(x.mean()), median=float(np.median(x)), min=float(x.min()), max=float(x.max()))
    if x.size < 3 or float(np.ptp(x)) == 0.0:
        out["ci"] = None
        out["ci_note"] = "fewer than 3 values or no spread: no interval"
        return out
    out["sd"] = float(x.std(ddof=1))
    boot = _bootstrap(x, "BCa") or _bootstrap(x, "percentile")
    sem = float(stats.sem(x))
    t_low, t_high = stats.t.interval(CONFIDENCE, x.size - 1, loc=float(x.mean()), scale=sem)
    out["bootstrap_ci"] = list(boot) if boot else None
    out["t_ci"] = [float(t_low), float(t_high)]
    lows = [float(t_low)] + ([boot[0]] if boot else [])
    highs = [float(t_high)] + ([boot[1]] if boot else [])
    out["ci"] = [min(lows), max(highs)]
    return out


def threshold_verdict(ci: dict[str, Any], target: float, what: str) -> str:
    """'<= target shown' only when the whole interval is below it; never a verdict the data cannot carry."""
    interval = ci.get("ci")
    if not interval:
        return f"unresolved ({ci.get('ci_note', 'no interval')})"
    low, high = interval
    if high < target:
        return f"≤{100 * target:g}% shown ({what} 95% CI {100 * low:+.2f}% .. {100 * high:+.2f}%)"
    if low > target:
        return f">{100 * target:g}% shown ({what} 95% CI {100 * low:+.2f}% .. {100 * high:+.2f}%)"
    return f"unresolved (noise ±{100 * (high - low) / 2:.2f}%; 95% CI {100 * low:+.2f}% .. {100 * high:+.2f}%)"


def difference_verdict(ci: dict[str, Any], unit: str = "ms") -> str:
    interval = ci.get("ci")
    if not interval:
        return f"no interval ({ci.get('ci_note', '')})"
    low, high = interval
    if low <= 0 <= high:
        return f"no significant difference (95% CI {low:+.3f} .. {high:+.3f} {unit})"
    return f"{ci['mean']:+.3f} {unit} (95% CI {low:+.3f} .. {high:+.3f} {unit})"


def repeats_needed(values: list[float], target: float = TARGET_HALF_WIDTH) -> dict[str, Any]:
    """Jobs needed for a +-target relative 95% interval on the mean of per-job values."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict[str, Any] = {"jobs": int(x.size), "target_half_width": target, "values": x.tolist()}
    if x.size < 3:
        out["note"] = "fewer than 3 jobs"
        return out
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    cv = sd / mean if mean else float("inf")
    out.update(mean=mean, sd=sd, cv=cv)
    n_needed = None
    for n in range(2, 100_000):
        if stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * cv / math.sqrt(n) <= target:
            n_needed = n
            break
    out["n_needed_t_approx"] = n_needed
    out["half_width_at_jobs_run_t"] = float(stats.t.ppf(0.5 + CONFIDENCE / 2, x.size - 1) * cv / math.sqrt(x.size))
    # bootstrap check at subset sizes
    rng = np.random.default_rng(SEED)
    curve = {}
    sizes = sorted({s for s in (3, 5, 8, 10, 15, 20, 30, 40, 60, x.size) if 3 <= s <= x.size})
    for size in sizes:
        widths = []
        for _ in range(20 if size < x.size else 1):
            subset = rng.choice(x, size=size, replace=False)
            if float(np.ptp(subset)) == 0.0:
                widths.append(0.0)
                continue
            ci = _bootstrap(subset, "percentile")
            if ci:
                widths.append((ci[1] - ci[0]) / 2 / float(subset.mean()))
        if widths:
            curve[str(size)] = float(np.median(widths))
    out["bootstrap_half_width_by_jobs"] = curve
    reached = [int(s) for s, w in curve.items() if w <= target]
    out["n_needed_bootstrap"] = min(reached) if reached else None
    out["method"] = (
        "per-job median ms/token; n from the t approximation t(0.975,n-1)*CV/sqrt(n) <= 2%; bootstrap "
        "(percentile, 9,999 resamples) median half-width over 20 random subsets per size as a check"
    )
    return out


# ---------------------------------------------------------------------------------------------------
# section 2: instrumentation on vs off


def make_clock(session: Any, on: bool, job: int) -> StageClock:
    return StageClock(session.device, job_id=str(job), nvtx_enabled=on, timing_enabled=on)


def run_pairs(
    arms: dict[str, Callable[[int], tuple[Any, float]]], budget_s: float, min_pairs: int, max_pairs: int,
    rng: random.Random, label: str,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Interleaved pairs, the order inside each drawn at random; one discarded pair first. Each arm is a
    callable (job index) -> (result, wall ms). Returns the pairs and the order each ran in."""
    names = list(arms)
    for name in names:  # warm pair: anything cold about either arm happens here
        arms[name](0)
    began, pairs, orders, job = time.perf_counter(), [], [], 1
    while len(pairs) < max_pairs:
        elapsed = time.perf_counter() - began
        per_pair = elapsed / len(pairs) if pairs else 0.0
        if len(pairs) >= min_pairs and elapsed + per_pair > budget_s:
            break
        order = names[:]
        rng.shuffle(order)
        pair: dict[str, Any] = {"order": order}
        for name in order:
            pair[name] = arms[name](job)
            job += 1
        pairs.append(pair)
        orders.append(order[0])
        if len(pairs) % 5 == 0:
            log(f"  {label}: {len(pairs)} pairs in {time.perf_counter() - began:.0f} s")
    return pairs, orders


def section_instrumentation(session: Any, page: Path, args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    rng = random.Random(SEED)
    arms = {
        state: (lambda job, on=(state == "on"): timed_job(session, page, args, args.tokens, PLAIN,
                                                            make_clock(session, on, job)))
        for state in ("on", "off")
    }  # fmt: skip
    pairs, _ = run_pairs(arms, budget_s, args.min_pairs, args.max_pairs, rng, "instrumentation")
    kept = [p for p in pairs if not cold(p["on"][0]) and not cold(p["off"][0])]
    rel = [p["on"][1] / p["off"][1] - 1 for p in kept]
    ci = mean_ci(rel)
    off_zero = all(p["off"][0].timings.prefill_ms == 0.0 and not p["off"][0].timings.decode_step_ms for p in pairs)
    on_first = [p["on"][1] / p["off"][1] - 1 for p in kept if p["order"][0] == "on"]
    off_first = [p["on"][1] / p["off"][1] - 1 for p in kept if p["order"][0] == "off"]
    on_walls = [p["on"][1] for p in kept]
    off_walls = [p["off"][1] for p in kept]
    memory = next((r.memory for r in (p["on"][0] for p in kept) if getattr(r, "memory", None)), None)
    return {
        "tokens": args.tokens,
        "pairs": len(pairs),
        "pairs_used": len(kept),
        "pairs_left_out_cold": len(pairs) - len(kept),
        "cold_reasons": sorted({reason for p in pairs for arm in ("on", "off") for reason in cold(p[arm][0])}),
        "wall_ms_on": on_walls,
        "wall_ms_off": off_walls,
        "median_on_ms": statistics.median(on_walls) if on_walls else None,
        "median_off_ms": statistics.median(off_walls) if off_walls else None,
        "off_spread_iqr_rel": (float(np.subtract(*np.percentile(off_walls, [75, 25])) / np.median(off_walls))
                               if len(off_walls) >= 4 else None),  # fmt: skip
        "relative_overhead": ci,
        "mean_overhead_when_on_ran_first": statistics.fmean(on_first) if on_first else None,
        "mean_overhead_when_off_ran_first": statistics.fmean(off_first) if off_first else None,
        "verdict": threshold_verdict(ci, TARGET_OVERHEAD, "mean of on/off - 1"),
        "switch_took_effect": off_zero,
        # section 4's input: instrumented jobs' per-job median decode ms/token
        "on_job_median_ms_per_token": [median_step_ms(p["on"][0]) for p in kept],
        "on_job_e2e_ms": [p["on"][0].timings.e2e_ms for p in kept],
        "memory_of_an_on_job": asdict(memory) if memory is not None else None,
    }


# ---------------------------------------------------------------------------------------------------
# section 3: the EOS path


def job_metrics(result: Any, wall_ms: float) -> dict[str, Any]:
    t = result.timings
    return {
        "wall_ms": wall_ms,
        "e2e_ms": t.e2e_ms,
        "decode_ms": t.decode_ms,
        "kept_steps": len(t.decode_step_ms),
        "wasted_steps": getattr(result, "wasted_steps", None),
        "wasted_decode_ms": getattr(t, "wasted_decode_ms", None),
        "readback_ms": getattr(t, "readback_ms", None),
        "stop_reason": result.stop_reason,
        "tokens": result.decode_tokens,
    }


def section_eos(session: Any, page: Path, args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    from dsocr_workers.engine.generate import cache_bucket
    from dsocr_workers.engine.session import force_eos_at

    n = args.eos_step
    prompt = session.prepare(page, None, args.mode, 9).prompt_tokens
    bucket = cache_bucket(prompt + n + 1, session.max_positions)
    eos_budget = args.eos_budget or (bucket - prompt)
    forced, eos_at_n = DecodeOptions(no_repeat_ngram_size=0), force_eos_at(n)
    arms = {
        "forced_eos": lambda job: timed_job(session, page, args, eos_budget, forced, after_step=eos_at_n),
        "ignore_eos": lambda job: timed_job(session, page, args, n + 1, PLAIN),
    }
    pairs, _ = run_pairs(arms, budget_s, args.min_eos_pairs, args.max_pairs, random.Random(SEED + 1), "eos")
    kept = [p for p in pairs if not cold(p["forced_eos"][0]) and not cold(p["ignore_eos"][0])]
    metrics = {arm: [job_metrics(*p[arm]) for p in kept] for arm in arms}
    honoured = all(m["stop_reason"] == "eos" and m["tokens"] == n + 1 for m in metrics["forced_eos"])
    out: dict[str, Any] = {
        "eos_step": n,
        "prompt_tokens": prompt,
        "kv_bucket": bucket,
        "max_new_tokens": {"forced_eos": eos_budget, "ignore_eos": n + 1},
        "pairs": len(pairs),
        "pairs_used": len(kept),
        "pairs_left_out_cold": len(pairs) - len(kept),
        "forced_eos_honoured": honoured,
        "jobs": metrics,
        "arms": {},
        "difference_forced_minus_ignore": {},
    }
    for arm, rows in metrics.items():
        out["arms"][arm] = {
            key: (statistics.median([r[key] for r in rows]) if rows and rows[0][key] is not None else None)
            for key in ("wall_ms", "e2e_ms", "decode_ms", "kept_steps", "wasted_steps", "wasted_decode_ms",
                        "readback_ms")
        }  # fmt: skip
    for key in ("wall_ms", "e2e_ms", "decode_ms", "wasted_decode_ms", "readback_ms"):
        a, b = metrics["forced_eos"], metrics["ignore_eos"]
        if not a or a[0][key] is None or b[0][key] is None:
            continue
        diff = mean_ci([x[key] - y[key] for x, y in zip(a, b, strict=True)])
        diff["verdict"] = difference_verdict(diff)
        out["difference_forced_minus_ignore"][key] = diff
    rel = [x["wall_ms"] / y["wall_ms"] - 1 for x, y in zip(metrics["forced_eos"], metrics["ignore_eos"], strict=True)]
    out["relative_wall_cost"] = mean_ci(rel)
    if not honoured:
        out["note"] = ("the forced EOS did not stop every forced job at step N (engine without "
                       "the force_eos_at hook?): the comparison is not the EOS path")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------
# section 1: CUDA events vs torch.profiler


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def stage_gpu_times(trace_path: Path) -> dict[str, Any]:
    """Per stage (from the dsocr:: ranges of a chrome trace): GPU events launched inside it, their span,
    busy time, count, and kineto's gpu_user_annotation span where present. Times in ms.

    Also `window_ms`, an explanation rather than the check: the stage's interval rebuilt from the trace
    alone, from its first to its last cudaEventRecord call, each placed on the GPU timeline at
    max(the call's end on the host, the end of all GPU work launched before it) — where the GPU stood
    when it reached the marker. It differs from the span by the GPU's idle time at the stage's edges
    (waiting for the host to launch the first kernel, or for a wait at the end)."""
    with open(trace_path) as handle:
        events = json.load(handle)["traceEvents"]
    launches: list[tuple[float, Any]] = []
    records: list[tuple[float, float]] = []  # cudaEventRecord calls: (start, end) on the host
    gpu: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    ranges: dict[str, list[tuple[float, float]]] = defaultdict(list)
    kineto: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, extra = e.get("cat"), e.get("name", ""), e.get("args") or {}
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        if cat in LAUNCH_CATS and name.startswith("cudaEventRecord"):
            records.append((ts, ts + dur))
        if cat in LAUNCH_CATS and "correlation" in extra:
            launches.append((ts, extra["correlation"]))
        elif cat in GPU_CATS:
            gpu[extra.get("correlation")].append((ts, ts + dur))
        elif cat == "user_annotation" and name.startswith(ANNOTATION):
            ranges[name[len(ANNOTATION):]].append((ts, ts + dur))
        elif cat == "gpu_user_annotation" and name.startswith(ANNOTATION):
            kineto[name[len(ANNOTATION):]] += dur
    launches.sort(key=lambda item: item[0])
    times = [ts for ts, _ in launches]
    # the end of all GPU work launched up to each launch (a running maximum, in launch order)
    done_by: list[float] = []
    for _, correlation in launches:
        ends = [b for _, b in gpu.get(correlation, ())]
        done_by.append(max([*ends, done_by[-1] if done_by else -math.inf]))
    records.sort()
    record_starts = [a for a, _ in records]

    def marker(call: tuple[float, float]) -> float:
        before = bisect.bisect_left(times, call[0]) - 1
        return max(call[1], done_by[before] if before >= 0 else -math.inf)

    inside: set[Any] = set()
    out: dict[str, Any] = {}
    for stage, spans in ranges.items():
        span_us = busy_us = window_us = 0.0
        count = 0
        for lo, hi in spans:
            calls = records[bisect.bisect_left(record_starts, lo): bisect.bisect_right(record_starts, hi)]
            if len(calls) >= 2:
                window_us += marker(calls[-1]) - marker(calls[0])
            correlations = [c for _, c in launches[bisect.bisect_left(times, lo): bisect.bisect_right(times, hi)]]
            inside.update(correlations)
            intervals = [iv for c in correlations for iv in gpu.get(c, ())]
            if intervals:
                span_us += max(b for _, b in intervals) - min(a for a, _ in intervals)
                busy_us += _union_us(intervals)
                count += len(intervals)
        out[stage] = {
            "span_ms": span_us / 1e3 if count else None,
            "busy_ms": busy_us / 1e3 if count else None,
            "gpu_events": count,
            "kineto_gpu_span_ms": kineto[stage] / 1e3 if stage in kineto else None,
            "window_ms": window_us / 1e3 if window_us > 0 else None,
        }
    total = sum(len(v) for v in gpu.values())
    out["_totals"] = {
        "gpu_events": total,
        "gpu_events_outside_stages": sum(len(v) for c, v in gpu.items() if c not in inside),
        "launch_events": len(launches),
    }
    return out


def section_crosscheck(
    session: Any, page: Path, args: argparse.Namespace, budget_s: float, tmp: Path
) -> dict[str, Any]:
    cuda = session.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # Unprofiled first: a token count in another KV-cache bucket than the other sections (32 tokens on
    # the anchors' page: 1024 positions, not 2048) means a new decode graph to compile and capture, and
    # that must not happen under the profiler.
    warm, _ = timed_job(session, page, args, args.xcheck_tokens, PLAIN)
    began, jobs = time.perf_counter(), []
    for index in range(args.xcheck_jobs + 1):  # index 0: profiler warm-up, discarded
        if index > 1 and time.perf_counter() - began > budget_s:
            break
        clock = ProfiledClock(session.device, job_id=str(index), nvtx_enabled=True, timing_enabled=True)
        sync()
        with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
            result = session.run_inference(page, mode=args.mode, max_new_tokens=args.xcheck_tokens, infer=PLAIN,
                                           clock=clock)  # fmt: skip
            sync()
        if index == 0:
            continue
        path = tmp / f"trace-{session.engine_name}-{index}.json"
        prof.export_chrome_trace(str(path))
        size_mb = path.stat().st_size / 2**20
        gpu = stage_gpu_times(path)
        path.unlink()
        stages = {}
        for name in STAGES:
            if name in HOST_STAGES or clock.count(name) == 0:
                continue
            measured = gpu.get(name, {})
            event_ms = clock.ms(name)
            span = measured.get("span_ms")
            window = measured.get("window_ms")
            stages[name] = {"event_ms": event_ms, **measured, "ratio": event_ms / span if span else None,
                            "ratio_window": event_ms / window if window else None}  # fmt: skip
        jobs.append({"stages": stages, "totals": gpu.get("_totals"), "trace_mb": round(size_mb, 1),
                     "cold": cold(result)})  # fmt: skip
        log(f"  crosscheck job {index}: trace {size_mb:.0f} MB, "
            + ", ".join(f"{k} {v['ratio']:.3f}" for k, v in stages.items() if v.get("ratio")))  # fmt: skip
    summary = {}
    names = [name for name in STAGES if any(name in j["stages"] for j in jobs)]
    for name in names:
        rows = [j["stages"][name] for j in jobs if name in j["stages"]]
        ratios = [r["ratio"] for r in rows if r.get("ratio")]
        event = statistics.median([r["event_ms"] for r in rows])
        spans = [r["span_ms"] for r in rows if r.get("span_ms") is not None]
        busy = [r["busy_ms"] for r in rows if r.get("busy_ms") is not None]
        kineto = [r["kineto_gpu_span_ms"] for r in rows if r.get("kineto_gpu_span_ms") is not None]
        windows = [r["ratio_window"] for r in rows if r.get("ratio_window")]
        entry: dict[str, Any] = {
            "event_ms_median": event,
            "span_ms_median": statistics.median(spans) if spans else None,
            "busy_ms_median": statistics.median(busy) if busy else None,
            "kineto_gpu_span_ms_median": statistics.median(kineto) if kineto else None,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_worst": max(ratios, key=lambda r: abs(r - 1)) if ratios else None,
            "ratio_window_median": statistics.median(windows) if windows else None,
            "gpu_events_median": statistics.median([r.get("gpu_events", 0) for r in rows]),
        }
        window = entry["ratio_window_median"]
        if not ratios:
            entry["verdict"] = entry["verdict_window"] = (
                "no GPU work attributed" if cuda else "n/a (CPU: no GPU clock to compare)"
            )
        elif event < args.xcheck_min_ms:
            entry["verdict"] = entry["verdict_window"] = (
                f"n/a (< {args.xcheck_min_ms:g} ms: launch latency and event granularity dominate)"
            )
        else:
            entry["verdict"] = "PASS" if abs(entry["ratio_median"] - 1) <= TOLERANCE_XCHECK else "FAIL"
            entry["verdict_window"] = (
                "-" if window is None else "PASS" if abs(window - 1) <= TOLERANCE_XCHECK else "FAIL"
            )
            if entry["verdict"] == "FAIL" and entry["verdict_window"] == "PASS":
                entry["note"] = "the gap is GPU idle time at the stage's edges (waiting for the host)"
        summary[name] = entry

    def overall_of(key: str, what: str) -> str:
        judged = {k: v[key] for k, v in summary.items() if v[key] in ("PASS", "FAIL")}
        failed = [k for k, v in judged.items() if v == "FAIL"]
        if not judged:
            return f"{what}: no stage judged"
        if failed:
            return f"{what}: FAIL ({', '.join(failed)} differ by more than {100 * TOLERANCE_XCHECK:g}%)"
        return f"{what}: PASS (every stage of at least {args.xcheck_min_ms:g} ms within {100 * TOLERANCE_XCHECK:g}%)"

    overall = f"{overall_of('verdict', 'kernel span')}; {overall_of('verdict_window', 'rebuilt window')}"
    return {
        "tokens": args.xcheck_tokens,
        "jobs": len(jobs),
        "method": ("profiler time = span (first start to last end) of the kernels/memcpy/memset whose launch "
                   "call ran inside the stage's record_function range (matched by correlation id); busy = "
                   "union of their intervals; ratio = CUDA-event ms / span; median over jobs"),  # fmt: skip
        "stages": summary,
        "unprofiled_warm_job_cold_reasons": cold(warm),
        "per_job": jobs,
        "verdict": overall,
    }


# ---------------------------------------------------------------------------------------------------
# report


def _ci(ci: dict[str, Any] | None, scale: float, unit: str, digits: int) -> str:
    """'+x [lo, hi]' of a {mean, ci} record, scaled (100 for percent)."""
    if not ci or ci.get("mean") is None:
        return "-"
    text = f"{scale * ci['mean']:+.{digits}f}{unit}"
    if ci.get("ci"):
        text += f" [{scale * ci['ci'][0]:+.{digits}f}{unit}, {scale * ci['ci'][1]:+.{digits}f}{unit}]"
    return text


def _pct_ci(ci: dict[str, Any] | None) -> str:
    return _ci(ci, 100, "%", 2)


def _ms_ci(ci: dict[str, Any] | None) -> str:
    return _ci(ci, 1, "", 3)


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    s = report["settings"]
    lines = [
        f"### Trust benchmark, {env['date']}",
        "",
        environment_line(env),
        "",
        f"> **RANDOM WEIGHTS**: model `{s['model']}` ({s['dtype']}) is a random-weight preset; timings are real, "
        "outputs meaningless." if s["model"] in ("tiny", "full") else f"Model `{s['model']}` ({s['dtype']}).",
        "",
        f"Page: {s['page']}, mode {s['mode']}. Jobs: {s['tokens']} decode tokens (ignore_eos, no n-gram ban) "
        f"unless stated.",
        "",
    ]
    for name, e in report["engines"].items():
        lines += [f"#### Engine `{name}`", ""]
        if "error" in e:
            lines += [f"ERROR: {e['error']}", ""]
        lines.append(f"Load {fmt(e.get('load_s'), 1)} s; warm-up jobs {', '.join(fmt(w, 1) for w in e.get('warmup_wall_s', []))} s"
                     + (f" (cold reasons: {'; '.join(e['warmup_cold_reasons'])})" if e.get("warmup_cold_reasons") else "")
                     + (f"; engine note: {e['engine_note']}" if e.get("engine_note") else "") + ".")  # fmt: skip
        lines.append("")
        x = e.get("timing_crosscheck", {})
        lines.append("**1. CUDA events vs torch.profiler**" + (f" ({x['jobs']} profiled jobs of {x['tokens']} tokens; "
                     "profiler = span of the stage's GPU work, first kernel start to last kernel end)" if "jobs" in x else ""))  # fmt: skip
        if "stages" in x:
            lines += ["", "| stage | CUDA events ms | profiler span ms | busy ms | kineto span ms | ratio events/span (worst) "
                      "| verdict (span, ±5%) | ratio events/window | verdict (window, ±5%) |",
                      "|---|---:|---:|---:|---:|---:|---|---:|---|"]  # fmt: skip
            for stage, v in x["stages"].items():
                lines.append(f"| {stage} | {fmt(v['event_ms_median'], 3)} | {fmt(v['span_ms_median'], 3)} "
                             f"| {fmt(v['busy_ms_median'], 3)} | {fmt(v['kineto_gpu_span_ms_median'], 3)} "
                             f"| {fmt(v['ratio_median'], 4)} ({fmt(v['ratio_worst'], 4)}) "
                             f"| {v['verdict']}{' — ' + v['note'] if v.get('note') else ''} "
                             f"| {fmt(v.get('ratio_window_median'), 4)} | {v.get('verdict_window', '-')} |")  # fmt: skip
            lines.append("\nspan: first start to last end of the GPU work launched inside the stage; busy: union of "
                         "that work; window: the stage rebuilt from the trace's cudaEventRecord calls (see "
                         "stage_gpu_times), which adds the GPU's idle time at the stage's edges.")  # fmt: skip
            lines += ["", f"Verdict: {x['verdict']}."]
        elif x.get("error") or x.get("skipped"):
            lines.append(f": {x.get('error') or x.get('skipped')}")
        lines.append("")
        i = e.get("instrumentation", {})
        lines.append("**2. Instrumentation on vs off**")
        if "relative_overhead" in i:
            lines.append(
                f"{i['pairs_used']} interleaved pairs used ({i['pairs_left_out_cold']} left out as cold), random order; "
                f"host wall per job: on {fmt(i['median_on_ms'])} ms, off {fmt(i['median_off_ms'])} ms (medians); "
                f"mean of on/off - 1: {_pct_ci(i['relative_overhead'])} (95% CI: BCa bootstrap ∪ t). "
                f"Off-arm IQR/median {fmt(100 * i['off_spread_iqr_rel'] if i.get('off_spread_iqr_rel') is not None else None)}%. "
                f"Switch took effect: {i['switch_took_effect']}. **Verdict: {i['verdict']}** (target ≤ 2%)."
            )
        elif i:
            lines.append(f": {i.get('error') or i.get('skipped')}")
        lines.append("")
        o = e.get("eos_path", {})
        lines.append("**3. EOS path cost**")
        if "arms" in o:
            lines += [
                f"EOS forced at decode step {o['eos_step']} (max_new_tokens {o['max_new_tokens']['forced_eos']}, "
                f"KV bucket {o['kv_bucket']}) vs ignore_eos with max_new_tokens {o['max_new_tokens']['ignore_eos']}; "
                f"{o['pairs_used']} pairs; forced EOS honoured: {o['forced_eos_honoured']}.",
                "",
                "| arm | wall ms | e2e ms | decode ms (kept) | kept steps | wasted steps | wasted decode ms | readback ms |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for arm, v in o["arms"].items():
                lines.append(f"| {arm} | {fmt(v['wall_ms'])} | {fmt(v['e2e_ms'])} | {fmt(v['decode_ms'])} | {fmt(v['kept_steps'])} "
                             f"| {fmt(v['wasted_steps'])} | {fmt(v['wasted_decode_ms'])} | {fmt(v['readback_ms'], 3)} |")  # fmt: skip
            lines += ["", "| forced − ignore (paired) | mean ms [95% CI] | verdict |", "|---|---:|---|"]
            for key, v in o["difference_forced_minus_ignore"].items():
                lines.append(f"| {key} | {_ms_ci(v)} | {v['verdict']} |")
            lines.append(f"\nRelative wall cost of the EOS path: {_pct_ci(o.get('relative_wall_cost'))}.")
            if o.get("note"):
                lines.append(f"Note: {o['note']}")
        elif o:
            lines.append(f": {o.get('error') or o.get('skipped')}")
        lines.append("")
        r = e.get("repeats_for_2pct", {})
        lines.append("**4. Repeats for a ±2% 95% interval on decode ms/token**")
        if r.get("mean") is not None:
            curve = ", ".join(f"{n}: ±{100 * w:.2f}%" for n, w in r.get("bootstrap_half_width_by_jobs", {}).items())
            lines.append(
                f"From {r['jobs']} jobs (per-job median ms/token, mean {fmt(r['mean'], 4)} ms, CV {100 * r['cv']:.2f}%): "
                f"**{r['n_needed_t_approx']} jobs** by the t approximation; bootstrap half-width by jobs: {curve} "
                f"→ {r['n_needed_bootstrap'] or 'not reached within the jobs run'}. Same process and GPU: run-to-run "
                "noise is not included."
            )
        elif r:
            lines.append(f": {r.get('note') or r.get('error')}")
        lines.append("")
    lines += [f"Command: `{report['command']}`", f"Benchmark wall time: {report.get('bench_wall_s', 0):.0f} s.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------


def run_engine(name: str, page: Path, args: argparse.Namespace, engine_s: float, tmp: Path,
               report: dict[str, Any], save: Callable[[], None]) -> None:  # fmt: skip
    from dsocr_workers.engine.session import DeepSeekOCRSession

    entry: dict[str, Any] = report["engines"].setdefault(name, {})
    began = time.perf_counter()
    log(f"engine {name}: loading {args.model}")
    sync()
    session = DeepSeekOCRSession.from_local(
        args.model, device=args.device, dtype=torch.bfloat16 if args.device.startswith("cuda") else None,
        engine=name, seed=0,
    )  # fmt: skip
    sync()
    entry["load_s"] = time.perf_counter() - began
    entry["engine_ran"] = session.engine_name
    entry["engine_note"] = getattr(session, "engine_note", "")
    walls, reasons = [], []
    for _ in range(max(1, args.warmup if args.warmup is not None else WARMUP[name])):
        result, wall = timed_job(session, page, args, args.tokens, PLAIN)
        walls.append(wall / 1e3)
        reasons += cold(result)
        log(f"engine {name}: warm-up job {wall / 1e3:.1f} s" + (f" (cold: {'; '.join(cold(result))})" if cold(result) else ""))
    entry["warmup_wall_s"] = walls
    entry["warmup_cold_reasons"] = reasons
    entry["crop_grid"] = list(result.crop_grid)
    entry["image_tokens"] = result.image_tokens
    entry["prompt_tokens"] = result.prompt_tokens
    save()
    left_for_sections = engine_s - (time.perf_counter() - began)
    remaining_weight = sum(w for name, w in SECTION_WEIGHTS.items() if name in args.sections)
    for section, weight in SECTION_WEIGHTS.items():
        if section not in args.sections:
            continue
        section_began = time.perf_counter()
        budget = max(0.0, left_for_sections * weight / remaining_weight)
        remaining_weight -= weight
        if report_deadline_left(args) < 20:
            entry[section] = {"skipped": "out of --budget-s"}
            log(f"engine {name}: {section} skipped (budget)")
            continue
        log(f"engine {name}: {section} (about {budget:.0f} s)")
        try:
            if section == "instrumentation":
                entry[section] = section_instrumentation(session, page, args, budget)
            elif section == "eos_path":
                entry[section] = section_eos(session, page, args, budget)
            else:
                entry[section] = section_crosscheck(session, page, args, budget, tmp)
            entry[section]["section_s"] = time.perf_counter() - section_began
            log(f"engine {name}: {section}: {entry[section].get('verdict', 'done')}")
        except Exception as exc:
            traceback.print_exc()
            entry[section] = {"error": f"{type(exc).__name__}: {exc}"}
        left_for_sections -= time.perf_counter() - section_began
        left_for_sections = max(left_for_sections, 0.0)
        if section == "instrumentation" and "on_job_median_ms_per_token" in entry[section]:
            entry["repeats_for_2pct"] = repeats_needed(entry[section]["on_job_median_ms_per_token"])
        save()
    del session
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report_deadline_left(args: argparse.Namespace) -> float:
    return args.budget_s - (time.perf_counter() - _T0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --model tiny)")
    parser.add_argument("--engines", default="eager,fast",
                        help="eager first: the fast engine's compile time then only squeezes its own sections")  # fmt: skip
    parser.add_argument("--page", type=Path, help="default: bench_engine's synthetic 1600x2000 page")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens of the timed jobs (sections 2, 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up jobs (default eager 1, fast 2)")
    parser.add_argument("--min-pairs", type=int, default=6)
    parser.add_argument("--max-pairs", type=int, default=60)
    parser.add_argument("--min-eos-pairs", type=int, default=4)
    parser.add_argument("--eos-step", type=int, default=100, help="N: EOS forced as the token of decode step N")
    parser.add_argument("--eos-budget", type=int, default=None,
                        help="max_new_tokens of the forced-EOS arm (default: the rest of N's KV bucket)")  # fmt: skip
    parser.add_argument("--xcheck-jobs", type=int, default=3)
    parser.add_argument("--xcheck-tokens", type=int, default=32, help="decode tokens of the profiled jobs")
    parser.add_argument("--xcheck-min-ms", type=float, default=1.0)
    parser.add_argument("--budget-s", type=float, default=390, help="whole script, load and compile included")
    parser.add_argument("--sections", default=",".join(SECTION_WEIGHTS),
                        help="which sections to run (section 4 comes with instrumentation)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else benchmarks/results")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_trust needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2

    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    json_path, md_path = out_dir / f"trust-{stamp}.json", out_dir / f"trust-{stamp}.md"
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = set(args.sections) - set(SECTION_WEIGHTS)
    if unknown:
        print(f"bench_trust: unknown sections {sorted(unknown)}; sections: {', '.join(SECTION_WEIGHTS)}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "environment": environment(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "model": args.model, "dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
            "device": args.device, "engines": engines, "mode": args.mode, "tokens": args.tokens,
            "page": str(args.page) if args.page else "synthetic 1600x2000 (bench_engine.synthetic_page)",
            "eos_step": args.eos_step, "xcheck_tokens": args.xcheck_tokens, "xcheck_jobs": args.xcheck_jobs,
            "budget_s": args.budget_s, "seed": SEED, "sections": args.sections,
        },  # fmt: skip
        "targets": {"crosscheck_tolerance": TOLERANCE_XCHECK, "instrumentation_overhead_max": TARGET_OVERHEAD,
                    "decode_half_width": TARGET_HALF_WIDTH},  # fmt: skip
        "engines": {},
    }

    def save() -> None:
        report["bench_wall_s"] = time.perf_counter() - _T0
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        md_path.write_text(markdown(report))

    log(f"trust: engines {engines}, budget {args.budget_s:.0f} s; out {json_path}")
    with tempfile.TemporaryDirectory(prefix="dsocr-trust-") as tmpname:
        tmp = Path(tmpname)
        page = args.page
        if page is None:
            page = tmp / "page.png"
            synthetic_page().save(page)
        for index, name in enumerate(engines):
            share = report_deadline_left(args) / (len(engines) - index)
            try:
                run_engine(name, page, args, share, tmp, report, save)
            except Exception as exc:
                traceback.print_exc()
                report["engines"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
            save()
    save()
    print(markdown(report), flush=True)
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
