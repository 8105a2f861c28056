"""A batched worker's page preparation against its engine's thread, side by side in one process: what
preparing pages costs a thread that needs the GIL, with pages prepared on threads (the batched path
before farm/job/page_processes.py) and in page-preparing processes (`PageProcesses`).

A ticker thread loops small torch operations, standing in for the batched engine's thread launching a
prefill's kernels one by one: every iteration needs the GIL, and its latency is how long it waited for
it (or, where the host's cores are all busy, for a core). Each round, every arm prepares the file list's
pages (gundam mode of the `tiny` preset's tokenizer, all handed over at once, as a batch refilled
together) while the ticker runs; `idle` is the ticker alone for as long. Arms:

  threads      `session.prepare_job` on a thread pool of --threads (the old PREPARE_THREADS rule's count)
  processes N  `PageProcesses(session, N)` for each N of --processes, started once before the rounds

Where the host has two CPUs or more, the ticker runs on the first and the preparing threads or processes
on the others (--no-pin: anywhere), so that what the arms differ by is the GIL, not a core shared with
the ticker. One untimed round of every arm first (first pages in each thread and process), then --rounds
rounds, the order of the arms rotating. Per arm: pages/s (median over rounds, every round's), the ticker's iteration
latency (p50 / p99 / p99.9 / max in µs over every round's iterations), its iterations per second and the
share of its time in iterations above 1 ms; the processes' start (`wait_ready`) and resident memory.

    python3 benchmarks/bench_page_prep.py --out /tmp/page-prep
    python3 benchmarks/bench_page_prep.py --processes 1,2 --rounds 7 --out /tmp/page-prep

JSON and markdown into --out (page-prep.json, page-prep.md); the markdown to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import tokenizers
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_engine  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession, PreparedJob  # noqa: E402
from dsocr_workers.farm.filelist import read_filelist  # noqa: E402
from dsocr_workers.farm.job.page_processes import PageProcesses, default_processes  # noqa: E402

DEFAULT_PAGES = "datasets/omnidocbench/subsets/demo-18.txt"
OLD_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))  # the batched path's PREPARE_THREADS before
OPS_PER_ITERATION = 8  # small in-place adds: a few launches' worth of the GIL
STALL_S = 1e-3


class Ticker:
    """A thread looping small torch operations (on `cpus` where given); each iteration's latency, from
    `start` to `stop`."""

    def __init__(self, cpus: set[int] | None) -> None:
        self._cpus = cpus
        self._stop = threading.Event()
        self.latencies_s: list[float] = []
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.latencies_s

    def _run(self) -> None:
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)  # this thread's
        x = torch.zeros(256)
        latencies, stop = self.latencies_s, self._stop
        last = time.perf_counter()
        while not stop.is_set():
            for _ in range(OPS_PER_ITERATION):
                x.add_(1.0)
            now = time.perf_counter()
            latencies.append(now - last)
            last = now


def timed(work: Callable[[], None], ticker_cpus: set[int] | None) -> tuple[float, list[float]]:
    """`work()`'s wall seconds and the ticker's iteration latencies meanwhile."""
    ticker = Ticker(ticker_cpus)
    ticker.start()
    start = time.perf_counter()
    work()
    wall = time.perf_counter() - start
    return wall, ticker.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return pids


def latency_summary(latencies_s: list[float], wall_s: float) -> dict[str, float]:
    us = np.asarray(latencies_s) * 1e6
    stalled = us[us > STALL_S * 1e6]
    return {
        "iterations": int(us.size),
        "iterations_per_s": us.size / wall_s,
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "p999_us": float(np.percentile(us, 99.9)),
        "max_us": float(us.max()),
        "stalled_share": float(stalled.sum() / 1e6 / wall_s),
    }


def environment() -> dict[str, Any]:
    """bench_engine's (date, host, versions, git), with the CPU, its load and the image libraries."""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor(),
    )  # fmt: skip
    return {
        **bench_engine.environment(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "tokenizers": tokenizers.__version__,
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Page preparation beside a GIL-bound thread ({env['date']})",
        "",
        f"{env['cpu']}, {env['cpus']} CPUs (load average at start {', '.join(f'{x:.2f}' for x in env['load_average'])}); "
        f"Python {env['python']}, torch {env['torch']}, Pillow {env['pillow']}, numpy {env['numpy']}, "
        f"tokenizers {env['tokenizers']}, git {env['git_sha']}. `{report['command']}`",
        "",
        f"{report['pages']} pages ({report['filelist']}), mode {report['mode']}, {report['rounds']} rounds after one "
        f"untimed; ticker: {OPS_PER_ITERATION} small torch ops per iteration; "
        + (
            f"ticker on CPU {report['pinned']['ticker']}, preparers on CPUs {report['pinned']['preparers']}."
            if report["pinned"]
            else "unpinned."
        ),
        "",
        "| arm | pages/s (median) | pages/s by round | ticker it/s | latency p50 µs | p99 µs | p99.9 µs | max µs | time in iterations > 1 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, arm in report["arms"].items():
        t = arm["ticker"]
        rate = "-" if arm["pages_per_s"] is None else f"{arm['pages_per_s']:.2f}"
        by_round = ", ".join(f"{r:.2f}" for r in arm["pages_per_s_by_round"]) or "-"
        lines.append(
            f"| {name} | {rate} | {by_round} | {t['iterations_per_s']:,.0f} | {t['p50_us']:.0f} | {t['p99_us']:.0f} | "
            f"{t['p999_us']:.0f} | {t['max_us']:,.0f} | {t['stalled_share']:.1%} |"
        )
    lines.append("")
    for n, start in report["process_starts"].items():
        lines.append(
            f"- {n} process(es): ready in {start['ready_s']:.2f} s; resident memory per process "
            f"{', '.join(f'{m:.0f}' for m in start['rss_mib'])} MiB (this process: {report['rss_mib']:.0f} MiB)"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", default=DEFAULT_PAGES, help="a file list")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--threads", type=int, default=OLD_THREADS)
    parser.add_argument("--processes", default=str(default_processes()), help="pool sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-pin", action="store_true", help="leave the ticker and the preparers unpinned")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    )
    args = parser.parse_args()
    env = environment()
    torch.set_num_threads(1)  # the ticker's small operations on its own thread, as the engine's launches
    listed = read_filelist(REPO / args.pages if not Path(args.pages).is_absolute() else args.pages)
    if listed.bad or not listed.images:
        raise SystemExit(f"{args.pages}: {listed.describe_bad() or 'no pages'}")
    paths = [str(image.path) for image in listed.images]
    session = DeepSeekOCRSession.from_local("tiny")
    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) > 1
    ticker_cpus, preparer_cpus = ({cpus[0]}, set(cpus[1:])) if pinned else (None, None)

    def pin_process(pid: int) -> None:  # 0: the calling thread
        if preparer_cpus is not None:
            os.sched_setaffinity(pid, preparer_cpus)

    def pin_this_thread() -> None:
        pin_process(0)

    def idle(seconds: float) -> Callable[[], None]:
        return lambda: time.sleep(seconds)

    def through(submit: Callable[[str], Future[PreparedJob]]) -> Callable[[], None]:
        def work() -> None:
            for future in [submit(path) for path in paths]:
                future.result()

        return work

    threads = ThreadPoolExecutor(
        max_workers=args.threads, thread_name_prefix="pages", initializer=pin_this_thread
    )

    def on_a_thread(path: str) -> Future[PreparedJob]:  # as the batched path prepared pages before
        return threads.submit(
            session.prepare_job, path, None, args.mode, clock=session.new_clock(marks_steps=False)
        )

    arms: dict[str, Callable[[], None]] = {f"threads ({args.threads})": through(on_a_thread)}
    pools: list[PageProcesses] = []
    starts: dict[str, dict[str, Any]] = {}
    for count in (int(n) for n in args.processes.split(",")):
        before = child_pids()
        pool = PageProcesses(session, count)
        ready_s = pool.wait_ready() / 1e3
        started = sorted(child_pids() - before)
        for pid in started:
            pin_process(pid)  # before their first page: the threads they make follow
        starts[str(count)] = {"ready_s": ready_s, "rss_mib": [rss_mib(pid) for pid in started]}
        pools.append(pool)

        def in_a_process(path: str, pool: PageProcesses = pool) -> Future[PreparedJob]:
            return pool.submit(path, None, args.mode, session.new_clock(marks_steps=False))

        arms[f"processes ({count})"] = through(in_a_process)
    names = list(arms)
    walls: dict[str, list[float]] = {name: [] for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in ["idle", *names]}
    idle_walls: list[float] = []
    try:
        for name in names:  # untimed: the first pages of every thread and process
            arms[name]()
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                wall, seen = timed(arms[name], ticker_cpus)
                walls[name].append(wall)
                latencies[name].extend(seen)
            idle_s = statistics.median(w for ws in walls.values() for w in ws)
            wall, seen = timed(idle(idle_s), ticker_cpus)
            idle_walls.append(wall)
            latencies["idle"].extend(seen)
            rates = ", ".join(f"{n} {len(paths) / walls[n][-1]:.2f} pages/s" for n in names)
            print(f"round {round_ + 1}: {rates}", file=sys.stderr)
    finally:
        for pool in pools:
            pool.close()
        threads.shutdown()
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "environment": env,
        "filelist": args.pages,
        "pages": len(paths),
        "mode": args.mode,
        "rounds": args.rounds,
        "pinned": {"ticker": sorted(ticker_cpus), "preparers": sorted(preparer_cpus)}
        if ticker_cpus is not None and preparer_cpus is not None
        else None,
        "rss_mib": rss_mib(os.getpid()),
        "process_starts": starts,
        "arms": {
            "idle": {
                "pages_per_s": None,
                "pages_per_s_by_round": [],
                "ticker": latency_summary(latencies["idle"], sum(idle_walls)),
            },
            **{
                name: {
                    "pages_per_s": len(paths) / statistics.median(walls[name]),
                    "pages_per_s_by_round": [len(paths) / w for w in walls[name]],
                    "ticker": latency_summary(latencies[name], sum(walls[name])),
                }
                for name in names
            },
        },
    }
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "page-prep.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "page-prep.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
