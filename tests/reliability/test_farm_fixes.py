"""Unit tests of the farm changes the reliability suite forced: the parent's record of a hard time limit,
acks that survive a Redis restart, the visibility timeout override and its restore sweep, TCP keepalive on
the broker and ledger connections (R11), `dsocr run` waiting out a ledger outage, and the test-only fault hook (faulty_dsocr.py) crashing or
hanging the jobs it names and no other."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from faulty_dsocr import NO_FAULTS, Faults, with_faults
from kombu import Connection
from reliability_harness import TcpProxy, ThrowawayRedis, make_pages

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.celery.app import create_app, restore_sweep
from dsocr_workers.farm.celery.broker import TRANSPORT
from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import Claiming
from dsocr_workers.farm.local_run import run_in_process
from dsocr_workers.farm.owners import owner_prefix_of_pid
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Run, job_id_for, utcnow


def one_job(db) -> str:
    run_id = uuid.uuid4().hex[:12]
    job_id = job_id_for(run_id, "a.png", 0)
    with db.transaction() as session:
        session.add(Run(id=run_id, name="t", filelist="l.txt", root="/data", model="tiny", model_label="tiny",
                        random_weights=True, queue="the-queue", parameters={}, tags={}))  # fmt: skip
        session.flush()
        session.add(Job(id=job_id, run_id=run_id, image="a.png", line=1, repeat=0, state="queued"))
    return job_id


def claim(db, job_id: str, pid: int) -> ledger.Claim:
    with db.transaction() as session:
        got = ledger.claim_job(session, job_id, owner_prefix_of_pid(pid) + "ab12cd34", lease_s=600,
                               max_attempts=2, is_dead=lambda owner: True)  # fmt: skip
    assert isinstance(got, ledger.Claim)
    return got


def test_hard_time_limit_recorded_for_the_child_that_holds_the_job(database):
    job_id = one_job(database)
    claim(database, job_id, pid=4242)
    with database.transaction() as session:  # another process's pid: not its job, nothing changes
        assert (
            ledger.record_timeout(session, job_id, owner_prefix_of_pid(424), 12, max_attempts=2)
            is None
        )
    with database.transaction() as session:
        recorded = ledger.record_timeout(
            session, job_id, owner_prefix_of_pid(4242), 12, max_attempts=2
        )
    assert recorded == ("queued", "the-queue")
    with database.transaction() as session:
        job = session.get_one(Job, job_id)
        assert (job.state, job.attempts, job.lease_owner, job.last_error_class) == (
            "queued",
            1,
            None,
            "TimeLimitExceeded",
        )
        assert job.last_error_message == "attempt 1 was killed at the hard time limit of 12 s"
    claim(database, job_id, pid=4343)  # attempt 2 is the cap: its timeout poisons the job
    with database.transaction() as session:
        assert ledger.record_timeout(session, job_id, owner_prefix_of_pid(4343), 12, max_attempts=2) == (
            "poisoned", "the-queue")  # fmt: skip
        assert session.get_one(Job, job_id).finished_at is not None


def test_an_ack_that_fails_while_redis_is_down_releases_the_message(tmp_path):
    server = ThrowawayRedis(tmp_path / "redis")
    try:
        with Connection(server.url, transport=TRANSPORT) as conn:
            channel = conn.default_channel
            queue = f"q-{uuid.uuid4().hex[:6]}"
            channel.queue_declare(queue)
            channel.basic_publish(channel.prepare_message("job"), exchange="", routing_key=queue)
            channel.qos.prefetch_count = 1  # as a worker child slot: one message at a time
            message = channel.basic_get(queue, no_ack=False)
            assert message is not None and not channel.qos.can_consume()
            server.shutdown_nosave()
            with pytest.raises(redis.ConnectionError):
                message.ack()
            # Stock kombu still counts it as held: with prefetch 1 the worker never polls Redis again.
            assert channel.qos.can_consume()
    finally:
        server.close()


def test_redis_urls_get_the_patched_transport_and_others_are_refused():
    assert create_app(Settings(broker_url="redis://127.0.0.1:6379/0")).conf.broker_transport == TRANSPORT
    assert create_app(Settings(broker_url="rediss://127.0.0.1:6380/0")).conf.broker_transport == TRANSPORT
    with pytest.raises(InputError, match="DSOCR_BROKER_URL 'memory://' is not a Redis URL"):
        Settings(broker_url="memory://")


def test_visibility_timeout_override_and_restore_sweep():
    assert Settings.from_env({}).visibility_timeout_s == 3600
    assert Settings.from_env({"DSOCR_VISIBILITY_TIMEOUT": "30"}).visibility_timeout_s == 30
    with pytest.raises(InputError):
        Settings.from_env({"DSOCR_VISIBILITY_TIMEOUT": "-1"})
    # kombu's default sweep (10 s x 10 polls) for the default hour; about a quarter of a short timeout.
    assert restore_sweep(3600) == {"unacked_restore_interval": 10, "unacked_restore_throttle": 10}
    assert restore_sweep(30) == {"unacked_restore_interval": 7, "unacked_restore_throttle": 1}
    assert restore_sweep(1) == {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}
    options = create_app(Settings.from_env({"DSOCR_VISIBILITY_TIMEOUT": "30"})).conf.broker_transport_options
    assert options["visibility_timeout"] == 30 and options["unacked_restore_interval"] == 7


def test_keepalive_on_broker_and_ledger_connections(monkeypatch):
    # R11: a connection that the server dropped during a partition must not be waited on for ever (Redis)
    # or for the OS's 2 h (libpq): probes after 30 s of silence, every 5 s, 3 times.
    options = create_app(Settings()).conf.broker_transport_options
    assert options["socket_keepalive"] is True
    assert options["socket_keepalive_options"] == {socket.TCP_KEEPIDLE: 30, socket.TCP_KEEPINTVL: 5, socket.TCP_KEEPCNT: 3}
    import psycopg
    import sqlalchemy.exc

    seen: list[dict] = []

    def connect(*args, **kwargs):
        seen.append(kwargs)
        raise psycopg.OperationalError("not connecting in a unit test")

    monkeypatch.setattr(psycopg, "connect", connect)
    for url in ("postgresql+psycopg://u@192.0.2.1/db", "postgresql+psycopg://u@192.0.2.1/db?keepalives_idle=7"):
        db = open_database(url)
        with pytest.raises(sqlalchemy.exc.OperationalError):
            db.engine.connect()
        db.dispose()
    assert {k: seen[0][k] for k in ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count")} == {
        "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 5, "keepalives_count": 3,
    }  # fmt: skip
    assert seen[1]["keepalives_idle"] == "7"  # the URL's own setting wins


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_dsocr_run_waits_out_a_ledger_outage_and_gives_up_on_a_longer_one(database, tmp_path):
    """`dsocr run` (farm/celery/worker.py) calls the ledger again 2 s, then 4 s, … after a TransientError: a job
    whose ledger comes back in time is done; past its retries, the error is raised, the job unchanged."""
    listing = make_pages(tmp_path / "pages", 2)
    run = record_run(database, read_filelist(listing), RunOptions(mode="tiny", max_new_tokens=2), queue="here")
    proxy = TcpProxy(5432)
    settings = Settings(database_url=database.url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    try:
        proxy.cut()
        threading.Timer(3, proxy.restore).start()
        started = time.monotonic()
        outcomes = run_in_process(settings, "cpu", run.job_ids[:1], max_transient_retries=2, queue="here")
        assert [outcome.status for outcome in outcomes] == ["done"]
        assert time.monotonic() - started >= 6  # refused at 0 s and 2 s, through at 6 s

        proxy.cut()
        started = time.monotonic()
        with pytest.raises(TransientError, match="database unavailable"):
            run_in_process(settings, "cpu", run.job_ids[1:], max_transient_retries=1, queue="here")
        assert 2 <= time.monotonic() - started < 10  # one wait of 2 s, then the error
    finally:
        proxy.cut()
    with database.transaction() as session:
        assert [session.get_one(Job, job_id).state for job_id in run.job_ids] == ["done", "pending"]


def a_claim(image: str) -> Claiming:
    """A written claim of a job of `image`, as `JobProcess.infer` gets it."""
    claim = ledger.Claim(job_id="j", run_id="r", image=image, image_path=Path("/data") / image, repeat=0,
                         attempt=1, owner="h:1:x", lease_expires_at=utcnow(), model="tiny", parameters={})  # fmt: skip
    written: Future[ledger.Claim | ledger.Refusal] = Future()
    written.set_result(claim)
    return Claiming("j", written)


FAULTS = Faults(crash=("poison*.png",), hang=("hung*.png",))
A_PROCESS = SimpleNamespace(ledger_threads=SimpleNamespace(release=lambda: None, wait=lambda: None))  # all the hook uses of it


def test_fault_hook_runs_every_job_it_does_not_name_to_its_end():
    ran: list[str] = []

    def infer(process, claiming, **options):
        image = claiming.result().image
        ran.append(image)
        return f"result of {image}"

    infer_with_faults = with_faults(infer, FAULTS)
    images = ["page.png", "xpoison.png", "Poison.png", "hung.jpg"]  # a glob matches whole names, case included
    assert [infer_with_faults(A_PROCESS, a_claim(image)) for image in images] == [f"result of {i}" for i in images]
    assert ran == images
    assert NO_FAULTS.dsocr_command() == [sys.executable, "-m", "dsocr_workers"]  # no faults: the package's own


def in_a_child(run: Callable[[], object]) -> int:
    """`run` in a forked child of this process, which exits 0 if `run` returns; the child's pid."""
    pid = os.fork()
    if pid == 0:
        try:
            run()
        finally:
            os._exit(0)
    return pid


def test_fault_hook_crashes_or_hangs_the_process_of_a_job_it_names():
    infer_with_faults = with_faults(lambda process, claim, **options: "ran", FAULTS)
    crashed = in_a_child(lambda: infer_with_faults(A_PROCESS, a_claim("poison0000.png")))
    _, status = os.waitpid(crashed, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    hung = in_a_child(lambda: infer_with_faults(A_PROCESS, a_claim("hung0000.png")))
    try:
        usr1 = 1 << (signal.SIGUSR1 - 1)
        deadline = time.monotonic() + 10
        while not int(proc_status(hung)["SigBlk"], 16) & usr1:  # until it blocks the soft time limit's signal
            assert time.monotonic() < deadline and os.waitpid(hung, os.WNOHANG) == (0, 0), "it never hung"
            time.sleep(0.05)
        os.kill(hung, signal.SIGUSR1)  # the soft time limit does not end it...
        time.sleep(0.5)
        assert os.waitpid(hung, os.WNOHANG) == (0, 0)
    finally:
        os.kill(hung, signal.SIGKILL)  # ...only the hard one does
        _, status = os.waitpid(hung, 0)
    assert os.WTERMSIG(status) == signal.SIGKILL


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}
