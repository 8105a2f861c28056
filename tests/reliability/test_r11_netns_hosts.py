"""R11: several hosts for real. Three network namespaces of this machine (`NetnsLab`): the services — a
throwaway Redis and PostgreSQL — in one, a worker host in each of two others, each host with its own
hostname and its own veth link to the services in the RFC 2544 range 198.18.0.0/15. The hosts reach Redis
and PostgreSQL only over their links; the test reads the ledger and Redis over the services' loopback.

Host 1 is killed whole (`kill -9` of every process in its namespace) mid-job and started again at once, as
a supervisor would (systemd `Restart=always`, a node that reboots): a farm's capacity comes back, and the
rest of the scenario needs a second live host. Later host 2's link is cut for 30 s — longer than its 20 s
lease — mid-job, and restored. Nothing is typed: only lease expiry and a live host's heartbeat sweep take
a job back (the hosts have different hostnames, so the ledger's same-host dead-owner shortcut never
applies), and host 2's late result for the job it held during the cut must be refused by the lease guard.

A second scenario makes the cut outlast the servers' patience (their TCP gives up on a connection whose
data goes unacknowledged after a few seconds instead of ~15 min): host 2, idle, with its consumer waiting
in BRPOP and a ledger query waiting for its reply, is left with half-open connections that nothing resets.
"""

from __future__ import annotations

import re
import select as io_select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reliability_harness import (
    FAST_JOB,
    FINAL_STATES,
    SECOND_JOB,
    Farm,
    NetnsLab,
    check_invariants,
    make_pages,
    netns_unavailable,
    record,
    seconds_since,
)
from sqlalchemy import select

from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Result, WorkerSession, utcnow

LEASE_S, HEARTBEAT_S, CUT_S = 20, 5, 30
JOBS = 80  # about 1 s each: enough that work is left when host 2's link comes back
# Redis hands the killed host's unacknowledged message to another consumer after this long: later than
# the sweep takes its job back (lease + heartbeat), so the sweep alone recovers it; soon enough that the
# queue drains within the test.
VISIBILITY_S = 45


@pytest.fixture
def netns_lab(tmp_path: Path) -> Iterator[NetnsLab]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"R11 builds network namespaces on this machine: {reason}")
    lab = NetnsLab(tmp_path / "lab")
    try:
        lab.up()
        lab.start_services()
        yield lab
    finally:
        lab.close()


@pytest.mark.slow
def test_r11_two_hosts_kill_and_link_cut(netns_lab: NetnsLab, tmp_path: Path, subprocess_env: dict[str, str]):
    lab = netns_lab
    with lab.entered():  # the test's own traffic: the services namespace's loopback
        farm = Farm.create(
            tmp_path / "farm", lab.database_url(), subprocess_env, broker_url=lab.broker_url(),
            DSOCR_HARD_TIME_LIMIT="120", DSOCR_LEASE_SECONDS=str(LEASE_S),
            DSOCR_HEARTBEAT_SECONDS=str(HEARTBEAT_S), DSOCR_VISIBILITY_TIMEOUT=str(VISIBILITY_S),
        )  # fmt: skip
        try:
            two_hosts(lab, farm, tmp_path)
        finally:
            for host in lab.hosts:
                lab.kill_host(host)
            farm.stop()  # reaps them


def two_hosts(lab: NetnsLab, farm: Farm, tmp_path: Path) -> None:
    h1, h2 = lab.hosts
    listing = make_pages(tmp_path / "pages", JOBS)
    run_id = farm.submit(listing, *SECOND_JOB)
    host_of: dict[int, str] = {}  # index in farm.workers -> hostname

    def start_on(host) -> None:
        host_of[len(farm.workers)] = host.hostname
        farm.start_worker(wrap=lab.host_argv(host), **lab.host_env(host))

    start_on(h1)
    start_on(h2)
    kill: dict[str, Any] = {}
    cut: dict[str, Any] = {}

    def h2_beats() -> dict[str, Any]:
        return {p.id: p.heartbeat_at for p in farm.processes() if p.host == h2.hostname}

    def just_claimed(jobs, host):
        return next((j for j in jobs if j.state == "running" and host.owns(j.lease_owner)
                     and seconds_since(j.started_at) < 0.4), None)  # fmt: skip

    def tick(jobs) -> None:
        now = time.monotonic()
        if not kill:
            # Both hosts warm and working, then host 1 lost with everything on it, mid-job.
            if sum(j.state == "done" for j in jobs) >= 4 and (job := just_claimed(jobs, h1)):
                kill.update(job=job.id, owner=job.lease_owner, at=now, utc=utcnow(), pids=lab.kill_host(h1))
                start_on(h1)  # the supervisor
            return
        if not cut:
            # Once the killed job is taken back and the new host 1 works: host 2's link cut, mid-job.
            killed = next(j for j in jobs if j.id == kill["job"])
            h1_back = any(j.state == "running" and h1.owns(j.lease_owner) for j in jobs)
            if killed.lease_owner != kill["owner"] and h1_back and (job := just_claimed(jobs, h2)):
                cut.update(beats=h2_beats())
                lab.cut(h2)
                cut.update(job=job.id, owner=job.lease_owner, at=now, utc=utcnow())
            return
        if "restored" not in cut:
            if "status" not in cut and now - cut["at"] >= LEASE_S + HEARTBEAT_S:  # host 2 silent by now
                cut["status"] = farm.dsocr("status", "--run", run_id).stdout
            if now - cut["at"] >= CUT_S:
                restore_h2(jobs)
            return
        watch_h2()

    def restore_h2(jobs) -> None:
        cut["beats_at_restore"] = h2_beats()
        lab.restore(h2)
        cut.update(restored=time.monotonic(), restored_utc=utcnow())
        cut["open_at_restore"] = sum(j.state not in FINAL_STATES for j in jobs)

    def watch_h2() -> None:
        # Host 2 is back when a write of its heartbeat lands in the ledger after the restore.
        if "h2_back" not in cut and h2_beats() != cut["beats_at_restore"]:
            cut["h2_back"] = time.monotonic()

    wall = farm.wait_until_final(run_id, timeout=600, tick=tick, poll=0.2)
    assert kill and cut, f"the run ended before the faults were injected (a faster machine: more jobs): {kill}, {cut}"
    if "restored" not in cut:  # host 1 finished the run during the cut: the rest of the cut all the same
        if "status" not in cut:
            time.sleep(max(0.0, cut["at"] + LEASE_S + HEARTBEAT_S - time.monotonic()))
            cut["status"] = farm.dsocr("status", "--run", run_id).stdout
        time.sleep(max(0.0, cut["at"] + CUT_S - time.monotonic()))
        restore_h2(farm.jobs(run_id))
    deadline = time.monotonic() + 120
    while "h2_back" not in cut and time.monotonic() < deadline:
        watch_h2()
        time.sleep(0.2)
    h2_log = "".join(w.log.read_text(errors="replace") for i, w in enumerate(farm.workers) if host_of[i] == h2.hostname)
    assert "h2_back" in cut, f"host 2 did not write to the ledger within 120 s of its link's restore:\n{h2_log[-5000:]}"

    tally = check_invariants(farm, run_id, max_attempts=3, drain_timeout=120)
    jobs = {j.id: j for j in farm.jobs(run_id)}
    done_by = done_by_host(farm, run_id)
    logs = {i: w.log.read_text(errors="replace") for i, w in enumerate(farm.workers)}

    def swept_by(job_id: str) -> list[str]:
        return [host_of[i] for i, text in logs.items() if f"job {job_id}: its worker stopped beating" in text]

    # The killed host's job: taken back by a heartbeat sweep at lease expiry, done on attempt 2.
    killed = jobs[kill["job"]]
    assert (killed.state, killed.attempts, killed.last_error_class) == ("done", 2, "LeaseExpired")
    kill_requeued_s = (killed.queued_at - kill["utc"]).total_seconds()
    assert LEASE_S - HEARTBEAT_S - 1 < kill_requeued_s < LEASE_S + HEARTBEAT_S + 3, kill_requeued_s

    # Host 2's job during the cut: taken back by host 1's sweep at its lease's expiry, done once, on attempt
    # 2. Host 2 finished computing it during the cut, and either its result write waited on a pooled
    # connection and landed after the restore, where the lease guard refused it ("lost"), or it needed a
    # new connection, failed at once (no route) and the task was retried ("database unavailable").
    held = jobs[cut["job"]]
    assert (held.state, held.attempts, held.last_error_class) == ("done", 2, "LeaseExpired")
    cut_requeued_s = (held.queued_at - cut["utc"]).total_seconds()
    assert LEASE_S - HEARTBEAT_S - 1 < cut_requeued_s < CUT_S, cut_requeued_s  # the lease ran out first
    assert swept_by(held.id) == [h1.hostname]
    h2_outcome = re.search(rf"job {held.id}: (lost|database unavailable)", h2_log)
    assert h2_outcome, h2_log[-5000:]

    # While cut off, host 2 reads as silent: one live worker (the new host 1), the killed one silent too.
    assert "1 live worker(s)" in cut["status"], cut["status"]
    assert tally.done == tally.jobs == tally.results == JOBS and tally.duplicates == 0
    h2_after = sorted((f - cut["restored_utc"]).total_seconds() for host, f in done_by.values()
                      if host == h2.hostname and f > cut["restored_utc"])  # fmt: skip
    assert cut["open_at_restore"] == 0 or h2_after, "host 2 did no job after its link came back"
    per_host = {h.hostname: sum(host == h.hostname for host, _ in done_by.values()) for h in lab.hosts}
    record(
        "R11 two hosts over network namespaces", hosts=2, jobs=JOBS, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S,
        cut_s=CUT_S, faults="host 1 killed whole (kill -9 of its namespace) mid-job and restarted; host 2's "
        f"link down {CUT_S} s mid-job", lost=JOBS - tally.done, duplicated=tally.duplicates,
        killed_processes=len(kill["pids"]), kill_requeued_s=round(kill_requeued_s, 1),
        kill_swept_by=swept_by(killed.id), kill_done_s=round((killed.finished_at - kill["utc"]).total_seconds(), 1),
        cut_requeued_s=round(cut_requeued_s, 1), cut_swept_by=swept_by(held.id),
        cut_job_done_s=round((held.finished_at - cut["utc"]).total_seconds(), 1),
        cut_job_host2_outcome=h2_outcome.group(1), cut_job_done_by=done_by[held.id][0],
        h2_heartbeat_back_after_restore_s=round(cut["h2_back"] - cut["restored"], 1),
        h2_first_job_after_restore_s=round(h2_after[0], 1) if h2_after else None,
        h2_heartbeat_failures_logged=h2_log.count("heartbeat of "), open_jobs_at_restore=cut["open_at_restore"],
        done_per_host=per_host, wall_s=round(wall, 1), tally=tally,
    )  # fmt: skip


def done_by_host(farm: Farm, run_id: str) -> dict[str, tuple[str, Any]]:
    """job id -> (the hostname of the process whose result was stored, the job's finish time)."""
    db = open_database(farm.database_url)
    try:
        with db.transaction() as session:
            rows = session.execute(
                select(Result.job_id, WorkerSession.host, Job.finished_at)
                .join(WorkerSession, Result.worker_session_id == WorkerSession.id)
                .join(Job, Job.id == Result.job_id)
                .where(Result.run_id == run_id)
            ).all()
    finally:
        db.dispose()
    return {job_id: (host, finished) for job_id, host, finished in rows}


# A ledger query on host 2 that waits for its reply across the cut; prints its outcome and when it ended.
WAITING_QUERY = """
import sys, time
from sqlalchemy import text
from dsocr_workers.store.db import open_database
db = open_database(sys.argv[1])
with db.transaction() as session:
    session.execute(text("SELECT 1"))
print("ready", flush=True)
try:
    with db.transaction() as session:
        session.execute(text("SELECT pg_sleep(3)"))
    print("reply", time.monotonic(), flush=True)
except Exception as exc:
    print("error", time.monotonic(), type(exc).__name__, str(exc).splitlines()[0], flush=True)
"""


@pytest.mark.slow
def test_r11_services_forget_a_cut_off_host(netns_lab: NetnsLab, tmp_path: Path, subprocess_env: dict[str, str]):
    """Half-open connections: the servers drop host 2's connections during a 30 s cut (`forgetful_services`:
    what a partition of ~15 min does at the kernel's defaults) and no reset reaches host 2. Its idle worker
    must take jobs again, and a query that waited across the cut must fail (and be retried by its caller)
    rather than wait: before the farm's TCP keepalive (farm/celery/app.py, store/db.py), the query waited
    for the OS's 2 h keepalive, and with kombu < 5.7 the idle worker never took a job again."""
    lab = netns_lab
    h2 = lab.hosts[1]
    lab.forgetful_services()
    with lab.entered():
        farm = Farm.create(
            tmp_path / "farm", lab.database_url(), subprocess_env, broker_url=lab.broker_url(),
            DSOCR_LEASE_SECONDS=str(LEASE_S), DSOCR_HEARTBEAT_SECONDS=str(HEARTBEAT_S),
        )  # fmt: skip
        query = None
        try:
            first = farm.submit(make_pages(tmp_path / "first", 2), *FAST_JOB)
            farm.start_worker(wrap=lab.host_argv(h2), **lab.host_env(h2))
            farm.wait_until_final(first, timeout=300)
            query = subprocess.Popen([*lab.host_argv(h2), sys.executable, "-c", WAITING_QUERY, lab.database_url(h2)],
                                     stdout=subprocess.PIPE, text=True, env=farm.env)  # fmt: skip
            assert query.stdout is not None and query.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the query is at the server: its reply comes during the cut
            lab.cut(h2)
            time.sleep(CUT_S)
            lab.restore(h2)
            restored = time.monotonic()
            second = farm.submit(make_pages(tmp_path / "second", 3, prefix="q"), *FAST_JOB)
            farm.wait_until_final(second, timeout=120)
            worker_back_s = time.monotonic() - restored
            # The query's outcome: within the keepalive's 45 s of silence, or never (the OS's 2 h).
            answered = io_select.select([query.stdout], [], [], max(1.0, restored + 90 - time.monotonic()))[0]
            outcome = query.stdout.readline().strip().split(maxsplit=3) if answered else ["still waiting 90 s after the restore"]
        finally:
            lab.kill_host(h2)  # the worker and the query, if it still waits
            if query is not None:
                query.wait(timeout=30)
            farm.stop()
        assert outcome[:1] == ["error"] and outcome[2:3] == ["TransientError"], outcome
        query_failed_s = float(outcome[1]) - restored
        assert query_failed_s < 60, query_failed_s
        tallies = [check_invariants(farm, run_id, max_attempts=3) for run_id in (first, second)]
        assert all(t.done == t.jobs == t.results for t in tallies)
        record(
            "R11 servers forget a cut-off host", hosts=1, cut_s=CUT_S, faults="host 2 idle, link down 30 s; "
            "the services' TCP gives up after 3 retransmissions (tcp_retries2=3)",
            lost=sum(t.jobs - t.done for t in tallies), duplicated=sum(t.duplicates for t in tallies),
            idle_worker_ran_new_run_after_restore_s=round(worker_back_s, 1),
            waiting_query_failed_after_restore_s=round(query_failed_s, 1), query_error=outcome[3],
            tally=tallies[1],
        )  # fmt: skip
