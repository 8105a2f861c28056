"""Kernel-level profiles (issue 33): the cross-check of a profiled job's kernels against its CUDA-event
stage times, and what profiling a job costs.

One process, one GPU, the anchors' page (the synthetic 1600x2000 page of bench_engine: gundam, 2x3
tiles), the `full` preset (RANDOM weights) in bf16, the engine `auto` picks (fast on a GPU). After the
warm-up jobs (unprofiled), pairs of jobs, the order inside each pair drawn at random: one plain, one run
under the farm's profiler (engine/profiling.py `JobProfiler`, exactly as a worker runs a `--profile`
job: the stages as ranges, the decode sampled). The first profiled job is the profiler's own warm-up
(kineto and CUPTI start) and is discarded.

1. Cross-check, per stage, over the profiled jobs: the stage's CUDA-event time (decode: the sampled
   steps'), the sum of the CUDA kernels / memcpys / memsets launched inside it, their union (busy) and
   span, idle = events - busy; verdict as `dsocr report` gives it (dsocr_workers/kernels.py
   `StageKernels.crosscheck`): PASS when the kernels' sum is within 5% of the events, "explained" when
   the kernels' span is (the gap is the GPU idle between kernels: launch-bound host code), else FAIL;
   stages under 1 ms are not judged.
2. Overhead: end-to-end, prefill and decode ms/token of the profiled jobs over their paired plain ones
   (mean, 95% paired-bootstrap interval: report/stats.py), the trace's size (gzip and raw), and the host
   time the trace and summary take after the job (off the device's path in the farm).

Writes profile-<UTC time>.json / .md to --out (default $OUT, else benchmarks/results) and prints the table.

    source benchmarks/device_env.sh || exit; python3 benchmarks/bench_profile.py --out $OUT   # one H100, ~3 min
    python benchmarks/bench_profile.py --device cpu --model tiny --tokens 16 --pairs 2 --out /tmp/prof  # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, environment_line, synthetic_page  # noqa: E402
from dsocr_workers.engine.profiling import JobProfiler  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions, InferenceResult  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.kernels import KernelSummary, StageKernels  # noqa: E402
from dsocr_workers.model.config import dtype_name  # noqa: E402
from dsocr_workers.report.stats import paired_ratios  # noqa: E402

PLAIN = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)  # fixed-length jobs, as bench_trust's
SEED = 20261126
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def job(session: DeepSeekOCRSession, page: Path, args: argparse.Namespace, profiled: bool) -> tuple[InferenceResult, float]:
    """One job as the farm runs it (prepared, then on the device, then its host part); the host seconds
    its profile took to collect (the trace exported, the summary built) when profiled."""
    sync()
    prepared = session.prepare_job(page, mode=args.mode)
    profiler = JobProfiler(session.device) if profiled else None
    run = session.run_on_device(prepared.page, args.tokens, PLAIN, clock=prepared.clock, profiler=profiler)
    began = time.perf_counter()
    result = run.finish()
    return result, time.perf_counter() - began


def crosscheck(summaries: list[KernelSummary]) -> list[dict[str, Any]]:
    rows = []
    stages = list(dict.fromkeys(s.stage for summary in summaries for s in summary.stages))
    activity = summaries[0].activity
    for name in stages:
        entries = [summary.stage(name) for summary in summaries]
        jobs = [e for e in entries if e is not None]
        mean, n = StageKernels.mean(jobs), len(jobs)
        rows.append({
            "stage": name, "jobs": n, "event_ms": mean.event_ms, "kernel_ms": mean.kernel_ms,
            "busy_ms": mean.busy_ms, "span_ms": mean.span_ms, "idle_ms": mean.idle_ms,
            "kernels_over_events": mean.kernel_ms / mean.event_ms if mean.event_ms else None,
            "span_over_events": mean.span_ms / mean.event_ms if mean.event_ms else None,
            "verdict": mean.crosscheck(activity),
            "top_kernels": [(k.name, k.calls, k.total_us / n) for k in jobs[-1].kernels[:5]],
        })  # fmt: skip
    return rows


def ratio(profiled: list[float], plain: list[float]) -> dict[str, Any]:
    estimate = paired_ratios([[v] for v in profiled], [[v] for v in plain]).mean
    return {"mean": estimate.value, "ci": [estimate.low, estimate.high], "pairs": estimate.n}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# Kernel profiles: cross-check and overhead ({env['date']})", "", environment_line(env), "",
             f"{report['model']}, {report['engine']}, {report['dtype']}, mode {report['mode']}, {report['tokens']} tokens; "
             f"{report['profiled_jobs']} profiled jobs (decode steps sampled: {report['decode_steps']}), "
             f"{report['pairs']} pairs.", "",
             "| stage | CUDA events ms | kernels ms | busy ms | span ms | idle ms | kernels / events | span / events | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for row in report.get("crosscheck", []):
        cells = [row["stage"], *(f"{row[k]:.3f}" for k in ("event_ms", "kernel_ms", "busy_ms", "span_ms", "idle_ms")),
                 *(f"{row[k]:.3f}" if row[k] is not None else "-" for k in ("kernels_over_events", "span_over_events")),
                 row["verdict"]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    overhead = report.get("overhead", {})
    lines += ["", "| profiled / plain | mean [95% CI] | pairs |", "|---|---|---:|"]
    for name, value in overhead.items():
        if isinstance(value, dict) and value.get("mean") is not None:
            low, high = value["ci"]
            ci = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
            lines.append(f"| {name} | {value['mean']:.3f}{ci} | {value['pairs']} |")
    trace = report.get("trace", {})
    if trace:
        lines += ["", f"Trace per profiled job: {trace['gz_mb_median']:.2f} MB gzip ({trace['raw_mb_median']:.1f} MB "
                      f"JSON); its collection (export + summary, host, after the job): {trace['collect_s_median']:.2f} s."]  # fmt: skip
    lines += ["", "Command: `" + report["command"] + "`"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per job (EOS ignored)")
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled jobs first (the fast engine compiles)")
    parser.add_argument("--pairs", type=int, default=8, help="at most this many (plain, profiled) pairs")
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop adding pairs after this long")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    session = DeepSeekOCRSession.from_local(args.model, device=args.device, engine=args.engine)
    log(f"loaded {args.model} on {session.device} ({session.engine_name}, {session.dtype})")
    report: dict[str, Any] = {
        "environment": environment(), "model": session.source.label, "engine": session.engine_name,
        "dtype": dtype_name(session.dtype), "mode": args.mode, "tokens": args.tokens,
        "command": "python3 benchmarks/bench_profile.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.png"
        synthetic_page().save(page)
        for i in range(args.warmup):
            result, _ = job(session, page, args, profiled=False)
            log(f"warm-up {i}: e2e {result.timings.e2e_ms:.1f} ms, cold {list(result.cold_reasons)}")
        result, _ = job(session, page, args, profiled=True)  # the profiler's own warm-up, discarded
        log(f"profiler warm-up job: e2e {result.timings.e2e_ms:.1f} ms")
        pairs: list[tuple[InferenceResult, InferenceResult, float]] = []
        began = time.perf_counter()
        while len(pairs) < args.pairs and (len(pairs) < 2 or time.perf_counter() - began < args.budget_s):
            order = [False, True] if rng.random() < 0.5 else [True, False]
            done = {flag: job(session, page, args, profiled=flag) for flag in order}
            (plain, _), (profiled, collect_s) = done[False], done[True]
            if plain.cold or profiled.cold:
                log(f"pair left out: cold {list(plain.cold_reasons) + list(profiled.cold_reasons)}")
                continue
            pairs.append((plain, profiled, collect_s))
            log(f"pair {len(pairs)}: e2e plain {plain.timings.e2e_ms:.1f} ms, profiled {profiled.timings.e2e_ms:.1f} ms")
    summaries = [p.profile.summary for _, p, _ in pairs if p.profile is not None]
    traces = [p.profile for _, p, _ in pairs if p.profile is not None]
    report.update({
        "pairs": len(pairs), "profiled_jobs": len(summaries),
        "decode_steps": summaries[0].decode_steps if summaries else [],
        "crosscheck": crosscheck(summaries) if summaries else [],
        "overhead": {
            "e2e": ratio([p.timings.e2e_ms for _, p, _ in pairs], [q.timings.e2e_ms for q, _, _ in pairs]),
            "prefill": ratio([p.timings.prefill_ms for _, p, _ in pairs], [q.timings.prefill_ms for q, _, _ in pairs]),
            "decode ms/token (p50 of the job's steps)": ratio(
                [statistics.median(p.timings.decode_step_ms) for _, p, _ in pairs],
                [statistics.median(q.timings.decode_step_ms) for q, _, _ in pairs]),
        },
        "trace": {
            "gz_mb_median": statistics.median(len(t.trace_gz) / 2**20 for t in traces),
            "raw_mb_median": statistics.median(t.trace_bytes / 2**20 for t in traces),
            "collect_s_median": statistics.median(c for _, _, c in pairs),
        } if traces else {},
    })  # fmt: skip
    (args.out / f"profile-{stamp}.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (args.out / f"profile-{stamp}.md").write_text(text)
    print(text, flush=True)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
