"""Celery's own time between two tasks of one prefork child (issue 10 item 3): a bare task that sleeps
100 ms, run back to back from a full queue by one child with the farm's settings (`acks_late`, prefork,
concurrency 1), with Celery's prefetch multiplier 1 (the farm's until issue 31) and 2 (the farm's since). The gap is one task's end to the
next one's start, both stamped in the child: the child reporting back, the parent acknowledging the
message and fetching the next one, and handing it to the child. Nothing of dsocr_workers runs here, so
this is the floor under the farm's own time between jobs on the host it runs on.

    python benchmarks/probe_celery_handover.py [--broker-url redis://127.0.0.1:6379/14] [--tasks 40]

The broker URL's database is flushed: give it one nothing else uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import redis
from celery import Celery

REPO = Path(__file__).resolve().parents[1]
BROKER_ENV = "DSOCR_PROBE_BROKER_URL"  # how the worker process learns the broker
STAMPS = "probe:stamps"
app = Celery("probe_celery_handover", broker=os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/14"))
app.conf.update(task_acks_late=True, task_ignore_result=True, worker_hijack_root_logger=False)


_stamps: list[redis.Redis] = []  # the child's one connection for its stamps


@app.task(name="probe.sleep")
def sleep_task(index: int) -> None:
    if not _stamps:
        _stamps.append(redis.Redis.from_url(app.conf.broker_url))
    began = time.time()
    time.sleep(0.1)
    # Pushing the stamps (one round trip to Redis, ~0.1 ms) counts in the gap: an upper bound.
    _stamps[0].rpush(STAMPS, json.dumps([index, began, time.time()]))


def gaps_ms(broker_url: str, tasks: int, prefetch: int) -> list[float]:
    app.conf.broker_url = broker_url
    client = redis.Redis.from_url(broker_url)
    client.flushdb()
    for index in range(tasks):
        sleep_task.delay(index)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "benchmarks.probe_celery_handover", "worker", "--pool=prefork",
         "--concurrency=1", f"--prefetch-multiplier={prefetch}", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "--loglevel=WARNING"],
        cwd=REPO, env={**os.environ, BROKER_ENV: broker_url,
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60 + tasks
        while client.llen(STAMPS) < tasks:
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("the worker did not run every task")
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    stamps = sorted((json.loads(x) for x in client.lrange(STAMPS, 0, -1)), key=lambda stamp: stamp[1])
    # The first task waited for the worker to start: only the gaps between later ones count.
    return [(b[1] - a[2]) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2, help="each prefetch setting this many times, alternating")
    args = parser.parse_args()
    for round_ in range(args.rounds):
        for prefetch in (1, 2):
            gaps = gaps_ms(args.broker_url, args.tasks, prefetch)
            p50, p90 = np.percentile(gaps, [50, 90])
            print(f"round {round_ + 1}, prefetch x{prefetch}: gap between tasks p50 {p50:.2f} ms, p90 {p90:.2f} ms, "
                  f"max {max(gaps):.2f} ms ({len(gaps)} gaps)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
