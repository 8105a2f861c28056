"""Scaling benchmark (issue 8 item 7): one job set through Redis + Celery to K = 1..N GPUs of one host.

For each engine and each K, in this order:
  1. start `dsocr worker --gpus 0,..,K-1 --queue Q --warmup MODE --model M --engine E --max-new-tokens N
     [--concurrency C]` as a subprocess: each child loads the model and warms it (compile + graph capture
     for the fast engine; with C, the first level's concurrency above 1, its batched engine started too)
     before it takes a message; wait until all K children are ready (their worker sessions);
  2. `dsocr submit` the same job set (file list x repeats) to that queue: a new run; with
     `--concurrency 1,32,128` a run per level, one after another on the same worker, each with at
     least GENERATIONS x level x K jobs (its batches fill, turn over and drain), their Serving figures in
     a table of their own and, per K, the report's throughput-against-latency plot over the levels
     (scaling-<date>-sweep-k<K>.png); with --scale-at-best the Ks after the first run only its best level
     (most output tokens/s), so one command gives the sweep and K = 2 and 4 at its best point. Submitting only
     once every worker is ready matters: children warm at different speeds (two fast-engine children
     compiling side by side: 50 s and 102 s), and a job set shorter than that skew runs on one GPU;
  3. poll the ledger until every job of the run is final (done / failed / poisoned);
  4. stop the worker with SIGTERM (Celery's warm shutdown) and wait for it to exit.
Then one table per engine: jobs, cold jobs, steady-state pages/s with its 95% interval, the ratio to K = 1
with its interval, and the submit-to-last-result wall clock, from
`dsocr_workers.report.throughput` (the same numbers `dsocr report` prints); the wall clock runs from
submit, so it holds no model load here: loads and warm-ups are listed per worker session. JSON + markdown go to
--out (default benchmarks/results/) as scaling-<UTC date>.{json,md}; with --docs docs/benchmarks.md the
same tables, the command and the curves also go there, as its newest section.

A second table (issue 10, prefetch): per run the jobs whose page was prepared while the previous job ran,
the device's idle time between consecutive jobs of a worker (p50 / p90 / max: from one job's readback to
the next one's setup, `device_idle_ms`), the device's time per page (setup to readback, mean over warm
jobs), steady-state pages/s over the rate a device kept busy would reach, sum over workers of
1 / (device time per page), the device's share of each job between jobs (`device_busy_share`: Σ device
time / Σ service time over the jobs that followed another on their worker, paired per job, with its 95%
interval; target ≥ 0.95), and TTFT from the claim and from the device start (p50). Targets: idle ≤ 10 ms,
and pages/s within 5% of 1 / (device time per page), on a queue of two or more pages per worker. The
verdict reads the paired share: the unpaired ratio beside it also holds each worker's first job (its page
prepared with nothing to overlap) and takes the spread of the pages' device times as its own.

Unless --broker-url / --database-url are given, the script starts its own redis-server on a free
127.0.0.1 port (no persistence) and uses a fresh SQLite ledger in a temporary folder, so it touches no
shared Redis or database. DSOCR_COMPILE_CACHE_DIR points at one folder for every worker of the script, as
a deployment's volume per host (torch's compile cache and, where the installation ships none, Python's
bytecode): the K = 2 workers reuse what the K = 1 worker compiled (the graph capture is still theirs);
`--compile-cache DIR` across two invocations measures a restart with a warm cache. `--sweep-dir DIR`
continues a sweep across invocations (a device call too short for all of it): DIR keeps its ledger and
its runs, each invocation runs the levels and Ks the earlier ones did not complete (Ks above the
machine's GPU count left to a later one), and its tables and curves cover them all.

Default job set and why: datasets/samples/samples.txt (7 synthetic pages) in mode `base`. `base` has no
tiles: every page becomes one 1024x1024 view, so the whole set is ONE vision shape, one prompt length
and one KV-cache bucket, and `--warmup base` compiles everything the jobs will meet in one warm-up job
(gundam would need a compile per crop grid, 30-80 s each). 128 tokens with --ignore-eos: a fixed amount
of decode per page. Repeats: eager 4 (28 jobs, ~2.7 s each), fast 12 (84 jobs, ~0.3 s each) so that each
run's steady state spans tens of seconds. On 2 x H200 both engines finish in about 6-8 minutes.

    python benchmarks/bench_scaling.py --gpus all --engines eager,fast --out $OUT
    python benchmarks/bench_scaling.py --gpus cpu --ks 1,2 --model tiny --engines eager \
        --repeats 1 --max-new-tokens 4        # CPU smoke of the script: K CPU children instead of GPUs
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import fmt  # noqa: E402

# `dsocr` without an installed console script (the GPU machine runs from a bare checkout).
DSOCR = [sys.executable, "-c", "from dsocr_workers.cli import main; main()"]
FINAL = ("done", "failed", "poisoned")
DEFAULT_REPEATS = {"eager": 4, "fast": 12}
# K GPUs against one: at least this share of K times one GPU's pages/s (1.9x at K = 2, 3.8x at K = 4).
TARGET_SHARE_PER_GPU = 0.95
TARGET_IDLE_MS, TARGET_BUSY_SHARE = 10.0, 0.95  # issue 10: the device between jobs, pages/s vs device time
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------
# environment


def _run_text(command: list[str], timeout: float = 30) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and GPUs, read without importing torch or touching CUDA in this process."""
    import platform

    import dsocr_workers

    gpus = _run_text(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"])
    rows = [[part.strip() for part in line.split(",")] for line in (gpus or "").splitlines() if line.strip()]
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "celery": _version("celery"),
        # The code measured: with several checkouts on a machine (one of them installed editable), which one.
        "dsocr_workers": str(Path(dsocr_workers.__file__).resolve().parent),
        "gpus": [{"index": r[0], "name": r[1], "memory": r[3]} for r in rows if len(r) >= 4],
        "gpu": rows[0][1] if rows else None,
        "driver": rows[0][2] if rows else None,
        "git_sha": os.environ.get("DSOCR_GIT_SHA") or _run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"]),
    }


def count_gpus() -> int:
    out = _run_text(["nvidia-smi", "-L"])
    return sum(line.startswith("GPU ") for line in (out or "").splitlines())


# ---------------------------------------------------------------------------------------------------
# Redis and the ledger


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(binary: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """A private redis-server on a free port, no persistence; returns the process and its URL."""
    port = free_port()
    logfile = open(folder / "redis.log", "w")  # noqa: SIM115 (kept open for the server's lifetime)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder), "--daemonize", "no", "--protected-mode", "yes"],
        stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            if client.ping():
                break
        except redis.exceptions.RedisError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not start: {(folder / 'redis.log').read_text()[-2000:]}")
        time.sleep(0.1)
    client.close()
    return proc, url


def prepare_ledger(url: str, create: bool) -> None:
    from dsocr_workers.store.db import check_schema, open_database, upgrade

    db = open_database(url)
    try:
        if create:
            upgrade(db)
        check_schema(db)
    finally:
        db.dispose()


def given_ledger_error(url: str) -> tuple[int, str] | None:
    """Why the --database-url ledger cannot be used, as (exit code, one line), or None if it can. Asked
    before Redis or a worker starts, so that a wrong ledger costs nothing to find out. The codes are dsocr's
    own: 2 a schema to create or upgrade (or a bad URL), 3 the database unreachable."""
    from dsocr_workers.errors import DsocrError
    from dsocr_workers.store.db import SchemaError

    try:
        prepare_ledger(url, create=False)
    except SchemaError as exc:  # `dsocr db upgrade` takes its URL from the environment, not an option
        return exc.exit_code, f"{exc} (with DSOCR_DATABASE_URL set to that URL)"
    except DsocrError as exc:  # driver messages span lines ("Is the server running ...?"): one line
        return exc.exit_code, " ".join(str(exc).split())
    return None


def output_folders(out: Path | None, keep_logs: Path | None) -> Path:
    """Create the results folder and the --keep-logs folder (parents too) before any run, so that a
    missing folder is not found at the first copy, after a worker's run; returns the results folder."""
    out_dir = out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results")
    for folder in filter(None, (out_dir, keep_logs)):
        folder.mkdir(parents=True, exist_ok=True)
    return out_dir


def job_counts(db: Any, run_id: str) -> Counter[str]:
    from dsocr_workers.store import ledger

    with db.transaction() as session:
        return ledger.job_counts(session, run_id)


# ---------------------------------------------------------------------------------------------------
# one run: submit, worker, wait, stop


def worker_options(env: dict[str, str]) -> set[str]:
    """The options of this checkout's `dsocr worker` (--warmup and --model/--engine came with issue 8)."""
    out = subprocess.run([*DSOCR, "worker", "--help"], capture_output=True, text=True, env=env, cwd=REPO)
    return set(re.findall(r"(--[a-z][a-z-]+)", out.stdout))


def submit(args: argparse.Namespace, engine: str, k: int, queue: str, repeats: int, env: dict[str, str],
           concurrency: int) -> str:  # fmt: skip
    command = [
        *DSOCR, "submit", str(args.filelist), "--model", args.model, "--engine", engine, "--mode", args.mode,
        "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(repeats), "--queue", queue,
        "--name", f"scaling-{engine}-k{k}" + (f"-c{concurrency}" if concurrency > 1 else ""),
        "--tag", "bench=scaling", "--tag", f"k={k}", "--tag", f"engine={engine}",
        "--tag", f"concurrency={concurrency}",
    ]  # fmt: skip
    if args.ignore_eos:
        command.append("--ignore-eos")
    if args.profile:
        command += ["--profile", str(args.profile)]
    if concurrency > 1:
        command += ["--concurrency", str(concurrency)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"dsocr submit failed ({out.returncode}): {out.stderr[-2000:]}")
    last = out.stdout.strip().splitlines()[-1].strip()  # submit prints the run id last
    if not re.fullmatch(r"[0-9a-f]{8,32}", last):
        raise RuntimeError(f"dsocr submit: no run id in its output: {out.stdout[-1000:]}")
    return last


def worker_command(
    args: argparse.Namespace, engine: str, k: int, queue: str, options: set[str], concurrency: int = 1
) -> list[str]:
    if args.gpus == "cpu":
        devices = ["--gpus", ",".join(["cpu"] * k)]
    else:
        devices = ["--gpus", ",".join(str(i) for i in range(k))]
    command = [*DSOCR, "worker", *devices, "--queue", queue, "--loglevel", args.worker_loglevel]
    if "--warmup" in options:
        command += ["--warmup", args.warmup]
    if "--model" in options and "--engine" in options:  # what to warm: no run is open yet
        command += ["--model", args.model, "--engine", engine]
    if "--max-new-tokens" in options and args.max_new_tokens:
        command += ["--max-new-tokens", str(args.max_new_tokens)]
    # The batched engine of the first level started before the worker is ready: its start is the
    # worker's, not inside that level's timed run.
    if "--concurrency" in options and concurrency > 1:
        command += ["--concurrency", str(concurrency)]
    return command


def wait_ready(db: Any, since: dt.datetime, k: int, proc: subprocess.Popen, timeout_s: float) -> int:
    """Wait until k worker sessions started after `since` are ready; returns how many are."""
    from sqlalchemy import func, select

    from dsocr_workers.store.models import WorkerSession

    deadline = time.monotonic() + timeout_s
    while True:
        with db.transaction() as session:
            ready = session.scalar(select(func.count()).select_from(WorkerSession).where(
                WorkerSession.started_at >= since, WorkerSession.ready_at.is_not(None)))  # fmt: skip
        if ready >= k or proc.poll() is not None or time.monotonic() > deadline:
            return int(ready or 0)
        time.sleep(1.0)


def stop_worker(proc: subprocess.Popen, grace_s: float) -> dict[str, Any]:
    """SIGTERM (warm shutdown: the current job finishes), then wait; SIGKILL the group if it hangs."""
    began = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log(f"worker pid {proc.pid} still up after {grace_s:.0f} s: SIGKILL to its process group")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return {"exit_code": proc.returncode, "stop_s": round(time.monotonic() - began, 2)}


def tail(path: Path, lines: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# A run at concurrency c on K workers gets at least this many times c x K jobs (more repeats of the file
# list than --repeats where needed): each batch fills, turns over and drains, and its steady window (from
# its first finish to its last claim: about GENERATIONS - 2 turnovers) holds the report's MIN_BINS bins of
# a turnover each (report/throughput.py): with 3, one-second bins of two turnovers gave ±7-23% intervals.
GENERATIONS = 10


def listed_pages(filelist: Path) -> int:
    """The pages of a file list (comments and blank lines aside): the jobs of one repeat."""
    lines = [line.strip() for line in filelist.read_text().splitlines()]
    return sum(1 for line in lines if line and not line.startswith("#"))


def level_repeats(repeats: int, concurrency: int, k: int, pages: int, generations: int = GENERATIONS) -> int:
    """Repeats of a `pages`-page list for a run at `concurrency` on K workers: at least `repeats`, and
    enough jobs for the batch to turn over, `generations` x the jobs K workers hold."""
    return max(repeats, -(-generations * concurrency * k // max(pages, 1)))


def one_run(
    args: argparse.Namespace, engine: str, k: int, repeats: int, env: dict[str, str], tmp: Path,
    db: Any, options: set[str], budget_s: float, levels: list[int],
) -> list[dict[str, Any]]:
    """One worker on K devices, a run per concurrency level on it (one after another, each to its end):
    a record per level. `budget_s` bounds it all (the worker's start included); each run has
    --run-timeout-s from its submit within it."""
    queue = f"scaling-{engine}-k{k}-{os.getpid()}-{int(time.time())}"
    base: dict[str, Any] = {"engine": engine, "k": k, "queue": queue, "repeats": repeats}
    command = worker_command(args, engine, k, queue, options, levels[0])
    base["worker_command"] = shlex.join(command[3:])  # without the interpreter boilerplate
    logpath = tmp / f"worker-{engine}-k{k}.log"
    records: list[dict[str, Any]] = []
    with open(logpath, "w") as logfile:
        started, since = time.monotonic(), dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(seconds=1)
        proc = subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)  # fmt: skip
        log(f"{engine} K={k}: worker pid {proc.pid}: {base['worker_command']}")
        try:
            ready = wait_ready(db, since, k, proc, budget_s)
            base["ready_after_s"] = round(time.monotonic() - started, 2)
            log(f"{engine} K={k}: {ready}/{k} worker children ready after {base['ready_after_s']} s")
            for concurrency in levels:
                repeats_here = level_repeats(repeats, concurrency, k, args.pages, args.generations)
                record = {**base, "concurrency": concurrency, "repeats": repeats_here}
                records.append(record)
                left = budget_s - (time.monotonic() - started)
                if left < 30:
                    record["status"] = "skipped: out of --budget-s"
                    continue
                record.update(run_level(args, engine, k, repeats_here, env, db, queue, concurrency, proc, logpath,
                                        min(args.run_timeout_s, left)))  # fmt: skip
                if record["status"] != "complete":
                    break
        finally:
            stopped = stop_worker(proc, args.stop_grace_s)
            for record in records:
                record.update(stopped, worker_elapsed_s=round(time.monotonic() - started, 2))
    tail_lines = tail(logpath, 40 if any(r.get("status") != "complete" for r in records) else 6)
    for record in records:
        record["worker_log_tail"] = tail_lines
    if args.keep_logs:
        shutil.copy(logpath, args.keep_logs / logpath.name)
    log(f"{engine} K={k}: worker stopped (exit {stopped['exit_code']}) in {stopped['stop_s']} s")
    return records


def run_level(
    args: argparse.Namespace, engine: str, k: int, repeats: int, env: dict[str, str], db: Any, queue: str,
    concurrency: int, proc: subprocess.Popen, logpath: Path, timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    """One run at `concurrency` on the worker's queue, polled until every job is final."""
    started = time.monotonic()
    name = f"{engine} K={k}" + (f" c={concurrency}" if concurrency > 1 else "")
    run_id = submit(args, engine, k, queue, repeats, env, concurrency)
    total = sum(job_counts(db, run_id).values())
    log(f"{name}: run {run_id}, {total} jobs on queue {queue}")
    last_print, last_final, first_final_at = 0.0, -1, None
    status = "complete"
    while True:
        counts = job_counts(db, run_id)
        final = sum(counts.get(s, 0) for s in FINAL)
        now = time.monotonic()
        if final > 0 and first_final_at is None:
            first_final_at = now - started
        if final != last_final and (now - last_print > 10 or final == total) or now - last_print > 30:
            states = " ".join(f"{s} {counts.get(s, 0)}" for s in ("queued", "running", *FINAL))
            log(f"{name}: {final}/{total} final ({states})")
            last_print, last_final = now, final
        if final >= total:
            break
        if proc.poll() is not None:
            status = f"worker exited early with code {proc.returncode}"
            log(f"{name}: {status}; log tail:\n" + "\n".join(tail(logpath, 40)))
            break
        if now - started > timeout_s:
            status = f"timed out after {timeout_s:.0f} s with {final}/{total} final"
            log(f"{name}: {status}")
            break
        time.sleep(args.poll_s)
    log(f"{name}: {status}")
    return {"run_id": run_id, "jobs_submitted": total, "status": status, "final_counts": dict(job_counts(db, run_id)),
            "run_elapsed_s": round(time.monotonic() - started, 2),
            "first_final_after_s": round(first_final_at, 2) if first_final_at is not None else None}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# statistics (the report module's: the same numbers as `dsocr report`)


def _estimate_dict(estimate: Any) -> dict[str, Any] | None:
    if estimate is None:
        return None
    return {"value": estimate.value, "low": estimate.low, "high": estimate.high, "n": estimate.n}


def load(db: Any, run_id: str) -> Any:
    from dsocr_workers.report.queries import load_run

    with db.transaction() as session:
        data = load_run(session, run_id)
        session.expunge_all()  # keep the rows readable after the transaction
    return data


def prefetch_stats(data: Any) -> dict[str, Any]:
    """Issue 10's figures for one run (see the module docstring); empty where this checkout's ledger
    does not store them (before migration 0005)."""
    import numpy as np

    try:
        from dsocr_workers.report.throughput import (
            device_busy_share,
            device_idle_ms,
            device_ms_per_page,
            steady_state_throughput,
        )
    except ImportError:
        return {}
    warm = [r for r in data.results.values() if not r.cold]
    idle = [ms for lane in device_idle_ms(data).values() for ms in lane]
    per_page = device_ms_per_page(data)
    # A device kept busy runs 1 / (its time per page) pages a second; the workers run side by side.
    busy_rate = sum(1e3 / float(np.mean(ms)) for ms in per_page.values() if ms) or None
    estimate = steady_state_throughput(data)
    steady = estimate.value

    def percentile(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    claim = [r.ttft_from_claim_ms for r in warm if r.ttft_from_claim_ms is not None]
    start = [r.ttft_from_device_start_ms for r in warm if r.ttft_from_device_start_ms is not None]
    return {
        "prefetched": sum(bool(r.prefetched) for r in data.results.values()),
        "results": len(data.results),
        "device_idle_ms": {"n": len(idle), "p50": percentile(idle, 50), "p90": percentile(idle, 90),
                           "max": max(idle) if idle else None},  # fmt: skip
        "device_ms_per_page_mean": float(np.mean([ms for lane in per_page.values() for ms in lane])) if per_page else None,
        "busy_device_pages_per_s": busy_rate,
        "steady_over_busy_device": steady / busy_rate if steady and busy_rate else None,
        # The steady rate's 95% interval over the busy rate, taken as exact (a mean over every warm job).
        "steady_over_busy_device_ci": [estimate.low / busy_rate, estimate.high / busy_rate]
        if busy_rate and estimate.low is not None and estimate.high is not None else None,
        "device_busy_share": _estimate_dict(device_busy_share(data)),
        "ttft_from_claim_ms_p50": percentile(claim, 50),
        "ttft_from_device_start_ms_p50": percentile(start, 50),
        "page_wait_ms_p50": percentile([r.page_wait_ms for r in warm if r.prefetched and r.page_wait_ms is not None], 50),
    }


def prefetch_verdict(stats: dict[str, Any]) -> str:
    idle, share = stats.get("device_idle_ms", {}).get("p90"), stats.get("device_busy_share") or {}
    value, low, high = share.get("value"), share.get("low"), share.get("high")
    if idle is None or value is None:
        return "not measured"
    text = f"device share of a job between jobs {value:.3f}"
    if value < TARGET_BUSY_SHARE:
        text += f" < {TARGET_BUSY_SHARE}"
    elif low is None:
        text += f" ≥ {TARGET_BUSY_SHARE} (no interval: not shown)"
    elif low >= TARGET_BUSY_SHARE:
        text += f" ≥ {TARGET_BUSY_SHARE} shown (95% interval {low:.3f}-{high:.3f})"
    else:
        text += f" ≥ {TARGET_BUSY_SHARE} by the estimate, not shown (95% interval {low:.3f}-{high:.3f})"
    return f"idle p90 {idle:.1f} ms {'≤' if idle <= TARGET_IDLE_MS else '>'} {TARGET_IDLE_MS:.0f}; {text}"


def throughput_functions() -> tuple[Any, Any, Any, str | None]:
    """(steady_state_throughput, throughput_ratio, wall_clock_s, note)."""
    try:
        from dsocr_workers.report.throughput import steady_state_throughput, throughput_ratio, wall_clock_s

        return steady_state_throughput, throughput_ratio, wall_clock_s, None
    except ImportError as exc:
        note = f"dsocr_workers.report.throughput not importable ({exc}): no steady-state figures or intervals"
        return None, None, None, note


def _wall_clock_s(data: Any) -> float | None:
    """Submit (the run's creation) to its last result: used only where the report module is missing."""
    ends = [j.finished_at for j in data.jobs if j.id in data.results and j.finished_at is not None]
    return (max(ends) - data.run.created_at).total_seconds() if ends else None


def timeline(data: Any) -> list[dict[str, Any]]:
    """Per job, in seconds from the run's creation: the claim, the device's start and end, the ledger's
    finish; so the idle, device-time and throughput figures can be checked against one another."""

    def since(at: Any) -> float | None:
        return None if at is None else round((at - data.run.created_at).total_seconds(), 6)

    rows = [
        {
            "job": job.id[:12], "device": result.device, "session": (result.worker_session_id or "")[:8],
            "claimed_s": since(job.started_at), "device_started_s": since(getattr(result, "device_started_at", None)),
            "device_finished_s": since(getattr(result, "device_finished_at", None)), "finished_s": since(job.finished_at),
            "e2e_ms": result.e2e_ms, "prefetched": getattr(result, "prefetched", None),
            "page_wait_ms": getattr(result, "page_wait_ms", None), "cold": getattr(result, "cold", False),
        }
        for job in data.jobs
        if (result := data.results.get(job.id)) is not None
    ]  # fmt: skip
    return sorted(rows, key=lambda row: row["claimed_s"] if row["claimed_s"] is not None else float("inf"))


# The three parts of the device's idle time between two jobs of one worker session: (name, start, end),
# each a `timeline` field of the earlier job ("previous") or the later one ("next").
GAP_PARTS = (
    ("device end → job finished", ("previous", "device_finished_s"), ("previous", "finished_s")),
    ("→ next claim", ("previous", "finished_s"), ("next", "claimed_s")),
    ("claim → device start", ("next", "claimed_s"), ("next", "device_started_s")),
)


def gap_split(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """p50 / p90 in ms of each of `GAP_PARTS` over the consecutive jobs of each worker session.
    `finished_s` is the job's finish as the ledger stores it, `claimed_s` the claim's start."""
    import numpy as np

    parts: dict[str, list[float]] = {name: [] for name, *_ in GAP_PARTS}
    for session in {row["session"] for row in rows}:
        lane = [row for row in rows if row["session"] == session]
        for previous, following in itertools.pairwise(lane):
            jobs = {"previous": previous, "next": following}
            for name, (start_job, start), (end_job, end) in GAP_PARTS:
                begin, finish = jobs[start_job][start], jobs[end_job][end]
                if begin is not None and finish is not None:
                    parts[name].append((finish - begin) * 1e3)
    return {name: {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90))} for name, v in parts.items() if v}


def run_stats(data: Any, base: Any | None, functions: tuple[Any, Any, Any, str | None]) -> dict[str, Any]:
    steady, ratio, wall_clock, _ = functions
    results = list(data.results.values())
    states = Counter(job.state for job in data.jobs)
    cold = [r for r in results if getattr(r, "cold", False)]
    warm_p50 = sorted(r.decode_ms_per_token_p50 for r in results
                      if not getattr(r, "cold", False) and r.decode_ms_per_token_p50 is not None)  # fmt: skip
    stats: dict[str, Any] = {
        "jobs": len(data.jobs),
        "done": states.get("done", 0),
        "failed": states.get("failed", 0) + states.get("poisoned", 0),
        "results": len(results),
        "cold_jobs": len(cold),
        "cold_reasons": sorted({getattr(r, "cold_reason", None) or "" for r in cold} - {""}),
        "random_weights": bool(data.run.random_weights),
        "model_label": data.run.model_label,
        "decode_ms_per_token_p50_median_warm": warm_p50[len(warm_p50) // 2] if warm_p50 else None,
        "devices": sorted({r.device for r in results}),
    }
    wall = wall_clock(data) if wall_clock is not None else _wall_clock_s(data)
    stats["wall_clock_s"] = wall
    stats["pages_per_s_wall"] = stats["done"] / wall if wall else None
    if steady is not None:
        stats["steady_pages_per_s"] = _estimate_dict(steady(data))
        stats["ratio_to_k1"] = _estimate_dict(ratio(data, base)) if base is not None else None
    sessions = getattr(data, "sessions", None) or {}
    stats["prefetch"] = prefetch_stats(data)
    stats["worker_sessions"] = [
        {
            "device": s.device, "engine": s.engine, "warmup": s.warmup, "load_ms": s.load_ms,
            "warmup_ms": s.warmup_ms,
            "start_to_ready_s": (s.ready_at - s.started_at).total_seconds() if s.ready_at and s.started_at else None,
        }
        for s in sessions.values()
    ]  # fmt: skip
    stats["timeline"] = timeline(data)
    if int((data.run.parameters or {}).get("concurrency", 1)) == 1:  # a batched run's jobs overlap: no gaps
        stats["gap_split_ms"] = gap_split(stats["timeline"])
    stats["serving"] = serving_stats(data)
    stats["steps"] = step_stats(data)
    return stats


def serving_stats(data: Any) -> dict[str, Any] | None:
    """The report's Serving figures (report/serving.py) of a run: output tokens/s, TTFT, TPOT, ITL, the
    batch occupancy, pages/day per GPU."""
    try:
        from dsocr_workers.report.serving import serving
    except ImportError:  # an older package without the serving table
        return None
    figures = serving(data)
    return {"concurrency": figures.concurrency, "gpus": figures.gpus,
            "output_tokens_per_s": figures.output_tokens_per_s, "pages_per_day_per_gpu": figures.pages_per_day_per_gpu,
            **{f"{name}_p50": getattr(figures, name).p50.value for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
            "ttft_ms_p90": figures.ttft_ms.p90.value, "tpot_ms_p90": figures.tpot_ms.p90.value,
            "ttft_ms_p99": figures.ttft_ms.p99.value, "itl_ms_p99": figures.itl_ms.p99.value,
            "occupancy_mean": figures.occupancy.mean.value}  # fmt: skip


def step_stats(data: Any) -> dict[str, Any] | None:
    """The report's Batch steps figures (report/serving.py) of a run at concurrency above 1: its prefills'
    p50 / p90 / mean, the decode step at 64+ pages, the prefills' share of the time in steps and that time
    per GPU against the wall span. None for a batch-1 run."""
    from dsocr_workers.report.serving import batch_steps

    figures = batch_steps(data)
    if not figures.decode_steps:
        return None
    top = figures.decode_bands.get("64+")
    return {"prefill_steps": figures.prefill_steps, "split_prefills": figures.split_prefills,
            "decode_steps": figures.decode_steps,
            "prefill_p50_ms": figures.prefill_p50_ms, "prefill_p90_ms": figures.prefill_p90_ms,
            "prefill_mean_ms": figures.prefill_mean_ms, "decode_64_p50_ms": top.p50_ms if top else None,
            "decode_64_kv_per_page": top.kv_per_page if top else None,
            "decode_64_kv_longest": top.kv_longest if top else None,
            "prefill_share": figures.prefill_share, "step_share_of_span": figures.step_share_of_span}  # fmt: skip


def sweep_plot(db: Any, report: dict[str, Any], engine: str, out_dir: Path) -> None:
    """Per K, the report's throughput-against-latency plot over the sweep's runs (one point per level),
    written beside the tables as scaling-<date>-sweep-k<K>.png."""
    from dsocr_workers.report.plots import Side, throughput_vs_latency

    by_k: dict[int, list[Side]] = {}
    for record in report["runs"]:
        if record["engine"] == engine and record.get("status") == "complete" and "run_id" in record:
            name = f"c={record['concurrency']}"
            by_k.setdefault(record["k"], []).append(Side(name, name, load(db, record["run_id"])))
    stamp = report["environment"]["date"].replace(" ", "T").replace(":", "")[:15]
    for k, sides in by_k.items():
        path = out_dir / f"scaling-{stamp}-sweep-k{k}.png"
        path.write_bytes(throughput_vs_latency(sides, include_cold=False).png)
        report.setdefault("plots", []).append(path.name)


def publish(docs: Path, report: dict[str, Any], md_path: Path, out_dir: Path) -> None:
    """The run's tables, command and curves as the newest section of `docs` (docs/benchmarks.md: after
    its preamble, before its first `## ` section), the curves linked where they were written."""
    env = report["environment"]
    title = f"## bench_scaling on {env.get('gpu')} x {len(env.get('gpus') or [])}, {env['date']}"
    body = markdown(report).split("\n", 2)[2].strip()  # its own `###` title dropped
    section = [title, "", body]
    for name in report.get("plots", []):
        section += ["", f"![throughput against latency over the concurrency levels]({os.path.relpath(out_dir / name, docs.parent)})"]
    section += ["", f"Raw: `{os.path.relpath(md_path, docs.parent)}` and its `.json`.", "", ""]
    text = docs.read_text() if docs.is_file() else "# Benchmarks\n\n"
    at = text.find("\n## ")
    at = len(text) if at < 0 else at + 1
    docs.write_text(text[:at] + "\n".join(section) + text[at:])


def best_level(runs: list[dict[str, Any]], engine: str, k: int) -> int | None:
    """The concurrency level of `engine` at K = `k` with the most output tokens/s (None: no level has the
    figure)."""
    served = [(r["stats"]["serving"]["output_tokens_per_s"], r.get("concurrency", 1)) for r in runs
              if r["engine"] == engine and r["k"] == k and ((r.get("stats") or {}).get("serving") or {}).get("output_tokens_per_s")]  # fmt: skip
    return max(served)[1] if served else None


# What the calls of one sweep (--sweep-dir) must share for their levels to stand in one table.
SWEEP_SETTINGS = ("filelist", "model", "mode", "warmup", "max_new_tokens", "ignore_eos", "generations")


def earlier_sweep(folder: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The complete runs earlier calls of this sweep recorded in `folder`'s sweep.json (none before its
    first call); a level cut short there runs again. Raises ValueError naming the settings that differ."""
    path = folder / "sweep.json"
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    differ = [f"{key} {saved['settings'].get(key)!r} there, {settings.get(key)!r} here" for key in SWEEP_SETTINGS
              if saved["settings"].get(key) != settings.get(key)]  # fmt: skip
    if differ:
        raise ValueError(f"the sweep in {folder} was run with other settings: {'; '.join(differ)}")
    return [r for r in saved["runs"] if r.get("status") == "complete" and "run_id" in r]


def levels_left(done: list[dict[str, Any]], engine: str, k: int, levels: list[int]) -> list[int]:
    """`levels` of `engine` at K = `k` that no earlier call of the sweep completed."""
    finished = {r["concurrency"] for r in done if r["engine"] == engine and r["k"] == k}
    return [c for c in levels if c not in finished]


def compact_sweep_ledger(database_url: str, run_ids: list[str]) -> None:
    """Drop the per-token parts of `run_ids`' results (step times, token ids, markup, boxes) once their
    statistics are recorded in sweep.json, then shrink the SQLite file: what a later call reads back (the
    K = 1 runs' job times for a ratio, the serving figures for the curve) stays, and the ledger of a whole
    sweep at 1,024 tokens (~30 KB a job as it was) travels to the next device call within its carry."""
    import sqlite3

    from sqlalchemy import update

    from dsocr_workers.store.db import open_database
    from dsocr_workers.store.models import Result

    db = open_database(database_url)
    try:
        with db.transaction() as tx:
            tx.execute(update(Result).where(Result.run_id.in_(run_ids)).values(
                decode_step_ms=[], token_ids=[], markup="", boxes=[]))  # fmt: skip
    finally:
        db.dispose()
    # VACUUM runs outside any transaction, which the ledger's engine always opens.
    connection = sqlite3.connect(database_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        connection.execute("VACUUM")
    finally:
        connection.close()


def verdict(ratio: dict[str, Any] | None, target: float) -> str:
    if not ratio or ratio.get("value") is None:
        return "no ratio"
    if ratio.get("low") is None or ratio.get("high") is None:
        return f"ratio {ratio['value']:.2f}, no interval: not shown either way"
    if ratio["low"] >= target:
        return f"≥ {target}x shown (95% interval {ratio['low']:.2f}-{ratio['high']:.2f})"
    if ratio["high"] < target:
        return f"below {target}x shown (95% interval {ratio['low']:.2f}-{ratio['high']:.2f})"
    return f"unresolved: the 95% interval {ratio['low']:.2f}-{ratio['high']:.2f} contains {target}"


# ---------------------------------------------------------------------------------------------------
# output


def _ci(estimate: dict[str, Any] | None, digits: int = 2) -> str:
    if not estimate or estimate.get("value") is None:
        return "-"
    text = fmt(estimate["value"], digits)
    if estimate.get("low") is not None and estimate.get("high") is not None:
        text += f" [{fmt(estimate['low'], digits)}, {fmt(estimate['high'], digits)}]"
    return text


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    random = any(r.get("stats", {}).get("random_weights") for r in report["runs"])
    lines = [
        f"### Scaling benchmark, {env['date']}",
        "",
        f"GPU {env.get('gpu')} x {len(env.get('gpus') or [])} (driver {env.get('driver')}), torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, celery {env.get('celery')}, Python {env.get('python')}, "
        f"git {(env.get('git_sha') or '-')[:7]}.",
        "",
    ]
    if random:
        lines += [f"> **RANDOM WEIGHTS**: model `{report['settings']['model']}` is a random-weight preset; "
                  "timings are real, outputs are meaningless.", ""]  # fmt: skip
    s = report["settings"]
    lines += [
        f"Job set: `{s['filelist']}` x repeats {s['repeats']}, mode `{s['mode']}`, {s['max_new_tokens']} tokens"
        f"{' (ignore_eos)' if s['ignore_eos'] else ''}, worker warm-up `{s['warmup']}`"
        # No flag recorded: the script stopped before it started a worker (its error is in the notes).
        f"{'' if s.get('warmup_flag', True) else ' (NOT passed: this worker has no --warmup)'}. Broker: {s['broker']}; "
        f"ledger: {s['ledger']}.",
        "",
        "Steady-state pages/s: finished warm jobs over the time warmed workers were busy (cold jobs left out), "
        "95% bootstrap interval; ratio to K = 1 with its interval; wall clock: submit to last result (the "
        "workers are warm before the submit: loads and warm-ups are listed below).",
        "",
        "| engine | K | concurrency | jobs (done / failed) | cold jobs | steady-state pages/s [95% CI] "
        "| ratio to K=1 [95% CI] | wall clock s (submit to last result) | pages/s over wall "
        "| decode ms/token p50 (median of warm jobs) | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        st = r.get("stats", {})
        lines.append(
            f"| {r['engine']} | {r['k']} | {r.get('concurrency', 1)} | {st.get('jobs', r.get('jobs_submitted', '-'))} "
            f"({st.get('done', '-')} / {st.get('failed', '-')}) | {st.get('cold_jobs', '-')} "
            f"| {_ci(st.get('steady_pages_per_s'), 3)} | {_ci(st.get('ratio_to_k1'), 2)} "
            f"| {fmt(st.get('wall_clock_s'), 1)} | {fmt(st.get('pages_per_s_wall'), 3)} "
            f"| {fmt(st.get('decode_ms_per_token_p50_median_warm'), 3)} | {r.get('status', '-')} |"
        )
    lines += [
        "",
        "Prefetch (issue 10): jobs whose page was prepared while the previous job ran; the device's idle time "
        "between a worker's consecutive jobs (readback end to the next setup); the device's time per page (setup "
        "to readback); steady-state pages/s over the rate of devices kept busy, Σ 1 / (device time per page), "
        "with the steady rate's interval; the device's share of a job between jobs, Σ device time / Σ service "
        "time paired per job, with its interval (targets: idle ≤ "
        f"{TARGET_IDLE_MS:.0f} ms, share ≥ {TARGET_BUSY_SHARE}); TTFT from the claim and from the device start, p50.",
        "",
        "| engine | K | prefetched / results | device idle ms p50 / p90 / max (n) | device ms per page "
        "| pages/s over busy devices | device share between jobs (n) | TTFT from claim ms | TTFT from device start ms "
        "| page wait ms p50 | targets |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        pf = r.get("stats", {}).get("prefetch") or {}
        idle = pf.get("device_idle_ms") or {}
        interval = pf.get("steady_over_busy_device_ci")
        share_ci = f" [{fmt(interval[0], 3)}, {fmt(interval[1], 3)}]" if interval else ""
        lines.append(
            f"| {r['engine']} | {r['k']} | {pf.get('prefetched', '-')} / {pf.get('results', '-')} "
            f"| {fmt(idle.get('p50'), 1)} / {fmt(idle.get('p90'), 1)} / {fmt(idle.get('max'), 1)} ({idle.get('n', '-')}) "
            f"| {fmt(pf.get('device_ms_per_page_mean'), 1)} | {fmt(pf.get('steady_over_busy_device'), 3)}{share_ci} "
            f"| {_ci(pf.get('device_busy_share'), 3)} ({(pf.get('device_busy_share') or {}).get('n', '-')}) "
            f"| {fmt(pf.get('ttft_from_claim_ms_p50'), 1)} | {fmt(pf.get('ttft_from_device_start_ms_p50'), 1)} "
            f"| {fmt(pf.get('page_wait_ms_p50'), 1)} | {prefetch_verdict(pf) if pf else '-'} |"
        )
    served = [r for r in report["runs"] if (r.get("stats") or {}).get("serving")]
    if any(r.get("concurrency", 1) > 1 for r in served):
        lines += [
            "",
            "Serving (the report's Serving table, report/serving.py): output tokens/s = steady-state pages/s x mean "
            "tokens out; TTFT from the claim for a batched job; TPOT and ITL per job, pooled; the batch a job decoded "
            "in, averaged; pages/day per GPU = steady-state pages/s per GPU x 86,400.",
            "",
            "| engine | K | concurrency | output tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | ITL p50 / p99 ms "
            "| e2e p50 ms | batch occupancy | pages/day per GPU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in served:
            sv = r["stats"]["serving"]
            lines.append(
                f"| {r['engine']} | {r['k']} | {r.get('concurrency', 1)} | {fmt(sv['output_tokens_per_s'], 0)} "
                f"| {fmt(sv['ttft_ms_p50'], 1)} / {fmt(sv['ttft_ms_p90'], 1)} / {fmt(sv.get('ttft_ms_p99'), 1)} "
                f"| {fmt(sv['tpot_ms_p50'], 2)} / {fmt(sv['tpot_ms_p90'], 2)} "
                f"| {fmt(sv['itl_ms_p50'], 2)} / {fmt(sv.get('itl_ms_p99'), 2)} | {fmt(sv['e2e_ms_p50'], 0)} "
                f"| {fmt(sv['occupancy_mean'], 1)} | {fmt(sv['pages_per_day_per_gpu'], 0)} |"
            )
        lines.append("")
        for engine in dict.fromkeys(r["engine"] for r in served):
            for k in sorted({r["k"] for r in served if r["engine"] == engine}):
                level = best_level(report["runs"], engine, k)
                sv = next(r["stats"]["serving"] for r in served
                          if r["engine"] == engine and r["k"] == k and r.get("concurrency", 1) == level)  # fmt: skip
                lines.append(
                    f"- Best point, {engine} K = {k}: concurrency {level}: {fmt(sv['output_tokens_per_s'], 0)} output "
                    f"tokens/s, TPOT p50 {fmt(sv['tpot_ms_p50'], 2)} ms, ITL p99 {fmt(sv.get('itl_ms_p99'), 2)} ms, "
                    f"TTFT p99 {fmt(sv.get('ttft_ms_p99'), 0)} ms, {fmt(sv['pages_per_day_per_gpu'], 0)} pages/day per GPU"
                )
        stepped = [r for r in served if r["stats"].get("steps")]
        if stepped:
            lines += [
                "",
                "Batch steps (the report's Batch steps table): the prefill steps' p50 / p90 / mean (a mean above the "
                "p50: prefills that waited on the device inside their step), the decode step at 64+ pages, the "
                "prefills' share of the time in steps, the time in steps per GPU over the wall span.",
                "",
                "| engine | K | concurrency | pages prefilled whole / split | prefill step p50 / p90 / mean ms "
                "| decode step 64+ p50 ms "
                "| prefill share | time in steps, % of span |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for r in stepped:
                st = r["stats"]["steps"]
                share, span = st["prefill_share"], st["step_share_of_span"]
                lines.append(
                    f"| {r['engine']} | {r['k']} | {r.get('concurrency', 1)} | {st['prefill_steps']} / "
                    f"{st['split_prefills']} "
                    f"| {fmt(st['prefill_p50_ms'], 1)} / {fmt(st['prefill_p90_ms'], 1)} / {fmt(st['prefill_mean_ms'], 1)} "
                    f"| {fmt(st['decode_64_p50_ms'], 2)} | {'-' if share is None else f'{100 * share:.1f}%'} "
                    f"| {'-' if span is None else f'{100 * span:.1f}'} |"
                )
        for plot in report.get("plots", []):
            lines.append(f"\nThroughput against latency over the sweep: `{plot}`")
    lines.append("")
    for engine, text in report.get("verdicts", {}).items():
        lines.append(f"- {engine}: {text}")
    for r in report["runs"]:
        sessions = r.get("stats", {}).get("worker_sessions") or []
        if sessions:
            ready = ", ".join(
                f"{x['device']} load {fmt((x['load_ms'] or 0) / 1e3, 1)} s + warm-up {fmt((x['warmup_ms'] or 0) / 1e3, 1)} s"
                for x in sessions
            )
            launch = f"; `dsocr worker` launch → every child ready {fmt(r['ready_after_s'], 1)} s" if r.get("ready_after_s") else ""
            lines.append(f"- {r['engine']} K={r['k']} c={r.get('concurrency', 1)} worker sessions: {ready}{launch}")
        split = r.get("stats", {}).get("gap_split_ms")
        if split:
            parts = ", ".join(f"{name} {fmt(v['p50'], 1)} / {fmt(v['p90'], 1)}" for name, v in split.items())
            lines.append(f"- {r['engine']} K={r['k']} between two jobs, ms p50 / p90: {parts}")
        if r.get("stats", {}).get("cold_reasons"):
            lines.append(f"- {r['engine']} K={r['k']} cold reasons: {'; '.join(r['stats']['cold_reasons'])}")
        if r.get("error"):
            lines.append(f"- {r['engine']} K={r['k']}: ERROR {r['error']}")
    for note in report.get("notes", []):
        lines.append(f"- note: {note}")
    lines += ["", f"Command: `{report['command']}`", f"Benchmark wall time: {report.get('bench_wall_s', 0):.0f} s.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------


def parse_repeats(text: str, engines: list[str]) -> dict[str, int]:
    if text.isdigit():
        return dict.fromkeys(engines, int(text))
    repeats = {e: DEFAULT_REPEATS.get(e, 4) for e in engines}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        repeats[name.strip()] = int(value)
    return repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    parser.add_argument("--gpus", default="all", help="all, N (K = 1..N), or cpu (K CPU children: a smoke run)")
    parser.add_argument("--ks", help="the K values, e.g. 1,2 (default 1..N)")
    parser.add_argument("--engines", default="eager,fast")
    parser.add_argument("--filelist", type=Path, default=REPO / "datasets" / "samples" / "samples.txt")
    parser.add_argument("--repeats", default=",".join(f"{e}={n}" for e, n in DEFAULT_REPEATS.items()),
                        help="N for every engine, or engine=N,...")  # fmt: skip
    parser.add_argument("--generations", type=int, default=GENERATIONS,
                        help="a level's jobs: at least this many times its concurrency x K (its batches "
                             "turn over this often; fewer: a shorter steady window, wider intervals)")  # fmt: skip
    parser.add_argument("--model", default="full")
    parser.add_argument("--mode", default="base")
    parser.add_argument("--warmup", default=None, help="worker --warmup value (default: the mode)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--profile", type=int, default=0,
                        help="dsocr submit --profile N: every N-th job under torch.profiler (issue 33)")
    parser.add_argument("--concurrency", default="1",
                        help="dsocr submit --concurrency N: up to N jobs decoding together per GPU (issue 34); a "
                             "comma list sweeps them: a run per level on each K's worker, and a throughput-against-"
                             "latency plot")  # fmt: skip
    parser.add_argument("--scale-at-best", action="store_true",
                        help="the Ks after the first run only the first K's best concurrency level (most output "
                             "tokens/s): a sweep on one GPU, then K = 2 and 4 at its best point")  # fmt: skip
    parser.add_argument("--database-url", help="default: a fresh SQLite file in a temporary folder")
    parser.add_argument("--sweep-dir", type=Path,
                        help="continue the sweep recorded here (its SQLite ledger and sweep.json, made on its first "
                             "call): the levels and Ks an earlier call completed are not run again, and the tables and "
                             "curves cover them all; a device call too short for a whole sweep runs it in parts")  # fmt: skip
    parser.add_argument("--broker-url", help="default: a private redis-server on a free port")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--compile-cache", help="DSOCR_COMPILE_CACHE_DIR shared by all workers (default: temp)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for scaling-<date>.json/.md (default: $OUT, else benchmarks/results)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=520, help="no new run starts past this; runs are cut to fit")
    parser.add_argument("--run-timeout-s", type=float, default=300,
                        help="each run, from its submit to its last job final (a batched run's engine start is in it, the "
                             "worker's start is not)")
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--stop-grace-s", type=float, default=90)
    parser.add_argument("--worker-loglevel", default="INFO")
    parser.add_argument("--keep-logs", type=Path, help="copy the worker logs into this folder (created if missing)")
    parser.add_argument("--docs", type=Path,
                        help="also write the tables, command and curves into this file as its newest section "
                             "(docs/benchmarks.md)")  # fmt: skip
    args = parser.parse_args()

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    repeats = parse_repeats(args.repeats, engines)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.filelist.is_file():
        args.pages = listed_pages(args.filelist)
    if any(c < 1 for c in levels):
        print("bench_scaling: --concurrency levels must be at least 1", file=sys.stderr)
        return 2
    args.warmup = args.warmup or args.mode
    beyond: list[int] = []  # Ks this machine has too few GPUs for: left to a later call of the sweep
    if args.ks:
        ks = [int(x) for x in args.ks.split(",")]
        if args.gpus != "cpu" and args.sweep_dir:
            n = count_gpus() if args.gpus == "all" else int(args.gpus)
            beyond, ks = [k for k in ks if k > n], [k for k in ks if k <= n]
            if not ks:
                print(f"bench_scaling: no K of --ks {args.ks} fits this machine's {n} GPU(s)", file=sys.stderr)
                return 2
    elif args.gpus == "cpu":
        ks = [1]
    else:
        n = count_gpus() if args.gpus == "all" else int(args.gpus)
        if n < 1:
            print("bench_scaling: no GPU found (nvidia-smi); use --gpus cpu for a smoke run", file=sys.stderr)
            return 2
        ks = list(range(1, n + 1))
    if not args.filelist.is_file():
        print(f"bench_scaling: no file list {args.filelist}", file=sys.stderr)
        return 2
    if args.database_url and (error := given_ledger_error(args.database_url)):
        code, message = error
        print(f"bench_scaling: {message}", file=sys.stderr)
        return code
    out_dir = output_folders(args.out, args.keep_logs)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    json_path, md_path = out_dir / f"scaling-{stamp}.json", out_dir / f"scaling-{stamp}.md"

    report: dict[str, Any] = {
        "environment": environment(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": {
            "engines": engines, "ks": ks, "gpus": args.gpus, "filelist": os.path.relpath(args.filelist, REPO),
            "repeats": repeats, "model": args.model, "mode": args.mode, "warmup": args.warmup,
            "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
            "target_share_per_gpu": TARGET_SHARE_PER_GPU, "concurrency": levels,
            "scale_at_best": args.scale_at_best, "generations": args.generations,
        },  # fmt: skip
        "runs": [],
        "notes": [],
    }

    earlier: list[dict[str, Any]] = []
    if args.sweep_dir:
        args.sweep_dir.mkdir(parents=True, exist_ok=True)
        try:
            earlier = earlier_sweep(args.sweep_dir, report["settings"])
        except ValueError as exc:
            print(f"bench_scaling: {exc}", file=sys.stderr)
            return 2
        report["runs"] = earlier
        calls = sorted({f"{r['call']['date']}, git {(r['call'].get('git_sha') or '-')[:7]}" for r in earlier})
        if calls:
            report["notes"].append(f"levels completed by earlier calls of this sweep ({args.sweep_dir}): {'; '.join(calls)}")
    if beyond:
        report["notes"].append(f"K = {', '.join(map(str, beyond))} left to a call on a machine with more GPUs")
    call = {key: report["environment"].get(key) for key in ("date", "git_sha", "gpu")}

    def save() -> None:
        report["bench_wall_s"] = time.perf_counter() - _T0
        report["runs"].sort(key=lambda r: (engines.index(r["engine"]) if r["engine"] in engines else len(engines),
                                           r["k"], r.get("concurrency", 1)))  # fmt: skip
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        md_path.write_text(markdown(report))
        if args.sweep_dir:
            saved = {"settings": report["settings"], "runs": report["runs"]}
            (args.sweep_dir / "sweep.json").write_text(json.dumps(saved, indent=2, default=str) + "\n")

    log(f"scaling: engines {engines}, K {ks}, repeats {repeats}, mode {args.mode}; out {json_path}")
    redis_proc = None
    with tempfile.TemporaryDirectory(prefix="dsocr-scaling-") as tmpname:
        tmp = Path(tmpname)
        try:
            if args.broker_url:
                broker_url = args.broker_url
                report["settings"]["broker"] = "given (--broker-url)"
            else:
                redis_proc, broker_url = start_redis(args.redis_server, tmp)
                report["settings"]["broker"] = f"private redis-server ({_run_text([args.redis_server, '--version'])})"
                log(f"redis-server pid {redis_proc.pid} at {broker_url}")
            if args.database_url:  # its schema was checked before Redis started
                database_url = args.database_url
                report["settings"]["ledger"] = "given (--database-url)"
            elif args.sweep_dir:
                database_url = f"sqlite:///{(args.sweep_dir / 'ledger.db').resolve()}"
                report["settings"]["ledger"] = "the sweep's SQLite file (--sweep-dir)"
                prepare_ledger(database_url, create=True)
            else:
                database_url = f"sqlite:///{tmp / 'ledger.db'}"
                report["settings"]["ledger"] = "fresh SQLite file"
                prepare_ledger(database_url, create=True)

            env = dict(os.environ)
            env.update({
                "DSOCR_DATABASE_URL": database_url,
                "DSOCR_BROKER_URL": broker_url,
                "DSOCR_COMPILE_CACHE_DIR": args.compile_cache or str(tmp / "compile-cache"),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            })  # fmt: skip
            if args.broker_url:  # someone else's Redis: our keys apart from theirs
                env["DSOCR_BROKER_KEY_PREFIX"] = f"bench-scaling-{os.getpid()}:"
            options = worker_options(env)
            report["settings"]["warmup_flag"] = "--warmup" in options
            if "--warmup" not in options:
                note = "this `dsocr worker` has no --warmup: workers load lazily and the first jobs are cold"
                report["notes"].append(note)
                log(f"WARNING: {note}")

            from dsocr_workers.store.db import open_database

            db = open_database(database_url)
            functions = throughput_functions()
            if functions[3]:
                report["notes"].append(functions[3])
                log(f"WARNING: {functions[3]}")
            for engine in engines:
                base_data: dict[int, Any] = {}  # per concurrency level, the first K's run
                # An earlier call's first-K runs, read back from the sweep's ledger only for a ratio.
                earlier_base = {r["concurrency"]: r["run_id"] for r in earlier if r["engine"] == engine and r["k"] == ks[0]}
                for k in ks:
                    left = args.budget_s - (time.perf_counter() - _T0)
                    if left < 45:
                        report["runs"] += [{"engine": engine, "k": k, "concurrency": c,
                                            "status": "skipped: out of --budget-s"} for c in levels]  # fmt: skip
                        log(f"{engine} K={k}: skipped, {left:.0f} s of the budget left")
                        save()
                        continue
                    k_levels = levels
                    if args.scale_at_best and k != ks[0]:
                        best = best_level(report["runs"], engine, ks[0])
                        if best is None:
                            note = f"{engine} K={k}: not run, K = {ks[0]} has no level with a Serving figure"
                            report["notes"].append(note)
                            log(note)
                            continue
                        k_levels = [best]
                    k_levels = levels_left(earlier, engine, k, k_levels)
                    if not k_levels:
                        log(f"{engine} K={k}: every level done by an earlier call of the sweep")
                        continue
                    try:
                        records = one_run(args, engine, k, repeats[engine], env, tmp, db, options, left - 20,
                                          k_levels)  # fmt: skip
                    except Exception as exc:
                        traceback.print_exc()
                        records = [{"engine": engine, "k": k, "status": "error", "error": f"{type(exc).__name__}: {exc}"}]
                    for record in records:
                        record["call"] = call
                        if "run_id" in record:
                            try:
                                data = load(db, record["run_id"])
                                if k == ks[0]:
                                    base_data[record["concurrency"]] = data
                                elif record["concurrency"] not in base_data and record["concurrency"] in earlier_base:
                                    base_data[record["concurrency"]] = load(db, earlier_base[record["concurrency"]])
                                record["stats"] = run_stats(data, base_data.get(record["concurrency"]) if k != ks[0]
                                                            else None, functions)  # fmt: skip
                                st = record["stats"]
                                log(f"{engine} K={k} c={record['concurrency']}: steady "
                                    f"{_ci(st.get('steady_pages_per_s'), 3)} pages/s, ratio {_ci(st.get('ratio_to_k1'))}, "
                                    f"wall {fmt(st.get('wall_clock_s'), 1)} s, cold {st['cold_jobs']}")  # fmt: skip
                            except Exception as exc:
                                traceback.print_exc()
                                record["error"] = f"{type(exc).__name__}: {exc}"
                        report["runs"].append(record)
                    save()
                for r in report["runs"]:
                    if r["engine"] == engine and r["k"] > 1 and ks[0] == 1 and "run_id" in r:
                        target = round(TARGET_SHARE_PER_GPU * r["k"], 2)
                        name = f"{engine}, concurrency {r.get('concurrency', 1)}, K = {r['k']} vs K = 1, target ≥ {target}x"
                        report.setdefault("verdicts", {})[name] = verdict(r.get("stats", {}).get("ratio_to_k1"), target)
                if len({r.get("concurrency", 1) for r in report["runs"] if r["engine"] == engine}) > 1:
                    sweep_plot(db, report, engine, out_dir)
            db.dispose()
            if args.sweep_dir and not args.database_url:
                compact_sweep_ledger(database_url, [r["run_id"] for r in report["runs"]
                                                    if r.get("status") == "complete" and "stats" in r])  # fmt: skip
        finally:
            if redis_proc is not None:
                redis_proc.terminate()
                try:
                    redis_proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    redis_proc.kill()
            save()
    print(markdown(report), flush=True)
    log(f"wrote {json_path} and {md_path}")
    if args.docs:
        publish(args.docs, report, md_path, out_dir)
        log(f"wrote its section into {args.docs}")
    failed = [r for r in report["runs"] if r.get("error") or r.get("status") not in ("complete",)]
    return 1 if failed and len(failed) == len(report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
