"""A run at `--concurrency 3` (farm/job/batched.py): `kill -9` of the whole worker while several of the
run's jobs are in flight in its batched engine. Their messages were acknowledged when their tasks
returned; the ledger brings them back: a live worker's sweep finds their leases expired and puts them
back on the queue (farm/liveness.py), and it finishes every job, none twice."""

from __future__ import annotations

from reliability_harness import SECOND_JOB, SWEEP_MARGIN_S, check_invariants, make_pages, owner_pid, record

from dsocr_workers.farm.liveness import orphaned_after_s

LEASE_S, HEARTBEAT_S = 15, 3


def test_a_batched_worker_killed_with_jobs_in_flight_loses_none(new_farm, tmp_path):
    farm = new_farm(DSOCR_LEASE_SECONDS=str(LEASE_S), DSOCR_HEARTBEAT_SECONDS=str(HEARTBEAT_S))
    jobs = 9
    listing = make_pages(tmp_path / "pages", jobs)
    run_id = farm.submit(listing, *SECOND_JOB, "--concurrency", "3")
    first = farm.start_worker()
    in_flight: list[str] = []  # the jobs running in the killed worker's child when it was killed

    def kill_with_jobs_in_flight(current) -> None:
        if in_flight:
            return
        children = first.child_pids()
        held = [job.id for job in current if job.state == "running" and owner_pid(job.lease_owner) in children]
        if len(held) >= 2:
            first.kill_all()
            in_flight.extend(held)
            farm.start_worker()

    # A next message the lane fetched in the milliseconds before the kill, not yet reserved, comes back once
    # it counts as orphaned (docs/reliability.md), at a sweep. The batch runs 3 attempts at once.
    settings = farm.settings()
    orphan_s = orphaned_after_s(settings) + settings.heartbeat_s + SWEEP_MARGIN_S
    budget = farm.run_budget_s(attempts=jobs + 3, workers=3, starts=2, waits_s=orphan_s)
    wall = farm.wait_until_final(run_id, timeout=budget, tick=kill_with_jobs_in_flight, poll=0.1)
    tally = check_invariants(farm, run_id, max_attempts=3, drain_timeout=90)
    assert len(in_flight) >= 2
    by_id = {job.id: job for job in farm.jobs(run_id)}
    for job_id in in_flight:
        job = by_id[job_id]
        assert job.state == "done" and job.attempts == 2, (job.image, job.state, job.attempts)
        assert job.last_error_class == "LeaseExpired", job.last_error_message
    assert tally.done == jobs and tally.results == jobs and tally.duplicates == 0
    record("kill -9 of a batched worker (concurrency 3)", workers=2, in_flight_at_kill=len(in_flight),
           lost=jobs - tally.done, duplicated=tally.duplicates, wall_s=round(wall, 1), tally=tally)  # fmt: skip


def test_a_batch_that_fails_puts_every_job_in_flight_back_in_line(new_farm, tmp_path):
    # Jobs of ~7 s under a 3 s soft time limit: the task that fills the batch waits for room and meets the
    # limit while it waits, which fails every job in flight (an attempt each). Their messages
    # were acknowledged when their tasks returned: the worker sends new ones, and each job comes back
    # until the attempt cap poisons it. Before, the ledger said `queued` and no message existed.
    farm = new_farm(DSOCR_SOFT_TIME_LIMIT="3", DSOCR_HARD_TIME_LIMIT="20")
    jobs = 3
    listing = make_pages(tmp_path / "pages", jobs)
    run_id = farm.submit(listing, "--mode", "tiny", "--max-new-tokens", "2000", "--ignore-eos", "--concurrency", "3")
    farm.start_worker()
    # Three attempts of each job, the batch's three at once, and a retry's backoff between two.
    backoff_s = 2 * farm.settings().retry_backoff_max_s
    farm.wait_until_final(run_id, timeout=farm.run_budget_s(attempts=3 * jobs, workers=3, waits_s=backoff_s))
    tally = check_invariants(farm, run_id, max_attempts=3)
    assert tally.poisoned == jobs, tally
    for job in farm.jobs(run_id):
        assert job.attempts == 3 and job.last_error_class == "SoftTimeLimitExceeded", (job.image, job.last_error_class)
    assert "the batched engine failed" in farm.logs()
