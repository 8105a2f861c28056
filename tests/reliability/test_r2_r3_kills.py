"""R2: `kill -9` of a worker's child mid-job, many times in one run — the killed jobs finish on a later
attempt (Celery's reject_on_worker_lost puts the message back, at the head of the queue; the claim sees
the dead lease owner).
R3: `kill -9` of whole workers (parent and child) — Celery puts nothing back: the surviving workers'
heartbeats find the dead holder's lease (and the reservation of the job its lane had fetched next)
expired and put the dead worker's messages back at the head of the queue, within lease + heartbeat
seconds of its last beat, with nothing typed (farm/liveness.py)."""

from __future__ import annotations

import math
import os
import signal
import time
from datetime import datetime

import pytest
from reliability_harness import (
    SECOND_JOB,
    SWEEP_MARGIN_S,
    check_invariants,
    make_pages,
    owner_pid,
    record,
    seconds_since,
)
from sqlalchemy import select

from dsocr_workers.settings import Settings
from dsocr_workers.store.models import JobAttempt, utcnow


def child_kills(new_farm, tmp_path, jobs: int, kills: int, scenario: str) -> None:
    farm = new_farm()
    listing = make_pages(tmp_path / "pages", jobs)
    run_id = farm.submit(listing, *SECOND_JOB)
    workers = [farm.start_worker() for _ in range(2)]
    killed: dict[str, int] = {}  # job id -> pid of the child killed while running it
    last_kill = [0.0]

    def kill_a_child(current) -> None:
        if len(killed) >= kills or time.monotonic() - last_kill[0] < 1.0:
            return
        children = set().union(*(w.child_pids() for w in workers))
        for job in current:
            pid = owner_pid(job.lease_owner)
            # Mid-job: claimed a moment ago (a job decodes for about a second), by one of our children.
            if (
                job.state == "running"
                and pid in children
                and job.id not in killed
                and seconds_since(job.started_at) < 0.4
            ):
                os.kill(pid, signal.SIGKILL)
                killed[job.id] = pid
                last_kill[0] = time.monotonic()
                return

    # Each kill costs an attempt and a replacement child's start.
    budget = farm.run_budget_s(attempts=jobs + kills, workers=len(workers), starts=1 + math.ceil(kills / len(workers)))
    wall = farm.wait_until_final(run_id, timeout=budget, tick=kill_a_child, poll=0.1)
    tally = check_invariants(farm, run_id, max_attempts=3)
    assert len(killed) == kills
    by_id = {j.id: j for j in farm.jobs(run_id)}
    assert all(by_id[j].state == "done" and by_id[j].attempts >= 2 for j in killed), [
        (by_id[j].image, by_id[j].state, by_id[j].attempts) for j in killed
    ]
    assert tally.done == jobs and tally.results == jobs
    assert all(w.alive() for w in workers)  # the parents survive and fork new children
    record(scenario, workers=2, faults=f"{kills} child kills", lost=jobs - tally.done, duplicated=tally.duplicates,
           killed_jobs_done_on_attempt=sorted(by_id[j].attempts for j in killed), wall_s=round(wall, 1), tally=tally)  # fmt: skip


def test_r2_child_kills_ci(new_farm, tmp_path):
    # The kills come a second apart from the first jobs on; a killed child's parent forks a new one,
    # which takes seconds to load: 10 jobs of ~1 s leave jobs to kill for all three.
    child_kills(new_farm, tmp_path, jobs=10, kills=3, scenario="R2 kill -9 of a child (CI)")


@pytest.mark.slow
def test_r2_child_kills_10(new_farm, tmp_path):
    child_kills(new_farm, tmp_path, jobs=60, kills=10, scenario="R2 kill -9 of a child")


LEASE_S, HEARTBEAT_S = 15, 3


def worker_kills(new_farm, tmp_path, jobs: int, kills: int, scenario: str) -> None:
    # A short lease and heartbeat; the visibility timeout stays the default hour: the sweep that takes a
    # dead worker's jobs back puts its messages back too. Nobody runs `dsocr reconcile`.
    # The hard limit stays the harness's 30 s: the lease no longer has to outlast it (heartbeats renew it),
    # and a 1 s job can take several on a loaded 2-core machine.
    farm = new_farm(DSOCR_LEASE_SECONDS=str(LEASE_S), DSOCR_HEARTBEAT_SECONDS=str(HEARTBEAT_S))
    requeue_within_s = farm.settings().requeue_within_s
    listing = make_pages(tmp_path / "pages", jobs)
    run_id = farm.submit(listing, *SECOND_JOB)
    workers = [farm.start_worker() for _ in range(3)]
    killed: dict[str, float] = {}  # job id -> time of the kill (monotonic)
    killed_at: dict[str, datetime] = {}  # the same in the ledger's clock (naive UTC)
    lease_seen: dict[str, datetime] = {}  # job id -> its lease's expiry as last read before the kill

    def kill_a_worker(current) -> None:
        now = time.monotonic()
        if len(killed) >= kills or (killed and now - max(killed.values()) < 2.0):
            return
        for job in current:
            pid = owner_pid(job.lease_owner)
            victim = next((w for w in workers if w.alive() and pid in w.child_pids()), None)
            # A job killed once is not picked again: each killed job must be done on its second attempt.
            fresh = job.id not in killed
            if fresh and job.state == "running" and victim is not None and seconds_since(job.started_at) < 0.4:
                victim.kill_all()
                killed[job.id], killed_at[job.id], lease_seen[job.id] = time.monotonic(), utcnow(), job.lease_expires_at
                workers.append(farm.start_worker())  # the capacity comes back, as a supervisor would do
                return

    # The killed workers' replacements start while the others work; each killed job waits out its lease.
    budget = farm.run_budget_s(attempts=jobs + kills, workers=3, starts=2, waits_s=requeue_within_s + SWEEP_MARGIN_S)
    wall = farm.wait_until_final(run_id, timeout=budget, tick=kill_a_worker, poll=0.2)
    finished = {j.id: j for j in farm.jobs(run_id)}
    tally = check_invariants(farm, run_id, max_attempts=3, drain_timeout=90)
    assert len(killed) == kills
    recovery = []  # seconds from the kill to the job done on its second attempt
    requeued = []  # seconds from the kill to a live worker's heartbeat queueing it again
    for job_id, at in killed_at.items():
        job = finished[job_id]
        assert job.state == "done" and job.attempts == 2, (job.image, job.state, job.attempts)
        assert job.last_error_class == "LeaseExpired", job.last_error_message  # taken back by a sweep
        recovery.append(round((job.finished_at - at).total_seconds(), 1))
        requeued.append(round((job.queued_at - at).total_seconds(), 1))
        # Not before the lease last seen ran out (renewals only move it later); its holder's last beat
        # renewed it to at most LEASE_S past the kill, and a live worker's sweep (every heartbeat) took it.
        assert job.queued_at >= lease_seen[job_id], (job.queued_at, lease_seen[job_id])
        assert requeued[-1] <= requeue_within_s + SWEEP_MARGIN_S, (
            f"requeued {requeued[-1]} s after the kill: lease {LEASE_S} s + heartbeat {HEARTBEAT_S} s "
            f"+ {SWEEP_MARGIN_S} s for a late sweep")  # fmt: skip
    assert tally.done == jobs and tally.results == jobs
    record(scenario, workers=3, faults=f"{kills} whole-worker kills", lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S,
           lost=jobs - tally.done, duplicated=tally.duplicates, requeued_after_kill_s=requeued,
           done_after_kill_s=recovery, wall_s=round(wall, 1), tally=tally)  # fmt: skip


def test_r3_worker_kills_ci(new_farm, tmp_path):
    # Both kills come within seconds of the first jobs and their recovery waits on the lease, not on the
    # backlog: 12 jobs of ~1 s keep the two other workers busy that long (24 only cost CPU).
    worker_kills(new_farm, tmp_path, jobs=12, kills=2, scenario="R3 kill -9 of a whole worker (CI)")


@pytest.mark.slow
def test_r3_worker_kills_3(new_farm, tmp_path):
    worker_kills(new_farm, tmp_path, jobs=60, kills=3, scenario="R3 kill -9 of a whole worker")


# The promise at the defaults: a dead worker's job is done by another within 90 s of the kill. Its bound
# is the requeue (lease + heartbeat) and one run of the job on a warm worker (about a second).
PROMISE_S, RERUN_S = 90, 20


def test_r3_worker_kill_recovered_within_lease_and_heartbeat(new_farm, tmp_path):
    """What a newcomer sees: two workers, one killed with its child mid-job, no visibility-timeout shortcut
    (the default hour), nothing typed: its job is taken back by the other worker's sweep within lease +
    heartbeat of the kill and done. At the defaults that bound keeps the 90 s promise; the run itself
    uses a short lease, so that its wait is seconds instead of a minute."""
    defaults = Settings.from_env({})
    assert defaults.requeue_within_s + RERUN_S <= PROMISE_S, (defaults.lease_s, defaults.heartbeat_s)
    farm = new_farm(DSOCR_LEASE_SECONDS="12", DSOCR_HEARTBEAT_SECONDS="3")
    requeue_within_s = farm.settings().requeue_within_s
    listing = make_pages(tmp_path / "pages", 8)
    run_id = farm.submit(listing, *SECOND_JOB)
    workers = [farm.start_worker() for _ in range(2)]
    killed: dict[str, datetime] = {}

    def kill_one(current) -> None:
        if killed or sum(j.state == "done" for j in current) < 2:  # both warm and working first
            return
        for job in current:
            victim = next((w for w in workers if owner_pid(job.lease_owner) in w.child_pids()), None)
            if job.state == "running" and victim is not None and seconds_since(job.started_at) < 0.4:
                victim.kill_all()
                killed[job.id] = utcnow()
                return

    budget = farm.run_budget_s(attempts=9, workers=1, waits_s=requeue_within_s + SWEEP_MARGIN_S)
    farm.wait_until_final(run_id, timeout=budget, tick=kill_one, poll=0.2)
    (job_id, at), = killed.items()
    tally = check_invariants(farm, run_id, max_attempts=3)  # the killed worker's messages were put back, none left
    job = {j.id: j for j in farm.jobs(run_id)}[job_id]
    requeued_after, done_after = (job.queued_at - at).total_seconds(), (job.finished_at - at).total_seconds()
    assert (job.state, job.attempts, job.last_error_class) == ("done", 2, "LeaseExpired")
    # The sweep may come late on a loaded machine; the job's second run ends within the hard time limit.
    assert requeued_after <= requeue_within_s + SWEEP_MARGIN_S, (requeued_after, requeue_within_s)
    assert done_after <= requeue_within_s + SWEEP_MARGIN_S + farm.settings().hard_time_limit_s, done_after
    assert tally.done == tally.jobs == tally.results == 8
    status = farm.dsocr("status", "--run", run_id)
    assert status.returncode == 0, status.stderr
    assert "1 live worker(s)" in status.stdout and "silent" in status.stdout, status.stdout
    record("R3 kill -9 of a whole worker, recovered within lease + heartbeat", workers=2, lost=0,
           lease_s=farm.settings().lease_s, heartbeat_s=farm.settings().heartbeat_s, duplicated=tally.duplicates,
           requeued_after_kill_s=round(requeued_after, 1), done_after_kill_s=round(done_after, 1), tally=tally)  # fmt: skip


def test_r3_a_killed_workers_messages_come_back_at_once_and_first(new_farm, tmp_path):
    """Issue 31 item 2: a whole worker killed mid-job (its lane's parent and child), at the default
    visibility timeout of an hour. Its lane held two messages, unacknowledged: the job it ran and the job it
    had fetched for its child next (reserved in the ledger). Once a live worker's sweep finds the lease and
    the reservation run out, both messages go back to the head of the queue: each is taken before the jobs
    still queued then (at most the one message the live lane had fetched already goes before them), and
    Redis holds no stale copy afterwards. Before, the sweep sent a new message for the running job to the
    back of the queue, and the dead worker's own copy waited out the hour."""
    lease_s = 8
    farm = new_farm(DSOCR_LEASE_SECONDS=str(lease_s), DSOCR_HEARTBEAT_SECONDS="1")
    listing = make_pages(tmp_path / "pages", 24)
    run_id = farm.submit(listing, *SECOND_JOB)
    victim = farm.start_worker()
    farm.start_worker()  # the survivor, whose sweep brings the victim's jobs back
    killed: dict[str, datetime] = {}  # the job running at the kill -> when
    reserved: set[str] = set()  # the job the victim's lane had fetched for its child next

    def kill_the_victim(current) -> None:
        if killed or sum(j.state == "done" for j in current) < 2:  # both warm and working first
            return
        for job in current:
            pid = owner_pid(job.lease_owner)
            fetched = {j.id for j in current if j.reserved_by is not None and j.reserved_by == job.lease_owner}
            if job.state == "running" and pid in victim.child_pids() and fetched and seconds_since(job.started_at) < 0.8:
                victim.kill_all()
                killed[job.id] = utcnow()
                reserved.update(fetched)
                return

    budget = farm.run_budget_s(attempts=26, workers=1, waits_s=farm.settings().requeue_within_s + SWEEP_MARGIN_S)
    farm.wait_until_final(run_id, timeout=budget, tick=kill_the_victim, poll=0.1)
    assert killed and reserved, "the victim was never caught running one job with the next one fetched"
    # No stale copy of either message is left for the visibility timeout: drained, nothing abandoned.
    tally = check_invariants(farm, run_id, max_attempts=3, drain_timeout=20)
    assert tally.done == tally.jobs == tally.results == 24
    ((running, at),) = killed.items()
    (fetched,) = reserved
    jobs = {j.id: j for j in farm.jobs(run_id)}
    assert (jobs[running].attempts, jobs[running].last_error_class) == (2, "LeaseExpired")
    assert jobs[fetched].attempts == 1  # never claimed before: it lost nothing, only its reservation
    with farm.ledger().transaction() as session:
        claims = session.execute(
            select(JobAttempt.job_id, JobAttempt.claimed_at).where(JobAttempt.run_id == run_id)
        ).all()  # fmt: skip
    requeued_at = jobs[running].queued_at
    retaken_at = max(claimed for job_id, claimed in claims if job_id == running)
    fetched_at = next(claimed for job_id, claimed in claims if job_id == fetched)
    # Back first: between the sweep and each one's claim, only the other one and the message the survivor's
    # lane had fetched before the sweep.
    for back_at in (retaken_at, fetched_at):
        between = {job_id for job_id, claimed in claims if requeued_at < claimed < back_at} - {running, fetched}
        assert len(between) <= 1, (back_at, sorted(claimed for _, claimed in claims))
    assert any(claimed > max(retaken_at, fetched_at) for _, claimed in claims)  # newer work was still queued
    record("R3 kill -9 of a whole worker: its messages back at once and first", workers=2, lease_s=lease_s,
           requeued_after_kill_s=round((requeued_at - at).total_seconds(), 1), tally=tally)  # fmt: skip
