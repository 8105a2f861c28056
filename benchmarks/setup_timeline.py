"""The setup stage of a run's profiled batch-1 jobs, from their traces: where its host time goes.

Per profiled job, in the order the jobs ran, from the trace stored with it (`profiles.trace_gz`) and its
result row: the stage's clock (`setup_ms`, CUDA events), the host's range (`dsocr::setup`), when the
stage's start event was recorded within it, the host time from that event to the first operator (the
device idle before the first copy), each `cudaMemcpyAsync` call's host time, the longest host gap between
two operators after the event, and the device's own range (first to last activity).

    python3 benchmarks/setup_timeline.py --database-url sqlite:///ledger.db [--run ID]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import select

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsocr_workers.store.db import open_database  # noqa: E402
from dsocr_workers.store.models import Job, Profile, Result, Run  # noqa: E402

STAGE = "dsocr::setup"
HOST = ("cpu_op", "cuda_runtime")


def timeline(trace: dict[str, Any]) -> dict[str, Any] | None:
    """The setup stage's host and device figures in one job's trace (µs); None without the stage."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e.get("name") == STAGE]
    host = next((e for e in ranges if e.get("cat") == "user_annotation"), None)
    device = next((e for e in ranges if e.get("cat") == "gpu_user_annotation"), None)
    if host is None:
        return None
    start, end, thread = host["ts"], host["ts"] + host["dur"], host["tid"]
    inside = sorted(
        (e for e in events if start <= e["ts"] <= end and e.get("tid") == thread and e.get("cat") in HOST),
        key=lambda e: e["ts"],
    )
    record = next(e for e in inside if e["name"].startswith("cudaEventRecord"))
    operators = [e for e in inside if e["cat"] == "cpu_op" and e["ts"] > record["ts"]]
    previous_end, longest_gap = record["ts"] + record["dur"], 0.0
    for operator in operators:
        longest_gap = max(longest_gap, operator["ts"] - previous_end)
        previous_end = max(previous_end, operator["ts"] + operator["dur"])
    return {
        "host_range_us": host["dur"],
        "event_recorded_at_us": record["ts"] - start,
        "event_to_first_op_us": operators[0]["ts"] - record["ts"] if operators else None,
        "memcpy_calls_us": [round(e["dur"]) for e in inside if e["name"] == "cudaMemcpyAsync"],
        "longest_gap_us": longest_gap,
        "device_range_us": None if device is None else device["dur"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--run", help="run id or prefix (default: the latest)")
    args = parser.parse_args()
    db = open_database(args.database_url)
    with db.transaction() as tx:
        runs = select(Run.id).order_by(Run.created_at.desc())
        if args.run:
            runs = runs.where(Run.id.startswith(args.run))
        run_id = tx.scalars(runs.limit(1)).first()
        if run_id is None:
            sys.exit(f"setup_timeline: no run {args.run or ''} in {args.database_url}")
        rows = tx.execute(
            select(Result.setup_ms, Result.prefetched, Job.image, Profile.trace_gz)
            .join(Job, Job.id == Result.job_id)
            .join(Profile, Profile.job_id == Result.job_id)
            .where(Result.run_id == run_id)
            .order_by(Result.id)
        ).all()
    print(f"run {run_id}: {len(rows)} profiled jobs (host times in µs; setup_ms is the stage's CUDA-event clock)")
    print("| job | image | prefetched | setup_ms | host range | event at | event → first op | cudaMemcpyAsync calls "
          "| longest gap | device range |")
    print("|---:|---|---|---:|---:|---:|---:|---|---:|---:|")
    for index, (setup_ms, prefetched, image, trace_gz) in enumerate(rows):
        figures = timeline(json.loads(gzip.decompress(trace_gz)))
        if figures is None:
            continue
        first = figures["event_to_first_op_us"]
        device = figures["device_range_us"]
        print(f"| {index} | {Path(image).name} | {prefetched} | {setup_ms:.2f} | {figures['host_range_us']:.0f} "
              f"| {figures['event_recorded_at_us']:.0f} | {'-' if first is None else f'{first:.0f}'} "
              f"| {figures['memcpy_calls_us']} | {figures['longest_gap_us']:.0f} "
              f"| {'-' if device is None else f'{device:.0f}'} |")
    db.dispose()


if __name__ == "__main__":
    main()
