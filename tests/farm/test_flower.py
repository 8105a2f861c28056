"""Flower on the farm: `dsocr flower` and a `dsocr worker --events` process on Redis + PostgreSQL, read
through the JSON views Flower's own pages use (its /api needs authentication, off here)."""

from __future__ import annotations

import base64
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from dsocr_workers.store.db import open_database

PAGES = {"letter.png": (320, 420), "wide.png": (900, 500), "stuck.png": (400, 600)}
# `dsocr` with a job whose first claim never returns, from the reliability suite (the package has no
# fault hook).
FAULTY_DSOCR = Path(__file__).resolve().parents[1] / "reliability" / "faulty_dsocr.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, **query: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    return json.loads(body) if query.get("json") or path.endswith("datatable") else body


def wait_for(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = probe()
        except OSError:  # Flower not listening yet
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"Flower never showed {what} in {timeout} s")
        time.sleep(1)


def tasks(port: int, search: str) -> list[dict]:
    return get(
        port, "/tasks/datatable", draw="1", start="0", length="100", **{"search[value]": search},
        **{"order[0][column]": "0", "order[0][dir]": "asc"},
    )["data"]  # fmt: skip


@pytest.fixture
def ledger_url(postgres_url: str) -> Iterator[str]:
    """The session's PostgreSQL database, emptied afterwards: other tests count every worker session."""
    yield postgres_url
    db = open_database(postgres_url)
    with db.engine.begin() as connection:
        connection.execute(
            text("TRUNCATE results, jobs, worker_sessions, worker_processes, workers, runs CASCADE")
        )
    db.dispose()


@pytest.mark.postgres
@pytest.mark.redis
def test_flower_shows_workers_started_with_events_and_their_jobs_by_run_and_image(
    tmp_path, make_png, ledger_url, broker_env, subprocess_env
):
    folder = tmp_path / "pages"
    for name, size in PAGES.items():
        make_png(name, size, folder=folder)
    listing = folder / "pages.txt"
    listing.write_text("\n".join(PAGES) + "\n")
    queue = broker_env["DSOCR_QUEUE"] + "-flower"
    env = {
        **subprocess_env, **broker_env, "DSOCR_DATABASE_URL": ledger_url, "DSOCR_QUEUE": queue,
        # stuck.png's first claim never returns: its child is killed at the hard limit, and the worker's
        # parent sends the job again, which runs on a fresh child. The copy must keep the job's label.
        # (The limit leaves the good jobs room on a busy 2-core machine: 8 s was met there once.)
        "DSOCR_HARD_TIME_LIMIT": "15", "DSOCR_RETRY_BACKOFF_MAX": "1",
        "DSOCR_FLOWER_BASIC_AUTH": "",  # as docker-compose.yml passes it when no login is set: none
    }  # fmt: skip
    command = [sys.executable, "-m", "dsocr_workers"]
    port = free_port()
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("flower", "worker")}  # noqa: SIM115
    flower = subprocess.Popen([*command, "flower", "--port", str(port)], env=env, stdout=logs["flower"],
                              stderr=subprocess.STDOUT)  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, str(FAULTY_DSOCR), "--hang-claim", "stuck.png", "worker", "--gpus", "cpu", "--events",
         "--warmup", "tiny"],
        env=env, stdout=logs["worker"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        # Events are broadcast, not queued: Flower counts only what arrives after it subscribed. The jobs go
        # in once Flower shows the worker's heartbeats, so no count depends on which process started first.
        wait_for("the worker", lambda: [w for w in get(port, "/workers", json="1")["data"] if w["status"]], 240)
        submitted = subprocess.run(
            [*command, "submit", str(listing), "--mode", "tiny", "--max-new-tokens", "4"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        run_id = submitted.stdout.strip().splitlines()[-1]

        # The worker: alive, the stuck job received twice, and every job done.
        worker_row = wait_for(
            "the worker and its jobs",
            lambda: [w for w in get(port, "/workers", json="1")["data"]
                     if w["status"] and w.get("task-received", 0) >= 4 and w.get("task-succeeded", 0) >= 3],
            timeout=240,
        )[0]  # fmt: skip
        assert worker_row["hostname"].startswith("dsocr-")

        shown = wait_for(
            "every job of the run", lambda: (found := tasks(port, run_id)) and len(found) == 3 and found, 60
        )
        by_image = {json_kwargs(t)["image"]: t for t in shown}
        assert set(by_image) == set(PAGES)
        for image, task in by_image.items():
            assert task["name"] == "dsocr.run_job"
            assert json_kwargs(task) == {"run": run_id, "image": image, "repeat": 0}
            assert task["uuid"] in task["args"]  # the task's one argument: the job id
        # Flower keeps the kwargs and state of a task's latest delivery: the stuck job's is the copy its
        # worker's parent sent after the kill, which still reads as its page, and ran.
        assert {image: task["state"] for image, task in by_image.items()} == dict.fromkeys(PAGES, "SUCCESS")

        # The worker page is filled by remote-control inspection: the registered task and the queue.
        page = get(port, f"/worker/{urllib.parse.quote(worker_row['hostname'])}")
        assert "dsocr.run_job" in page and queue in page
    finally:
        for process in (worker, flower):
            process.send_signal(signal.SIGTERM)
        for process in (worker, flower):
            process.wait(timeout=60)
        for log in logs.values():
            log.close()
        print("".join((tmp_path / f"{name}.log").read_text()[-3000:] for name in logs))


def json_kwargs(task: dict) -> dict:
    """Flower shows a task's kwargs as the repr the message carried (farm/celery/messages.py `job_labels`)."""
    import ast

    return ast.literal_eval(task["kwargs"])


@pytest.mark.redis
def test_flower_asks_for_the_login_it_is_given(broker_env, subprocess_env, tmp_path):
    port = free_port()
    # PYTHONFAULTHANDLER: a Flower that outlives its SIGTERM is stopped by SIGABRT, its threads' stacks logged.
    env = {**subprocess_env, **broker_env, "DSOCR_FLOWER_BASIC_AUTH": "farm:s3cret", "PYTHONFAULTHANDLER": "1"}
    with open(tmp_path / "flower.log", "w") as log:
        flower = subprocess.Popen([sys.executable, "-m", "dsocr_workers", "flower", "--port", str(port)], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            assert wait_for("its health check", lambda: get(port, "/healthcheck") == "OK", timeout=60)
            with pytest.raises(urllib.error.HTTPError) as refused:
                get(port, "/workers")
            assert refused.value.code == 401
            request = urllib.request.Request(f"http://127.0.0.1:{port}/workers")
            request.add_header("Authorization", "Basic " + base64.b64encode(b"farm:s3cret").decode())
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200
        finally:
            flower.send_signal(signal.SIGTERM)
            try:
                flower.wait(timeout=60)
            except subprocess.TimeoutExpired:
                flower.send_signal(signal.SIGABRT)
                flower.wait(timeout=30)
                pytest.fail("Flower outlived its SIGTERM by 60 s:\n" + (tmp_path / "flower.log").read_text()[-6000:])
    assert "s3cret" not in (tmp_path / "flower.log").read_text()
