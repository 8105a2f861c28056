"""A worker's start, launch → every child ready, in each regime a worker serves (batch-1 and batched,
`--concurrency`), at K = 1, 2, 4 devices, from the artifacts `dsocr precompile` built and without
them; each start's parts adding up to its total, beside the floor of that device.

1. `--build`: `dsocr precompile --model M --engine E --modes MODES --max-new-tokens N --concurrency C
   --gpus 0` for each C into `--compile-cache` (idempotent: "up to date" once built). On the lent GPU
   image name its C++ compiler, CXX=/usr/bin/g++ (its /opt/gcc builds packages that segfault at load).
2. The floor, in a fresh process: `import torch` (from the bytecode the build wrote where the
   installation ships none, as a worker reads it), CUDA's initialisation, and the model's weights copied
   from pinned host memory to the device (CUDA events): what no start can go below.
3. For each C, each K: `--starts` launches of `dsocr worker --gpus 0,...,K-1 --warmup MODES --model M
   --engine E --max-new-tokens N --concurrency C` on that cache (its own redis-server and SQLite
   ledger), timed from launch to every child's worker session `ready_at`; `--without-artifacts K,...`:
   one start more at those K on an empty cache (each child compiles, as with no build); `--first-jobs
   FILELIST`: once ready, that list submitted at the regime's concurrency, its cold jobs counted (a
   start is warm when its first jobs are).

The parts of a start are its slowest child's: the CLI and the ledger's check (the worker's command before
its imports), imports (the worker's parent, before it forks its lanes), Celery and the fork (to the
child's session start), load, its warm-up's phases (artifacts: packages opened; pass 1: each shape's
first calls and graph captures, with the pages prepared beside it; later passes: until one comes clean;
prefill graphs: the LM prefill captures), the batched engine's start (each bucket's
capture, the admission), and the rest (the page processes' wait, heap settling, the session's row).

    source benchmarks/device_env.sh && CXX=/usr/bin/g++ python3 benchmarks/bench_start.py --out $OUT \\
        --compile-cache /tmp/dc --build --ks 1,2,4 --concurrency 1,128 --max-new-tokens 256 \\
        --without-artifacts 1

One device call is at most 10 minutes: `--budget-s` starts no start past it, and the results are
written after each start; the build can run in a call of its own (`--ks ''`), the starts in the next
on the same warm machine (the cache stays). On a machine without a GPU: `--devices cpu` (K lanes on
the CPU). JSON and markdown into --out (start-<UTC>.{json,md}) with every worker's log.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.bench_scaling import DSOCR, start_redis  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# What a worker's log says as it starts: each lane's Celery "ready" line, each child's first line and
# its "warm" line (one per child).
LANE_READY = re.compile(r"@\S+ ready\.")
CHILD_OPENED = re.compile(r"child \d+ \(pid \d+\) on")
CHILD_WARM = re.compile(r"child \d+: .* warm \(")
PARENT_IMPORTS = re.compile(
    r"imports inherited \((\d+) ms in the worker's parent, begun at ([\d-]+ [\d:.]+) UTC\)"
)


def start(env: dict[str, str], folder: Path, name: str, worker_args: list[str], timeout_s: float,
          children: int = 1, until: str = "children_warm_s",
          once_ready: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """One `dsocr worker --gpus 0 ...` start (queue `name`; a later `--gpus` in `worker_args` wins):
    seconds from launch to the last lane's Celery ready line, the first child's first line and the
    `children`-th warm line, up to `until`; then `once_ready` (its figures under "first_jobs"), then the
    worker is stopped. `launched_at`: the launch in UTC (the ledger's clock)."""
    log_path = folder / f"{name}.log"
    launched_at = datetime.now(UTC).replace(tzinfo=None)
    began = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen([*DSOCR, "worker", "--gpus", "0", "--queue", name, *worker_args], env=env, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    marks: dict[str, Any] = {"launched_at": launched_at.isoformat(sep=" ")}
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and proc.poll() is None and until not in marks:
        text = log_path.read_text(errors="replace")
        now = round(time.perf_counter() - began, 3)
        if len(LANE_READY.findall(text)) >= children:
            marks.setdefault("celery_ready_s", now)
        if CHILD_OPENED.search(text):
            marks.setdefault("child_opened_s", now)
        if len(CHILD_WARM.findall(text)) >= children:
            marks.setdefault("children_warm_s", now)
        time.sleep(0.05)
    if once_ready is not None and until in marks and proc.poll() is None:
        marks["first_jobs"] = once_ready()
    marks["exit"] = proc.poll()  # None: it ran until stopped here
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    inherited = PARENT_IMPORTS.search(log_path.read_text(errors="replace"))
    marks["parent_import_s"] = int(inherited.group(1)) / 1e3 if inherited else None
    if inherited:  # what the worker's command did before: its interpreter and CLI, the ledger's check
        marks["parent_import_began_s"] = (datetime.fromisoformat(inherited.group(2)) - launched_at).total_seconds()
    marks["log"] = log_path.name
    return marks


def first_jobs(env: dict[str, str], db: Path, queue: str, submit_args: list[str], timeout_s: float) -> dict[str, Any]:
    """A run submitted to a worker just ready (`dsocr submit ... --queue queue`): how many of its jobs
    were cold (the ledger's `cold` flag: a compilation, a capture, a new bucket, allocator growth) and
    why, once all have a result or `timeout_s` passed."""
    began = time.perf_counter()
    out = subprocess.run([*DSOCR, "submit", *submit_args, "--queue", queue], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    run_id = out.stdout.strip().splitlines()[-1].strip()  # submit prints the run id last
    with sqlite3.connect(db) as connection:
        (jobs,) = connection.execute("select count(*) from jobs where run_id = ?", (run_id,)).fetchone()
    results: list[tuple[int, str | None]] = []
    while time.perf_counter() - began < timeout_s:
        with sqlite3.connect(db) as connection:
            results = connection.execute("select cold, cold_reason from results where run_id = ?", (run_id,)).fetchall()
        if len(results) >= jobs:
            break
        time.sleep(0.5)
    reasons = sorted({reason for cold, reason in results if cold and reason})
    return {"run_id": run_id, "jobs": jobs, "results": len(results), "cold": sum(bool(cold) for cold, _ in results),
            "cold_reasons": reasons[:5], "s": round(time.perf_counter() - began, 1)}  # fmt: skip


def sessions_since(db: Path, since: str) -> list[dict[str, Any]]:
    """The worker sessions that began at or after `since` (UTC, the ledger's text form)."""
    with sqlite3.connect(db) as connection:
        connection.row_factory = sqlite3.Row
        rows = connection.execute("select pid, device, started_at, ready_at, import_ms, load_ms, warmup_ms, warmup "
                                  "from worker_sessions where started_at >= ? order by started_at", (since,))  # fmt: skip
        return [dict(row) for row in rows]


WARMUP_PHASES = re.compile(r"warm-up [\d.]+ s \(([^)]*)\)")
BATCHED_START = re.compile(r"batched engine: .*?; started in ([\d.]+) s")


def warmup_parts(text: str, warmup_s: float) -> dict[str, float]:
    """A worker session's warm-up (`warmup_s`, its record's `warmup` text) in parts adding up to it: the
    warm-up's phases (artifacts: "load packages"; "pass 1": its jobs, each shape's first calls, with the
    pages prepared beside it; "later passes": theirs; "prefill graphs": their LM prefill captures; "wait
    for the host's compile"),
    the batched engine's start, and the rest."""
    parts: dict[str, float] = {}
    for phases in WARMUP_PHASES.findall(text):
        for phase in phases.split(", "):  # "load packages 0.06 s", "pass 1 3.79 s"
            name, seconds, _ = phase.rsplit(" ", 2)
            key = ("pass 1" if name == "pass 1" else "later passes" if name.startswith("pass ")
                   else "prefill graphs" if name.startswith("prefill graphs")
                   else "artifacts" if name == "load packages" else name)  # fmt: skip
            parts[key] = parts.get(key, 0.0) + float(seconds)
    batched = BATCHED_START.search(text)
    if batched:
        parts["batched start"] = float(batched.group(1))
    parts["rest of warm-up"] = warmup_s - sum(parts.values())
    return parts


def start_parts(marks: dict[str, Any], rows: list[dict[str, Any]], children: int) -> dict[str, Any]:
    """The start's total (launch → its last child's `ready_at`) and that child's parts: the worker
    command's CLI (launch → the parent's imports), imports (the ledger check beside them), Celery and the
    fork, load, the warm-up's parts (`warmup_parts`), adding up to it. `rows`: the worker's sessions in the order they
    began, its children's start-ups first (a session a first job began after them is no part of the
    start)."""
    ready = [row for row in rows[:children] if row["ready_at"]]
    if len(ready) < children:
        return {"children_ready": len(ready)}
    launched = datetime.fromisoformat(marks["launched_at"])
    slowest = max(ready, key=lambda row: datetime.fromisoformat(row["ready_at"]))
    total = (datetime.fromisoformat(slowest["ready_at"]) - launched).total_seconds()
    opened = (datetime.fromisoformat(slowest["started_at"]) - launched).total_seconds()
    imports, before = marks.get("parent_import_s"), marks.get("parent_import_began_s", 0.0)
    if imports is None:  # not inherited: the child imported for itself (its own figure)
        imports = (slowest["import_ms"] or 0) / 1e3
    load, warmup = (slowest["load_ms"] or 0) / 1e3, (slowest["warmup_ms"] or 0) / 1e3
    parts = {**({"CLI": before} if before else {}), "imports": imports,
             "Celery and fork": opened - before - imports, "load": load,
             **warmup_parts(slowest["warmup"] or "", warmup)}  # fmt: skip
    parts["other"] = total - sum(parts.values())
    artifacts = "prebuilt artifacts" in (slowest["warmup"] or "")
    return {"children_ready": len(ready), "total_s": round(total, 3), "artifacts_used": artifacts,
            "parts_s": {name: round(value, 3) for name, value in parts.items()}}  # fmt: skip


FLOOR = """
import json, sys, time
from dsocr_workers.engine.coldstart.cache import use_bytecode_cache
use_bytecode_cache()  # the bytecode a build wrote, where the installation ships none (as a worker reads it)
began = time.perf_counter()
import torch
imported = time.perf_counter()
model, device = sys.argv[1], sys.argv[2]
floor = {"torch_import_s": imported - began}
if device == "cuda":
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    floor["cuda_init_s"] = time.perf_counter() - imported
from dsocr_workers.engine.session import DeepSeekOCRSession
session = DeepSeekOCRSession.from_local(model, device=device)
size = sum(t.numel() * t.element_size() for t in [*session.model.parameters(), *session.model.buffers()])
floor["weights_gb"] = size / 1e9
if device == "cuda":
    del session
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(size, dtype=torch.uint8, device="cuda")
    copies = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        copies.append(start.elapsed_time(end) / 1e3)
    floor["weights_to_device_s"] = sorted(copies)[1]
print(json.dumps(floor))
"""


def measure_floor(env: dict[str, str], model: str, device: str) -> dict[str, Any]:
    """The floor in a fresh process (`FLOOR`): torch's import, CUDA's initialisation and the weights'
    copy to the device, and their sum."""
    done = subprocess.run([sys.executable, "-c", FLOOR, model, device], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    floor = json.loads(done.stdout.strip().splitlines()[-1])
    floor["sum_s"] = sum(floor.get(k, 0.0) for k in ("torch_import_s", "cuda_init_s", "weights_to_device_s"))
    return {k: round(v, 3) for k, v in floor.items()}


def device_list(devices: str, k: int) -> str:
    """`dsocr worker --gpus` for K devices: the first K GPUs, or K lanes on the CPU."""
    return ",".join(["cpu"] * k) if devices == "cpu" else ",".join(str(i) for i in range(k))


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


PART_ORDER = ("CLI", "imports", "Celery and fork", "load", "wait for the host's compile", "artifacts",
              "pass 1", "later passes", "prefill graphs", "batched start", "rest of warm-up", "other")  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    floor = report.get("floor", {})
    lines = [f"# A worker's start ({report['device']}, torch {report['torch']}, {report['model']} preset, "
             f"{report['engine']} engine)", "", f"`{report['command']}`", ""]  # fmt: skip
    for build in report.get("builds", []):
        lines.append(f"- build, concurrency {build['concurrency']}: rc {build['rc']}, {build['wall_s']} s"
                     + (" (up to date)" if build.get("up_to_date") else ""))  # fmt: skip
    if floor:
        lines += ["", f"Floor: torch import {floor.get('torch_import_s')} s + CUDA init {floor.get('cuda_init_s', '-')}"
                  f" s + {floor.get('weights_gb')} GB of weights to the device {floor.get('weights_to_device_s', '-')} s"
                  f" = **{floor.get('sum_s')} s**"]  # fmt: skip
    parts = [name for name in PART_ORDER if any(name in s.get("parts_s", {}) for s in report["starts"])]
    lines += ["", "| concurrency | K | artifacts | launch → every child ready s | "
              + " | ".join(parts) + " |", "|---:|---:|---|---:|" + "---:|" * len(parts)]  # fmt: skip
    for s in report["starts"]:
        if "total_s" not in s:
            lines.append(f"| {s['concurrency']} | {s['k']} | {s['cache']} | not ready ({s.get('children_ready', 0)} "
                         f"of {s['k']} children; {s.get('log')}) |" + " |" * len(parts))  # fmt: skip
            continue
        used = "used" if s["artifacts_used"] else "none used"
        cells = [f"{s['parts_s'].get(name, 0.0):.2f}" for name in parts]
        lines.append(f"| {s['concurrency']} | {s['k']} | {s['cache']}: {used} | **{s['total_s']:.2f}** | "
                     + " | ".join(cells) + " |")  # fmt: skip
    checked = [s for s in report["starts"] if "first_jobs" in s]
    if checked:
        lines += ["", "First jobs, submitted once every child was ready (cold: the ledger's flag):", ""]
        for s in checked:
            first = s["first_jobs"]
            said = first.get("error") or (f"{first['results']} of {first['jobs']} results in {first['s']} s, "
                                          f"{first['cold']} cold" + (f" ({'; '.join(first['cold_reasons'])})"
                                                                     if first["cold_reasons"] else ""))  # fmt: skip
            lines.append(f"- concurrency {s['concurrency']}, K = {s['k']}, {s['cache']}: {said}")
    totals = [s["total_s"] for s in report["starts"] if "total_s" in s and s["cache"] == "built"]
    if totals:
        lines += ["", f"Median launch → every child ready over the starts on built artifacts: "
                      f"{statistics.median(totals):.2f} s (max {max(totals):.2f} s)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compile-cache", required=True, help="DSOCR_COMPILE_CACHE_DIR: the build's and the starts'")
    parser.add_argument("--model", default="full")
    parser.add_argument("--engine", default="fast")
    parser.add_argument("--modes", default="gundam")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="1,128", help="the regimes: 1 = batch-1, above 1 = batched")
    parser.add_argument("--ks", default="1,2,4", help="devices per worker (those beyond the machine's are skipped)")
    parser.add_argument("--devices", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--starts", type=int, default=1, help="starts per regime and K on the built artifacts")
    parser.add_argument("--without-artifacts", default="", help="the Ks started once more on an empty cache")
    parser.add_argument("--build", action="store_true", help="run `dsocr precompile` for each regime first")
    parser.add_argument("--build-timeout-s", type=float, default=540)
    parser.add_argument("--timeout-s", type=float, default=150, help="one start's limit")
    parser.add_argument("--budget-s", type=float, default=540, help="no start begins past this many seconds")
    parser.add_argument("--first-jobs", help="a file list submitted to each worker once ready, at its regime's "
                                             "concurrency: how many of its jobs were cold")  # fmt: skip
    args = parser.parse_args()
    if args.first_jobs:  # before minutes of build and starts: a list whose pages were not carried fails now
        from dsocr_workers.farm.filelist import read_filelist

        listed = read_filelist(args.first_jobs)
        if listed.bad or not listed.images:
            raise SystemExit(f"--first-jobs {args.first_jobs}: {listed.describe_bad() or 'no images listed'}")
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    available = torch.cuda.device_count() if args.devices == "gpu" else 4
    name = torch.cuda.get_device_name(0) if args.devices == "gpu" and available else "CPU"
    report: dict[str, Any] = {"command": " ".join(sys.argv), "device": f"{name} x {available}", "torch": torch.__version__,
                              "model": args.model, "engine": args.engine, "CXX": os.environ.get("CXX", ""),
                              "git_sha": os.environ.get("DSOCR_GIT_SHA", ""), "builds": [], "starts": []}  # fmt: skip
    stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime())

    def save() -> None:
        (out / f"start-{stamp}.json").write_text(json.dumps(report, indent=2, default=str))
        (out / f"start-{stamp}.md").write_text(markdown(report))

    redis_bin = shutil.which("redis-server")
    assert redis_bin, "no redis-server: carry .redis (benchmarks/README.md)"
    regimes = ints(args.concurrency)
    plan = ["--model", args.model, "--engine", args.engine, "--max-new-tokens", str(args.max_new_tokens)]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        redis, broker_url = start_redis(redis_bin, folder)
        db = folder / "ledger.db"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DSOCR_COMPILE_CACHE_DIR": args.compile_cache,
               "DSOCR_BROKER_URL": broker_url, "DSOCR_DATABASE_URL": f"sqlite:///{db}"}  # fmt: skip
        try:
            subprocess.run([*DSOCR, "db", "upgrade"], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
            for concurrency in regimes if args.build else []:
                built_at = time.perf_counter()
                build_log = out / f"precompile-c{concurrency}.log"
                with open(build_log, "w") as build_out:  # straight into --out: a call cut short keeps it
                    built = subprocess.run([*DSOCR, "precompile", *plan, "--modes", args.modes, "--concurrency",
                                            str(concurrency), "--gpus", "cpu" if args.devices == "cpu" else "0"],
                                           env=env, cwd=REPO, stdout=build_out, stderr=subprocess.STDOUT,
                                           timeout=args.build_timeout_s)  # fmt: skip
                report["builds"].append({"concurrency": concurrency, "rc": built.returncode,
                                         "wall_s": round(time.perf_counter() - built_at, 1),
                                         "up_to_date": "up to date" in build_log.read_text()})  # fmt: skip
                log(f"build: {report['builds'][-1]}")
                save()
            report["floor"] = measure_floor(env, args.model, "cuda" if args.devices == "gpu" else "cpu")
            log(f"floor: {report['floor']}")
            save()
            ks = [k for k in ints(args.ks) if k <= available]
            planned = [(c, k, "built") for c in regimes for k in ks for _ in range(args.starts)]
            planned += [(c, k, "empty") for c in regimes for k in ints(args.without_artifacts) if k <= available]
            for index, (concurrency, k, cache) in enumerate(planned):
                if time.perf_counter() - began > args.budget_s:
                    log(f"budget spent: {len(planned) - index} start(s) not run")
                    break
                start_env = env if cache == "built" else {**env, "DSOCR_COMPILE_CACHE_DIR": str(folder / f"empty{index}")}
                worker = [*plan, "--warmup", args.modes, "--concurrency", str(concurrency),
                          "--gpus", device_list(args.devices, k)]  # fmt: skip
                queue = f"start{index}-c{concurrency}-k{k}-{cache}"
                check = None
                if args.first_jobs:
                    # As the worker was warmed (no --ignore-eos: other decode options would start an engine of
                    # their own).
                    submitted = [args.first_jobs, *plan, "--mode", args.modes.split(",")[0], "--concurrency",
                                 str(concurrency)]  # fmt: skip
                    check = functools.partial(first_jobs, start_env, db, queue, submitted, args.timeout_s)
                marks = start(start_env, out, queue, worker, args.timeout_s, children=k, once_ready=check)
                rows = sessions_since(db, marks["launched_at"])
                report["starts"].append({"concurrency": concurrency, "k": k, "cache": cache, **marks,
                                         **start_parts(marks, rows, k), "sessions": rows})  # fmt: skip
                log(f"start c{concurrency} k{k} {cache}: {report['starts'][-1].get('total_s')} s")
                save()
        finally:
            redis.terminate()
            redis.wait()
            save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
