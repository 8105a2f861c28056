"""Unit tests of the farm changes the reliability suite forced: the parent's record of a hard time limit,
acks that survive a Redis restart, the visibility timeout override and its restore sweep, TCP keepalive on
the broker and ledger connections (R11), and the test-only fault hook being inert unless asked for."""

from __future__ import annotations

import os
import socket
import uuid

import pytest
import redis
from kombu import Connection
from reliability_harness import ThrowawayRedis

from dsocr_workers.errors import InputError
from dsocr_workers.farm import faults
from dsocr_workers.farm.broker import TRANSPORT
from dsocr_workers.farm.celery_app import create_app, restore_sweep
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Run, job_id_for


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
        got = ledger.claim_job(session, job_id, f"{ledger._host}:{pid}:ab12cd34", lease_s=600, max_attempts=2,
                               is_dead=lambda owner: True)  # fmt: skip
    assert isinstance(got, ledger.Claim)
    return got


def test_hard_time_limit_recorded_for_the_child_that_holds_the_job(database):
    job_id = one_job(database)
    claim(database, job_id, pid=4242)
    with database.transaction() as session:  # another process's pid: not its job, nothing changes
        assert (
            ledger.record_timeout(session, job_id, ledger.owner_prefix_of_pid(424), 12, max_attempts=2)
            is None
        )
    with database.transaction() as session:
        recorded = ledger.record_timeout(
            session, job_id, ledger.owner_prefix_of_pid(4242), 12, max_attempts=2
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
        assert ledger.record_timeout(session, job_id, ledger.owner_prefix_of_pid(4343), 12, max_attempts=2) == (
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


def test_fault_hook_is_inert_unless_asked(monkeypatch):
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    faults.inject("poison.png")  # would SIGKILL this test process if it were active
    monkeypatch.setenv(faults.FAULTS_ENV, "crash=poison*.png")
    faults.inject("page.png")  # no pattern matches: nothing happens
    assert faults.parse("crash=a*.png; hang=b.png") == [("crash", "a*.png"), ("hang", "b.png")]
    for bad in ("explode=a.png", "crash", "crash="):
        with pytest.raises(ValueError):
            faults.parse(bad)
    assert os.getpid() > 0
