"""A worker's start from prebuilt AOTInductor packages: `dsocr precompile`, then `dsocr worker`
launch → ready, on one GPU.

1. `dsocr precompile --model M --engine fast --modes MODES --max-new-tokens N --concurrency C --gpus 0` into a fresh
   DSOCR_COMPILE_CACHE_DIR (CXX=/usr/bin/g++ on the lent GPU image: its /opt/gcc builds packages that
   segfault at load); its wall time and progress lines;
2. `--starts` times `dsocr worker --gpus 0 --warmup MODES --model M --engine fast --max-new-tokens N
   --concurrency C` (its own redis-server and SQLite ledger): launch → Celery's "ready" line → the child's
   "warm" line, and the child's worker session (load s, warm-up s, what was warmed and from which
   artifacts; with C above 1 the batched engine's start: each bucket's capture, its admission);
3. `--without-artifacts`: one more start with an empty cache (dynamo compiles, as without a build).

    source benchmarks/device_env.sh && CXX=/usr/bin/g++ python3 benchmarks/bench_aoti_start.py --out $OUT

JSON + markdown into --out (aoti-start-<UTC>.{json,md}); the logs beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DSOCR = [sys.executable, "-c", "from dsocr_workers.cli import main; main()"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# What a worker's log says as it starts, in order: the mark each line sets (seconds after launch).
START_MARKS = {"celery_ready_s": r"ready\.", "child_opened_s": r"child 0 \(pid \d+\) on",
               "child_warm_s": r"child 0: .* warm \("}  # fmt: skip


def start(env: dict[str, str], folder: Path, name: str, worker_args: list[str], timeout_s: float,
          until: str = "child_warm_s") -> dict[str, Any]:  # fmt: skip
    """One `dsocr worker --gpus 0` start (queue `name`): seconds from launch to each of START_MARKS up to
    `until` (Celery's ready line, the child's first line, its warm line); then the worker is stopped.
    benchmarks/probe_import_floor.py times a start with no model up to the child's first line."""
    log_path = folder / f"{name}.log"
    began = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen([*DSOCR, "worker", "--gpus", "0", "--queue", name, *worker_args], env=env, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    marks: dict[str, Any] = {}
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and proc.poll() is None and until not in marks:
        text = log_path.read_text(errors="replace")
        now = round(time.perf_counter() - began, 3)
        for mark, pattern in START_MARKS.items():
            if re.search(pattern, text):
                marks.setdefault(mark, now)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    marks["log"] = log_path.name
    return marks


def sessions(db: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as connection:
        connection.row_factory = sqlite3.Row
        rows = connection.execute("select started_at, ready_at, load_ms, warmup_ms, warmup from worker_sessions "
                                  "order by started_at").fetchall()  # fmt: skip
    return [dict(row) for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="full")
    parser.add_argument("--modes", default="gundam")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1, help="the batched engine's, built and started too")
    parser.add_argument("--build-timeout-s", type=float, default=480)
    parser.add_argument("--without-artifacts", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=240)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines()[:1] or ["no GPU"]  # fmt: skip
    import torch

    report: dict[str, Any] = {"command": " ".join(sys.argv), "gpu": gpu[0], "torch": torch.__version__,
                              "CXX": os.environ.get("CXX", "")}  # fmt: skip
    plan = ["--model", args.model, "--engine", "fast", "--max-new-tokens", str(args.max_new_tokens),
            "--concurrency", str(args.concurrency)]
    redis_bin = shutil.which("redis-server")
    assert redis_bin, "no redis-server: carry .redis"
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        cache = folder / "compile-cache"
        port = 6390
        redis = subprocess.Popen([redis_bin, "--port", str(port), "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        db = folder / "ledger.db"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DSOCR_COMPILE_CACHE_DIR": str(cache),
               "DSOCR_BROKER_URL": f"redis://127.0.0.1:{port}/0", "DSOCR_DATABASE_URL": f"sqlite:///{db}"}  # fmt: skip
        try:
            subprocess.run([*DSOCR, "db", "upgrade"], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
            began = time.perf_counter()
            built = subprocess.run([*DSOCR, "precompile", *plan, "--modes", args.modes, "--gpus", "0"], env=env,
                                   cwd=REPO, capture_output=True, text=True, timeout=args.build_timeout_s)  # fmt: skip
            report["precompile"] = {"rc": built.returncode, "wall_s": round(time.perf_counter() - began, 1),
                                    "stdout": built.stdout[-2000:]}  # fmt: skip
            (out / "precompile.log").write_text(built.stdout + built.stderr)
            log(f"precompile: rc {built.returncode} in {report['precompile']['wall_s']} s")
            worker = [*plan, "--warmup", args.modes]
            report["starts"] = []
            for index in range(args.starts if built.returncode == 0 else 0):
                report["starts"].append(start(env, folder, f"start{index}", worker, args.timeout_s))
                log(f"start {index}: {report['starts'][-1]}")
            if args.without_artifacts:
                cold = {**env, "DSOCR_COMPILE_CACHE_DIR": str(folder / "empty-cache")}
                report["without_artifacts"] = start(cold, folder, "cold", worker, args.timeout_s)
                log(f"without artifacts: {report['without_artifacts']}")
            report["worker_sessions"] = sessions(db)
        finally:
            redis.terminate()
            redis.wait()
            for path in folder.glob("*.log"):
                shutil.copy(path, out / path.name)
            stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime())
            (out / f"aoti-start-{stamp}.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# Worker start from AOTInductor packages ({report['gpu']}, torch {report['torch']})", "",
             f"`{report['command']}`", "", f"precompile: {report.get('precompile', {}).get('wall_s')} s", "",
             "| start | Celery ready s | child opened s | child warm s |", "| --- | --- | --- | --- |"]  # fmt: skip
    for index, row in enumerate(report.get("starts", [])):
        lines.append(f"| {index} | {row.get('celery_ready_s')} | {row.get('child_opened_s')} | {row.get('child_warm_s')} |")
    if "without_artifacts" in report:
        row = report["without_artifacts"]
        lines.append(f"| no artifacts | {row.get('celery_ready_s')} | {row.get('child_opened_s')} | {row.get('child_warm_s')} |")
    lines += ["", "worker sessions: load s, warm-up s, warmed", ""]
    lines += [f"- {(r['load_ms'] or 0) / 1e3:.2f} s, {(r['warmup_ms'] or 0) / 1e3:.2f} s, {r['warmup']}"
              for r in report.get("worker_sessions", [])]  # fmt: skip
    (out / "aoti-start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
