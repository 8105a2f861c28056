"""End to end with the tiny preset: real `python -m dsocr_workers worker` processes on Redis + PostgreSQL,
and `dsocr run` on SQLite."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from accounting import some_host_gap_is_small
from sqlalchemy import func, select

from dsocr_workers.farm.celery.app import create_app
from dsocr_workers.farm.submit import enqueue
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Result, Run, WorkerProcess, WorkerSession

PAGES = {"p1.png": (320, 420), "p2.png": (640, 480), "p3 wide.png": (900, 500), "p4.png": (400, 1300)}


def dsocr(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsocr_workers", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def pages(tmp_path, make_png) -> Path:
    folder = tmp_path / "pages"
    for name, size in PAGES.items():
        make_png(name, size, folder=folder)
    listing = folder / "pages.txt"
    listing.write_text("# four synthetic pages\n" + "\n".join(PAGES) + "\n")
    return listing


def wait_until_final(url: str, run_id: str, timeout: float) -> dict[str, int]:
    db = open_database(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            with db.transaction() as session:
                counts = ledger.job_counts(session, run_id)
            if not any(counts.get(s) for s in ("pending", "queued", "running")):
                return dict(counts)
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} not final after {timeout}s: {dict(counts)}")
            time.sleep(0.5)
    finally:
        db.dispose()


def queue_drained(env: dict[str, str], queue: str, timeout: float) -> bool:
    client = redis.Redis.from_url(env["DSOCR_BROKER_URL"])
    prefix = env["DSOCR_BROKER_KEY_PREFIX"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.llen(prefix + queue) == 0 and client.hlen(prefix + "unacked") == 0:
            return True
        time.sleep(0.3)
    return False


@pytest.mark.postgres
@pytest.mark.redis
def test_two_workers_one_result_per_job_and_duplicates_refused(
    pages, postgres_url, broker_env, subprocess_env, tmp_path
):
    queue = broker_env["DSOCR_QUEUE"] + "-e2e"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url, "DSOCR_QUEUE": queue}
    submitted = dsocr(
        "submit", str(pages), "--max-new-tokens", "4", "--repeats", "2", "--mode", "tiny", env=env
    )
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]

    logs = [open(tmp_path / f"worker{i}.log", "w") for i in range(2)]  # noqa: SIM115 (closed below)
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "dsocr_workers", "worker", "--gpus", "cpu", "--loglevel", "INFO"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for log in logs
    ]
    try:
        counts = wait_until_final(postgres_url, run_id, timeout=240)
        assert counts == {"done": 2 * len(PAGES)}

        # Deliver every job again: each delivery is refused by the claim and acknowledged.
        settings = Settings.from_env(env)
        db = open_database(postgres_url)
        with db.transaction() as session:
            job_ids = session.scalars(select(Job.id).where(Job.run_id == run_id)).all()
        assert enqueue(db, create_app(settings), [(job_id, queue) for job_id in job_ids]) == len(job_ids)
        assert queue_drained(env, queue, timeout=60)
        with db.transaction() as session:
            per_job = session.execute(
                select(Result.job_id, func.count()).where(Result.run_id == run_id).group_by(Result.job_id)
            ).all()
            attempts = session.scalars(select(Job.attempts).where(Job.run_id == run_id)).all()
            results = session.scalars(select(Result).where(Result.run_id == run_id)).all()
            worker_sessions = session.scalars(
                select(WorkerSession).join(WorkerProcess).where(WorkerProcess.queues == queue)
            ).all()
        db.dispose()
        assert sorted(job_id for job_id, _ in per_job) == sorted(job_ids)
        assert {count for _, count in per_job} == {1}
        assert set(attempts) == {1}
        # Each worker process loaded and warmed its model before its first job, and says what it cost;
        # no job paid for it, and every job's parts add up to its end-to-end time.
        assert len({(w.host, w.pid) for w in worker_sessions}) == 2
        assert all(w.load_ms > 0 and w.warmup_ms > 0 and "tiny" in w.warmup for w in worker_sessions)
        # Their imports were taken by `dsocr worker` before it started Celery: each child inherited them.
        assert {w.import_ms for w in worker_sessions} == {0.0}
        ready = {w.id: w.ready_at for w in worker_sessions}
        for r in results:
            assert not r.cold and r.cold_reason is None
            assert r.worker_session_id in ready and ready[r.worker_session_id] <= r.created_at
            parts = (r.preprocess_ms + r.setup_ms + r.prefill_ms + r.first_token_ms + r.decode_ms
                     + r.wasted_decode_ms + r.readback_ms + r.postprocess_ms + r.host_gap_ms)
            assert parts == pytest.approx(r.e2e_ms, abs=1e-3) and r.host_gap_ms >= 0
        # The gap is host glue between stages, plus whatever the OS preempts there: on a loaded 2-core
        # CI machine running two workers, a few milliseconds (4.2 of 187 ms seen).
        assert some_host_gap_is_small(results)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)  # warm shutdown
        for worker in workers:
            worker.wait(timeout=60)
        for log in logs:
            log.close()
    print("".join(p.read_text() for p in sorted(tmp_path.glob("worker*.log"))))
    assert all(w.returncode == 0 for w in workers), [
        p.read_text()[-2000:] for p in tmp_path.glob("worker*.log")
    ]
    assert "refused" in "".join(p.read_text() for p in tmp_path.glob("worker*.log"))
    # Each child beat while it lived and recorded its clean stop (SIGTERM), so status does not wait for it.
    db = open_database(postgres_url)
    with db.transaction() as session:
        processes = session.scalars(select(WorkerProcess).where(WorkerProcess.queues == queue)).all()
    db.dispose()
    assert len(processes) == 2 and all(p.stopped_at is not None and p.heartbeat_at >= p.started_at for p in processes)

    report = dsocr("report", "--run", run_id, "--format", "json", env=env)
    assert report.returncode == 0, report.stderr
    facts = {row["field"]: row["value"] for row in json.loads(report.stdout)["tables"]["Run"]}
    assert (facts["jobs"], facts["ok"], facts["failed"], facts["results"]) == (8, 8, 0, 8)
    watched = dsocr("status", "--run", run_id, "--watch", env=env)
    assert watched.returncode == 0 and "8/8 final" in watched.stdout


@pytest.mark.postgres
@pytest.mark.redis
def test_a_worker_with_jobs_queued_prefetches_the_next_page(pages, postgres_url, broker_env, subprocess_env, tmp_path):
    queue = broker_env["DSOCR_QUEUE"] + "-prefetch"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url, "DSOCR_QUEUE": queue}
    # 16 tokens: decoding gives the prefetch thread, started after the prefill, time to read its guess
    # before the next claim (read after it, the next job is no longer waiting: a guess further on).
    submitted = dsocr("submit", str(pages), "--max-new-tokens", "16", "--ignore-eos", "--mode", "tiny", env=env)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dsocr_workers", "worker", "--gpus", "cpu", "--loglevel", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert wait_until_final(postgres_url, run_id, timeout=240) == {"done": len(PAGES)}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()[-2000:]
    db = open_database(postgres_url)
    with db.transaction() as session:
        ran = session.execute(
            select(Job.image, Result).join(Result, Result.job_id == Job.id).where(Job.run_id == run_id)
            .order_by(Job.started_at)
        ).all()  # fmt: skip
        session.expunge_all()
    db.dispose()
    # One child, the queue in the order submit sent it: the child's guess at its next message is right
    # every time, so every job after the first had its page prepared while the previous one ran.
    assert [image for image, _ in ran] == list(PAGES)
    assert [r.prefetched for _, r in ran] == [False] + [True] * (len(PAGES) - 1)
    for _, r in ran:
        parts = (r.preprocess_ms + r.setup_ms + r.prefill_ms + r.first_token_ms + r.decode_ms
                 + r.wasted_decode_ms + r.readback_ms + r.postprocess_ms + r.host_gap_ms)  # fmt: skip
        assert parts == pytest.approx(r.e2e_ms, abs=1e-3) and r.preprocess_ms > 0 and r.page_wait_ms >= 0
        assert r.host_gap_ms >= 0
        assert 0 < r.ttft_from_device_start_ms < r.ttft_from_claim_ms
    assert some_host_gap_is_small([r for _, r in ran])
    for (_, before), (_, after) in zip(ran, ran[1:], strict=False):
        assert before.device_finished_at <= after.device_started_at

    report = dsocr("report", "--run", run_id, "--format", "json", env=env)
    assert report.returncode == 0, report.stderr
    tables = json.loads(report.stdout)["tables"]
    latency = {row["metric"]: row for row in tables["Latency and output"]}
    assert latency["TTFT from claim ms"]["n"] == latency["TTFT from device start ms"]["n"] == len(PAGES)
    (process,) = tables["Worker processes"]
    assert process["prefetched"] == len(PAGES) - 1 and process["device idle between jobs p50 ms"] > 0


@pytest.mark.postgres
@pytest.mark.redis
def test_two_lanes_on_one_queue_each_prepare_their_own_next_page(pages, postgres_url, broker_env, subprocess_env,
                                                                 tmp_path):  # fmt: skip
    """Two CPU lanes (`--gpus cpu,cpu`) on one queue, pages whose crop grids make their jobs
    take different times: each child is told which job its lane fetched for it next, so every job after a
    child's first ran on a page its own child prepared while the previous job ran (a guess at the next
    message, as before, missed whenever the jobs ended in another order than they started)."""
    queue = broker_env["DSOCR_QUEUE"] + "-lanes"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url, "DSOCR_QUEUE": queue,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    # Two repeats: each lane then runs jobs of several crop grids, after its first one, in whichever order.
    submitted = dsocr("submit", str(pages), "--max-new-tokens", "16", "--ignore-eos", "--mode", "gundam",
                      "--repeats", "2", env=env)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dsocr_workers", "worker", "--gpus", "cpu,cpu",
             "--loglevel", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert wait_until_final(postgres_url, run_id, timeout=300) == {"done": 2 * len(PAGES)}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=90)
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]
    db = open_database(postgres_url)
    with db.transaction() as session:
        ran = session.execute(
            select(WorkerSession.worker_process_id, Job.started_at, Result.prefetched, Result.page_wait_ms)
            .join(Result, Result.job_id == Job.id).join(WorkerSession, WorkerSession.id == Result.worker_session_id)
            .where(Job.run_id == run_id).order_by(Job.started_at)
        ).all()  # fmt: skip
        reserved = session.scalars(select(Job.id).where(Job.run_id == run_id, Job.reserved_by.is_not(None))).all()
        imports = session.scalars(
            select(WorkerSession.import_ms).join(WorkerProcess).where(WorkerProcess.queues == queue)
        ).all()
    db.dispose()
    assert len(imports) >= 2 and set(imports) == {0.0}  # both children forked from lanes forked after the parent's imports
    by_process: dict[str, list[bool]] = {}
    for process, _, prefetched, page_wait_ms in ran:
        by_process.setdefault(process, []).append(prefetched)
        assert page_wait_ms is not None and page_wait_ms >= 0
    assert len(by_process) == 2, by_process  # both lanes worked
    assert all(flags == [False] + [True] * (len(flags) - 1) for flags in by_process.values()), by_process
    assert reserved == []  # every reservation ended with its claim


def test_dsocr_run_on_sqlite_creates_the_schema_records_its_queue_and_reports(pages, tmp_path, subprocess_env):
    """What one `dsocr run` on SQLite records and prints (one run: its subprocess loading the model is
    the costly part): the schema, every result, the run's queue, its process's beats and clean stop."""
    url = f"sqlite:///{tmp_path / 'embedded.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    done = dsocr("run", str(pages), "--max-new-tokens", "4", "--mode", "tiny", "--queue", "bench-q", "--format", "json",
                 env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert (facts["jobs"], facts["ok"], facts["results"]) == (len(PAGES), len(PAGES), len(PAGES))
    assert any("RANDOM WEIGHTS" in w for w in document["warnings"])
    latency = {row["metric"]: row for row in document["tables"]["Latency and output"]}
    assert latency["tokens out"]["p50"] == 4 and latency["decode ms/token"]["n"] == 3 * len(PAGES)
    db = open_database(url)
    with db.transaction() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == len(PAGES)
        assert session.scalars(select(Run.queue)).all() == ["bench-q"]
        # This process beat on that queue while it ran, and recorded its clean stop.
        (process,) = session.scalars(select(WorkerProcess)).all()
        assert process.queues == "bench-q" and process.stopped_at is not None
    db.dispose()


def test_dsocr_run_modes_are_choices(pages, tmp_path, subprocess_env):
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'refused.db'}"}
    refused = dsocr("run", str(pages), "--mode", "huge", env=env, timeout=60)
    assert refused.returncode == 2 and "'huge' is not one of 'tiny', 'small', 'base', 'large', 'gundam'" in refused.stderr


def test_worker_refuses_a_database_without_the_schema(tmp_path, subprocess_env):
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'old.db'}"}
    refused = dsocr("worker", "--gpus", "cpu", env=env, timeout=60)
    assert refused.returncode == 2
    # The check's own message, one line, though it ran in a process of its own beside the imports.
    assert refused.stderr.strip().splitlines() == [
        f"error: no dsocr database at {env['DSOCR_DATABASE_URL']}; run `dsocr run` or `dsocr db upgrade` first"
    ], refused.stderr
    upgraded = dsocr("db", "upgrade", env=env, timeout=60)
    assert upgraded.returncode == 0 and "schema at revision" in upgraded.stdout


def test_dsocr_run_exits_non_zero_when_a_job_failed(tmp_path, make_png, subprocess_env):
    folder = tmp_path / "pages"
    make_png("good.png", (320, 420), folder=folder)
    broken = make_png("broken.png", (640, 480), folder=folder)
    broken.write_bytes(broken.read_bytes()[:120])  # a valid header (the list check passes), no pixels
    listing = folder / "pages.txt"
    listing.write_text("good.png\nbroken.png\n")
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'embedded.db'}"}
    done = dsocr("run", str(listing), "--max-new-tokens", "2", "--mode", "tiny", "--format", "json", env=env)
    assert done.returncode == 4, done.stderr
    assert "1 failed of 2 jobs: broken.png: failed (InputError: " in done.stderr
    facts = {row["field"]: row["value"] for row in json.loads(done.stdout)["tables"]["Run"]}
    assert (facts["ok"], facts["failed"]) == (1, 1)  # the report is still printed in full


@pytest.mark.parametrize(
    ("url", "message"),
    [("not-a-url", "not a database URL"), ("postgres://", "names no host"), ("mysql://u@h/db", "not supported")],
)
def test_a_malformed_database_url_is_one_clear_line(url, message, subprocess_env):
    refused = dsocr("runs", env={**subprocess_env, "DSOCR_DATABASE_URL": url}, timeout=60)
    assert refused.returncode == 2 and message in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    ("url", "message"),
    [("not-a-url", "is not a Redis URL"), ("http://h/0", "is not a Redis URL"), ("redis://:6379/0", "names no host"),
     ("redis://h:port/0", "port that is not a number"), ("redis://:S3cret@h:6379/x", "database that is not a number")],
)  # fmt: skip
def test_a_malformed_broker_url_is_one_clear_line_before_anything_is_recorded(url, message, pages, tmp_path,
                                                                              subprocess_env):  # fmt: skip
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'b.db'}", "DSOCR_BROKER_URL": url}
    for args in (("submit", str(pages), "--mode", "tiny"), ("worker", "--gpus", "cpu"), ("reconcile",)):
        refused = dsocr(*args, env=env, timeout=60)
        assert refused.returncode == 2, (args, refused.stderr)
        assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]  # one line
        assert "DSOCR_BROKER_URL" in refused.stderr and message in refused.stderr and "e.g. redis://" in refused.stderr
        assert "S3cret" not in refused.stderr
    assert not (tmp_path / "b.db").exists()  # nothing was recorded


def test_a_queue_name_with_a_comma_is_refused(pages, tmp_path, subprocess_env):
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'q.db'}"}
    assert dsocr("db", "upgrade", env=env, timeout=60).returncode == 0
    refused = dsocr("submit", str(pages), "--queue", "q0,1", env=env, timeout=60)
    assert refused.returncode == 2 and "queue name 'q0,1'" in refused.stderr
    refused = dsocr("worker", "--gpus", "cpu", "--queue", "q0,1", env=env, timeout=60)
    assert refused.returncode == 2 and "queue name 'q0,1'" in refused.stderr


def test_piped_output_keeps_whole_lines(pages, tmp_path, subprocess_env, broker_env):
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'w.db'}", "COLUMNS": "60"}
    name = "a-run-name-long-enough-to-push-the-table-past-any-terminal-width-" * 2
    assert dsocr("db", "upgrade", env=env, timeout=60).returncode == 0
    submitted = dsocr("submit", str(pages), "--name", name, env=env, timeout=60)
    run_id = submitted.stdout.strip().splitlines()[-1]
    listed = dsocr("runs", env=env, timeout=60)
    assert listed.returncode == 0
    assert any(run_id in line and name in line for line in listed.stdout.splitlines()), listed.stdout


def test_a_child_sees_only_its_own_gpu():
    """Every child runs on its cuda:0, so that one compile cache serves all of them (a compiled graph
    names its device's index); the ledger keeps the worker's own name for the GPU (JobProcess.device)."""
    import torch

    from dsocr_workers.farm.devices import see_only_this_gpu

    env: dict[str, str] = {}
    if torch.cuda.is_initialized():  # too late for this process to choose what it sees
        assert see_only_this_gpu("cuda:1", env) == "cuda:1" and env == {}
        return
    assert see_only_this_gpu("cuda:1", env) == "cuda:0" and env == {"CUDA_VISIBLE_DEVICES": "1"}
    env = {"CUDA_VISIBLE_DEVICES": "4, 6"}  # the worker's indices count the GPUs it was given
    assert see_only_this_gpu("cuda:1", env) == "cuda:0" and env == {"CUDA_VISIBLE_DEVICES": "6"}
    env = {"CUDA_VISIBLE_DEVICES": "4"}
    assert see_only_this_gpu("cuda:1", env) == "cuda:1" and env == {"CUDA_VISIBLE_DEVICES": "4"}
    assert see_only_this_gpu("cpu", env) == "cpu"
