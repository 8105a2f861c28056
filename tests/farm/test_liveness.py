"""A heartbeat's sweep on the embedded default (SQLite) and the real Redis: the labels of the messages it
sends are read in the sweep's own transaction (a second one would wait on SQLite's write lock until its
busy timeout), and a job it brings back is queued as of that transaction, not of a wait for the lock; a
message a worker died holding before its child reserved or claimed the job goes back to the head of its
queue a lease after its delivery, and none that a live process stands for does; a message a dead worker
took from its queue without recording it as delivered is sent again by the sweep that finds it dead."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from datetime import timedelta
from functools import partial

import pytest
import redis

from dsocr_workers.farm.celery.app import create_app
from dsocr_workers.farm.celery.broker import delivered_messages, job_ids_held, take_back_messages
from dsocr_workers.farm.celery.messages import bring_back_job_messages, job_labels, send_job_messages
from dsocr_workers.farm.liveness import Heartbeat, Sweep, orphaned_after_s
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Run, WorkerProcess, job_id_for, utcnow


def add_run(db, queue: str, images: list[str]) -> list[str]:
    """A run on `queue` with a queued job per image; their ids."""
    with db.transaction() as session:
        session.add(Run(id="r1", name="t", filelist="l", root="/d", model="tiny", model_label="tiny",
                        random_weights=True, queue=queue, parameters={}, tags={}))  # fmt: skip
        session.flush()
        for line, image in enumerate(images, 1):
            session.add(Job(id=job_id_for("r1", image, 0), run_id="r1", image=image, line=line, repeat=0, state="queued"))
    return [job_id_for("r1", image, 0) for image in images]


@pytest.fixture
def farm_app(broker_env):
    """A Celery app on the real Redis under keys and a queue of this test's own."""
    tag = uuid.uuid4().hex[:8]
    queue, prefix = f"{broker_env['DSOCR_QUEUE']}-{tag}", f"{broker_env['DSOCR_BROKER_KEY_PREFIX']}{tag}:"
    app = create_app(Settings(broker_url=broker_env["DSOCR_BROKER_URL"], broker_key_prefix=prefix, queue=queue))
    client = redis.Redis.from_url(broker_env["DSOCR_BROKER_URL"])
    yield app, queue
    if keys := client.keys(prefix + "*"):
        client.delete(*keys)
    client.close()


def test_a_sqlite_sweep_requeues_a_dead_holders_job_at_once_with_its_label(sqlite_url, farm_app):
    app, queue = farm_app
    db = open_database(sqlite_url)
    (job_id,) = add_run(db, queue, ["a.png"])
    with db.transaction() as session:
        ledger.claim_job(session, job_id, "h:1:dead", lease_s=60, max_attempts=3, is_dead=lambda o: False)
    sent: dict[str, str] = {}
    sweep = Sweep((queue,), lambda session, jobs: sent.update(job_labels(session, [j for j, _ in jobs])),
                  delivered=partial(delivered_messages, app, (queue,)), take_back=partial(take_back_messages, app), held=lambda queues: set())  # fmt: skip
    heartbeat = Heartbeat(db, "h:2:live", Settings(), device="cpu", queues=(queue,), sweep=sweep)
    started = time.monotonic()
    beat = heartbeat.beat(utcnow() + timedelta(seconds=61))
    assert time.monotonic() - started < 5  # not a wait on the write lock
    assert beat.requeued == [(job_id, queue)]
    assert sent == {job_id: "{'run': 'r1', 'image': 'a.png', 'repeat': 0}"}
    db.dispose()


def test_a_sweep_that_waited_for_the_write_lock_queues_the_job_once_it_holds_the_lock(sqlite_url, farm_app):
    """A job brought back is `queued_at` when the sweep's transaction has the write lock, just before its
    message is published, not when the beat began: lanes fetch and claim while a sweep waits for the lock,
    and a claim then must not read as one after the job was queued again (the R3 kill test counts them)."""
    app, queue = farm_app
    db = open_database(sqlite_url)
    (job_id,) = add_run(db, queue, ["a.png"])
    with db.transaction() as session:
        ledger.claim_job(session, job_id, "h:1:dead", lease_s=1, max_attempts=3, is_dead=lambda o: False)
    time.sleep(1.2)  # its lease runs out on the real clock, which the beat below reads
    sweep = Sweep((queue,), lambda session, jobs: None, delivered=partial(delivered_messages, app, (queue,)),
                  take_back=partial(take_back_messages, app), held=lambda queues: set())  # fmt: skip
    heartbeat = Heartbeat(db, "h:2:live", Settings(), device="cpu", queues=(queue,), sweep=sweep)
    writer = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # another process's write under way
    beats = []
    beating = threading.Thread(target=lambda: beats.append(heartbeat.beat()))
    beating.start()
    time.sleep(1.0)
    released = utcnow()
    writer.execute("COMMIT")
    beating.join(timeout=30)
    writer.close()
    assert beats and beats[0].requeued == [(job_id, queue)]
    with db.transaction() as session:
        queued_at = session.get_one(Job, job_id).queued_at
    assert queued_at is not None and queued_at >= released, (queued_at, released)
    db.dispose()


def test_a_message_held_a_lease_with_nobody_on_its_job_goes_back_to_the_head_of_its_queue(sqlite_url, farm_app):
    app, queue = farm_app
    db = open_database(sqlite_url)
    orphan, reserved, running, later = add_run(db, queue, ["a.png", "b.png", "c.png", "d.png"])
    send_job_messages(app, [(job_id, queue) for job_id in (orphan, reserved, running, later)], [], {})
    settings = Settings()
    with app.connection_for_write() as dead:  # a lane that fetched three messages, then died with its child
        channel = dead.default_channel
        held = [channel.basic_get(queue, no_ack=False).headers["id"] for _ in range(3)]
        assert held == [orphan, reserved, running]
        with db.transaction() as session:  # its child reserved one and claimed another before it died
            ledger.reserve_job(session, reserved, "h:1:dead", lease_s=settings.lease_s)
            ledger.claim_job(session, running, "h:1:dead", lease_s=settings.lease_s, max_attempts=3,
                             is_dead=lambda o: False)  # fmt: skip
        sweep = Sweep((queue,), lambda session, jobs: None, delivered=partial(delivered_messages, app, (queue,)),
                      take_back=partial(take_back_messages, app), held=lambda queues: set())  # fmt: skip
        live = Heartbeat(db, "h:2:live", settings, device="cpu", queues=(queue,), sweep=sweep)
        # Delivered just now: a live lane's child is reserving it, or claiming it.
        assert live.beat().orphaned == []
        assert set(delivered_messages(app, (queue,))) == {orphan, reserved, running}
        beat = live.beat(utcnow() + timedelta(seconds=settings.lease_s - 1))
        assert beat.orphaned == [] and beat.requeued == [] and beat.unreserved == []
        # The reservation and the lease ran out: those two come back through `unreserved` and `requeued`
        # (sent by `publish`, a no-op here), and the first message is not yet an orphan.
        beat = live.beat(utcnow() + timedelta(seconds=settings.lease_s + 1))
        assert beat.orphaned == []
        assert beat.unreserved == [(reserved, queue)] and beat.requeued == [(running, queue)]
        # Held long enough, with nobody on its job: back at the head.
        beat = live.beat(utcnow() + timedelta(seconds=orphaned_after_s(settings) + 1))
        # The other two, queued again and unreserved by the beat before with their messages still held
        # (publish did nothing), are orphans now by the same rule.
        assert beat.orphaned == sorted([orphan, reserved, running])
        assert delivered_messages(app, (queue,)) == {}
        again = [channel.basic_get(queue, no_ack=False).headers["id"] for _ in range(4)]
        assert set(again[:3]) == {orphan, reserved, running} and again[3] == later  # at the head, before d
    db.dispose()


def test_a_retry_held_for_its_countdown_is_due_at_its_eta(farm_app):
    app, queue = farm_app
    app.send_task("dsocr.run_job", args=["x"], task_id="x", queue=queue, countdown=600)
    with app.connection_for_write() as worker:
        worker.default_channel.basic_get(queue, no_ack=False)
        due = delivered_messages(app, (queue,))
    assert set(due) == {"x"} and 590 < due["x"] - time.time() < 610
    assert delivered_messages(app, ("another-queue",)) == {}


def test_a_message_lost_with_a_dead_worker_is_sent_again_by_the_sweep_that_finds_it_dead(sqlite_url, farm_app):
    app, queue = farm_app
    db = open_database(sqlite_url)
    lost, waiting, other = add_run(db, queue, ["a.png", "b.png", "c.png"])
    send_job_messages(app, [(job_id, queue) for job_id in (lost, waiting, other)], [], {})
    settings = Settings()
    prefix = app.conf.broker_transport_options["global_keyprefix"]
    client = redis.Redis.from_url(app.conf.broker_url)
    # A worker pops a message with BRPOP and records it as delivered next: killed in between, it took the
    # message with it. RPOP is that pop.
    Heartbeat(db, "h:1:dead", settings, device="cpu", queues=(queue,)).beat()
    assert job_id_of(client.rpop(prefix + queue)) == lost
    sweep = Sweep((queue,), partial(bring_back_job_messages, app), delivered=partial(delivered_messages, app, (queue,)),
                  take_back=partial(take_back_messages, app),
                  held=partial(job_ids_held, app.conf.broker_url, prefix))  # fmt: skip
    live = Heartbeat(db, "h:2:live", settings, device="cpu", queues=(queue,), sweep=sweep)
    assert live.beat().resent == []  # the dead one beat just now: alive as far as anyone can tell
    silent = utcnow() + timedelta(seconds=settings.lease_s + 1)
    assert live.beat(silent).resent == [(lost, queue)]
    assert sorted(job_id_of(raw) for raw in client.lrange(prefix + queue, 0, -1)) == sorted([lost, waiting, other])
    assert live.beat(silent + timedelta(seconds=1)).resent == []  # found dead once
    with db.transaction() as session:
        assert session.get_one(WorkerProcess, "h:1:dead").found_dead_at is not None
    client.rpop(prefix + queue)
    # A process that beats again is alive, and found dead again once it falls silent.
    Heartbeat(db, "h:1:dead", settings, device="cpu", queues=(queue,)).beat(silent)
    with db.transaction() as session:
        assert session.get_one(WorkerProcess, "h:1:dead").found_dead_at is None
    later = silent + timedelta(seconds=settings.lease_s + 1)
    assert len(live.beat(later).resent) == 1
    client.close()
    db.dispose()


def job_id_of(raw: bytes) -> str:
    """The job id of a raw message in a queue's list (task ids are job ids)."""
    return json.loads(raw)["headers"]["id"]
