"""`dsocr status`'s view of a running run: workers from their heartbeats, ETA from the live ones only."""

from __future__ import annotations

import uuid
from datetime import timedelta

from fakes import Page, add_session, make_run, set_times
from sqlalchemy import update

from dsocr_workers.report.live import follow_progress, run_progress
from dsocr_workers.store.models import (
    IN_PROCESS_QUEUE,
    Job,
    Run,
    WorkerProcess,
    WorkerSession,
    job_id_for,
    utcnow,
)

LEASE_S = 60


def test_eta_counts_live_workers_only_and_each_worker_shows_its_job(database, tmp_path, make_png):
    now, tag = utcnow(), uuid.uuid4().hex[:8]
    for sid in ("s-live", "s-dead"):
        add_session(database, f"{sid}-{tag}", now - timedelta(minutes=5), now - timedelta(minutes=4))
    pages = {("a.png", r): Page(session=f"s-live-{tag}") for r in range(4)} | {
        ("b.png", r): Page(session=f"s-dead-{tag}") for r in range(4)
    }
    run_id = make_run(database, tmp_path, make_png, pages)
    queue = f"q-{run_id}"  # this test's own: the PostgreSQL database is shared by the session's tests
    processes = {  # id: (queues, seconds since its last beat, stopped)
        "h:1:live": (queue, 3, False), "h:2:dead": (queue, 100, False), "h:3:elsewhere": ("other", 1, False),
        "h:4:new": (f"other,{queue}", 5, False), "h:5:stopped": (queue, 20, True),
    }  # fmt: skip
    with database.transaction() as session:
        session.execute(update(Run).where(Run.id == run_id).values(queue=queue))
        for pid, (owner, (queues, age, stopped)) in enumerate(processes.items()):
            beat = now - timedelta(seconds=age)
            session.add(WorkerProcess(id=f"{owner}-{run_id}", host="h", pid=pid, device="cpu", queues=queues,
                                      started_at=beat, heartbeat_at=beat, stopped_at=beat if stopped else None))  # fmt: skip
        for sid, owner in (("s-live", "h:1:live"), ("s-dead", "h:2:dead")):
            session.execute(
                update(WorkerSession).where(WorkerSession.id == f"{sid}-{tag}")
                .values(worker_process_id=f"{owner}-{run_id}")
            )  # fmt: skip
    # a.png jobs took 2 s each (the live worker), b.png jobs 1 s (the dead one, faster while it lived).
    start = now - timedelta(minutes=3)
    set_times(database, run_id, start, {("a.png", r): (10 * r, 10 * r + 2) for r in range(4)}
              | {("b.png", r): (10 * r, 10 * r + 1) for r in range(4)})  # fmt: skip
    with database.transaction() as session:
        for image, repeat, state, owner in (("b.png", 2, "queued", None), ("b.png", 3, "queued", None),
                                            ("a.png", 3, "running", f"h:1:live-{run_id}")):  # fmt: skip
            session.execute(
                update(Job).where(Job.id == job_id_for(run_id, image, repeat)).values(state=state, lease_owner=owner)
            )
        run = session.get_one(Run, run_id)
        progress = run_progress(session, run, LEASE_S, now=now)

    assert (progress.total, progress.final, dict(progress.counts)) == (8, 5, {"done": 5, "queued": 2, "running": 1})
    shown = {w.id.removesuffix(f"-{run_id}"): w for w in progress.workers}
    assert list(shown) == ["h:1:live", "h:4:new", "h:2:dead", "h:5:stopped"]  # live first; not other queues
    live, new, dead, stopped = (shown[k] for k in ("h:1:live", "h:4:new", "h:2:dead", "h:5:stopped"))
    assert (live.live, live.current_image, live.jobs_done, live.job_s) == (True, "a.png", 3, 2.0)
    assert (dead.live, dead.jobs_done, dead.job_s, round(dead.heartbeat_age_s)) == (False, 2, 1.0, 100)
    assert (new.live, new.jobs_done, new.job_s) == (True, 0, None)
    assert (stopped.live, stopped.stopped) == (False, True)
    # The live worker at 2 s per job, the new one at the run's median (2 s); the dead one not at all.
    assert progress.live_workers == 2
    assert progress.pages_per_s == 1.0
    assert progress.eta_s == 3.0


def test_no_live_worker_no_eta(database, tmp_path, make_png):
    run_id = make_run(database, tmp_path, make_png, {("a.png", 0): Page(), ("a.png", 1): Page()})
    with database.transaction() as session:
        session.execute(update(Job).where(Job.id == job_id_for(run_id, "a.png", 1)).values(state="queued"))
        session.execute(update(Run).where(Run.id == run_id).values(queue=f"nobody-{run_id}"))
        progress = run_progress(session, session.get_one(Run, run_id), LEASE_S)
    assert (progress.live_workers, progress.eta_s, progress.pages_per_s) == (0, None, None)


def test_follow_progress_polls_until_every_job_is_final(database, tmp_path, make_png):
    run_id = make_run(database, tmp_path, make_png, {("a.png", 0): Page(), ("a.png", 1): Page()})
    with database.transaction() as session:
        session.execute(update(Job).where(Job.id == job_id_for(run_id, "a.png", 1)).values(state="queued"))
    once = list(follow_progress(database.url, run_id[:8], LEASE_S))  # no interval: one look
    assert [(p.run_id, p.final, p.finished) for p in once] == [(run_id, 1, False)]
    watching = follow_progress(database.url, run_id, LEASE_S, interval_s=0.01)
    assert next(watching).counts["queued"] == 1
    assert next(watching).counts["queued"] == 1  # still open: it looks again
    with database.transaction() as session:
        session.execute(update(Job).where(Job.id == job_id_for(run_id, "a.png", 1)).values(state="failed"))
    last = next(watching)
    assert (last.final, last.total, last.finished) == (2, 2, True)
    assert next(watching, None) is None  # every job final: it stops


def test_an_in_process_run_lists_only_its_own_line(database, tmp_path, make_png):
    """`dsocr run`'s queue is shared by every in-process run: another run's line (stopped or not) is not
    this run's worker."""
    now = utcnow()
    run_id = make_run(database, tmp_path, make_png, {("a.png", 0): Page(), ("a.png", 1): Page()})
    mine, earlier = f"h:1:mine-{run_id}", f"h:2:earlier-{run_id}"
    with database.transaction() as session:
        session.execute(update(Run).where(Run.id == run_id).values(queue=IN_PROCESS_QUEUE))
        session.execute(update(Job).where(Job.id == job_id_for(run_id, "a.png", 1))
                        .values(state="running", lease_owner=mine))  # fmt: skip
        for pid, owner in enumerate((mine, earlier)):
            session.add(WorkerProcess(id=owner, host="h", pid=pid, device="cpu", queues=IN_PROCESS_QUEUE,
                                      started_at=now, heartbeat_at=now, stopped_at=now if owner == earlier else None))
        progress = run_progress(session, session.get_one(Run, run_id), LEASE_S, now=now)
    assert [w.id for w in progress.workers] == [mine]
