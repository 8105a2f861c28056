"""Claim, lease, completion, failure, poison and reconcile against SQLite and PostgreSQL."""

from __future__ import annotations

import multiprocessing
import os
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, func, select, text, update

from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, SchemaError, check_schema, head_revision, open_database
from dsocr_workers.store.models import Job, Result, Run, Worker, job_id_for, utcnow

CAP = 3


def make_run(db: Database, images: int = 1, repeats: int = 1) -> tuple[str, list[str]]:
    run_id = uuid.uuid4().hex[:12]
    with db.transaction() as session:
        session.add(
            Run(
                id=run_id,
                name="t",
                filelist="list.txt",
                root="/data",
                model="tiny",
                model_label="preset:tiny (random weights)",
                random_weights=True,
                queue="q",
                parameters={"mode": "gundam"},
                tags={},
            )
        )
        session.flush()
        ids = []
        for i in range(images):
            for r in range(repeats):
                job_id = job_id_for(run_id, f"img{i}.png", r)
                session.add(
                    Job(id=job_id, run_id=run_id, image=f"img{i}.png", line=i + 1, repeat=r, state="queued")
                )
                ids.append(job_id)
    return run_id, ids


def add_worker(db: Database) -> str:
    with db.transaction() as session:
        session.merge(
            Worker(
                id="w1",
                host="h",
                device="cpu",
                torch="2",
                transformers="5",
                python="3.11",
                project_version="0.1.0",
                model_label="preset:tiny",
                random_weights=True,
            )
        )
    return "w1"


def result_row(worker_id: str, attempt: int = 1, markup: str = "text") -> dict:
    return dict(
        worker_id=worker_id,
        attempt=attempt,
        clock="perf_counter",
        preprocess_ms=1.0,
        prefill_ms=2.0,
        vision_ms=1.5,
        sam_ms=0.5,
        clip_ms=0.5,
        projector_ms=0.5,
        lm_prefill_ms=0.5,
        decode_ms=3.0,
        ttft_ms=3.5,
        e2e_ms=6.0,
        decode_step_ms=[1.0, 2.0],
        decode_ms_per_token_p50=1.5,
        decode_ms_per_token_p90=1.9,
        decode_ms_per_token_p99=2.0,
        decode_tokens=3,
        prompt_tokens=10,
        image_tokens=8,
        crop_cols=1,
        crop_rows=1,
        image_width=100,
        image_height=100,
        mode="tiny",
        stop_reason="max_new_tokens",
        peak_memory_bytes=None,
        kv_length=12,
        vision_calls=1,
        engine="eager",
        device="cpu",
        dtype="float32",
        model_label="preset:tiny",
        random_weights=True,
        markup=markup,
        token_ids=[1, 2, 3],
        boxes=[],
        box_count=0,
        skipped_spans=0,
    )


def no_owner_is_dead(owner: str) -> bool:
    """The probe of these tests unless one says otherwise: only lease expiry frees a job."""
    return False


def claim(db: Database, job_id: str, owner: str, is_dead=no_owner_is_dead, **kwargs):
    with db.transaction() as session:
        return ledger.claim_job(session, job_id, owner, lease_s=60, max_attempts=CAP, is_dead=is_dead, **kwargs)


def job(db: Database, job_id: str) -> Job:
    with db.transaction() as session:
        return session.get_one(Job, job_id)


def results_for(db: Database, job_id: str) -> int:
    with db.transaction() as session:
        return session.scalar(select(func.count()).select_from(Result).where(Result.job_id == job_id)) or 0


def test_schema_head_accepted_and_others_refused(database: Database):
    check_schema(database)
    with database.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0000'"))
    try:
        with pytest.raises(SchemaError, match=r"revision 0000.*needs " + head_revision()):
            check_schema(database)
    finally:  # the PostgreSQL database is shared by the session's tests
        with database.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :head"), {"head": head_revision()})


def test_schema_missing_refused(tmp_path):
    db = open_database(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(SchemaError, match="dsocr db upgrade"):
        check_schema(db)


def test_claim_complete_once(database: Database):
    _, (job_id,) = make_run(database)
    worker_id = add_worker(database)
    first = claim(database, job_id, "host-a:1:x")
    assert isinstance(first, ledger.Claim) and first.attempt == 1
    assert job(database, job_id).state == "running"

    # A second delivery while the first runs: refused, told when the lease ends.
    second = claim(database, job_id, "host-b:2:y")
    assert isinstance(second, ledger.Refusal) and 0 < second.retry_after_s <= 60

    with database.transaction() as session:
        assert ledger.complete_job(session, first, result_row(worker_id))
    # Delivered again after it finished: refused, still one result.
    again = claim(database, job_id, "host-b:2:y")
    assert isinstance(again, ledger.Refusal) and again.state == "done"
    assert results_for(database, job_id) == 1
    assert job(database, job_id).attempts == 1


def test_claim_of_a_job_that_submit_marks_queued_meanwhile(database: Database):
    """Submit sends a job's message, then marks it queued: a worker waiting for messages may read it
    `pending` and meet `queued` at its UPDATE. That is no concurrent claim: the job is claimed (R11 found it
    refused, its only message acknowledged, the job left queued for a reconcile)."""
    _, (job_id,) = make_run(database)
    with database.transaction() as session:
        session.execute(update(Job).where(Job.id == job_id).values(state="pending"))

    def mark_queued_in_between(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("UPDATE JOBS") and not marked:
            marked.append(True)  # what `ledger.mark_queued` does, between the claim's read and its write
            cursor.execute(f"UPDATE jobs SET state = 'queued' WHERE id = '{job_id}' AND state = 'pending'")

    marked: list[bool] = []
    event.listen(database.engine, "before_cursor_execute", mark_queued_in_between)
    try:
        got = claim(database, job_id, "host-a:1:x")
    finally:
        event.remove(database.engine, "before_cursor_execute", mark_queued_in_between)
    assert marked and isinstance(got, ledger.Claim) and got.attempt == 1, got
    assert (job(database, job_id).state, job(database, job_id).lease_owner) == ("running", "host-a:1:x")


def test_a_job_claimed_before_submit_marks_its_batch_still_gets_its_queued_time(database: Database):
    """Submit sends every message, then marks the batch queued; a waiting worker may claim the first job
    in between. It stays running, and gets the queued time all the same: throughput measures its wait
    from min(queued, claim), from the row's creation when queued_at is missing."""
    _, ids = make_run(database, images=2)
    with database.transaction() as session:
        session.execute(update(Job).where(Job.id.in_(ids)).values(state="pending", queued_at=None))
    assert isinstance(claim(database, ids[0], "host-a:1:x"), ledger.Claim)
    with database.transaction() as session:
        ledger.mark_queued(session, ids)
    claimed, waiting = job(database, ids[0]), job(database, ids[1])
    assert (claimed.state, waiting.state) == ("running", "queued")
    assert claimed.queued_at is not None and claimed.queued_at == waiting.queued_at >= claimed.started_at


def test_expired_lease_taken_over_and_old_owner_cannot_write(database: Database):
    _, (job_id,) = make_run(database)
    worker_id = add_worker(database)
    first = claim(database, job_id, "host-a:1:x")
    later = utcnow() + timedelta(seconds=120)
    second = claim(database, job_id, "host-b:2:y", now=later)
    assert isinstance(second, ledger.Claim) and second.attempt == 2
    assert job(database, job_id).last_error_class == "WorkerLost"

    with database.transaction() as session:
        assert not ledger.complete_job(session, first, result_row(worker_id, markup="stale"))
    with database.transaction() as session:
        assert ledger.fail_job(session, first, RuntimeError("late"), final=False, max_attempts=CAP) is None
        assert ledger.complete_job(session, second, result_row(worker_id, attempt=2))
    with database.transaction() as session:
        (markup,) = session.execute(select(Result.markup).where(Result.job_id == job_id)).one()
    assert markup == "text"


@pytest.mark.postgres
def test_a_delivery_that_meets_a_sweeps_requeue_mid_claim_takes_the_job(postgres_url):
    """A sweep sends a taken-back job's message before it commits: the delivery reads the job still
    running under the dead owner, and its UPDATE waits on the sweep's row lock, then finds it queued.
    Nobody else claimed it; this delivery is its only message and claims it (R5 in CI, before: refused)."""
    db = open_database(postgres_url)
    try:
        _, (job_id,) = make_run(db)
        claim(db, job_id, "h:1:dead")
        later = utcnow() + timedelta(seconds=61)
        claimed: list[ledger.Claim | ledger.Refusal] = []
        with db.transaction() as sweep:
            taken = ledger.expire_leases(sweep, max_attempts=CAP, now=later, queues=["q"])
            assert taken.requeued == [(job_id, "q")]
            delivery = threading.Thread(target=lambda: claimed.append(claim(db, job_id, "h:2:live", now=later)))
            delivery.start()
            delivery.join(timeout=2)
            assert delivery.is_alive()  # its UPDATE waits for the sweep's commit
        delivery.join(timeout=30)
        (result,) = claimed
        assert isinstance(result, ledger.Claim) and result.attempt == 2 and result.owner == "h:2:live"
        assert job(db, job_id).state == "running"
    finally:
        db.dispose()


def test_an_owner_the_probe_finds_dead_is_taken_over_at_once(database: Database):
    _, (job_id,) = make_run(database)
    assert isinstance(claim(database, job_id, "h:1:dead"), ledger.Claim)
    taken = claim(database, job_id, "h:2:x", is_dead=lambda owner: owner == "h:1:dead")
    assert isinstance(taken, ledger.Claim) and taken.attempt == 2
    assert job(database, job_id).last_error_class == "WorkerLost"
    # The new owner is alive to the same probe: its lease holds.
    refused = claim(database, job_id, "h:3:x", is_dead=lambda owner: owner == "h:1:dead")
    assert isinstance(refused, ledger.Refusal) and refused.retry_after_s is not None


def test_attempt_cap_poisons(database: Database):
    _, (job_id,) = make_run(database)
    for attempt in range(1, CAP + 1):
        got = claim(
            database,
            job_id,
            f"h:{attempt}:x",
            now=utcnow() + timedelta(minutes=2 * attempt),
        )
        assert isinstance(got, ledger.Claim) and got.attempt == attempt
    refused = claim(database, job_id, "h:99:x", now=utcnow() + timedelta(hours=1))
    assert isinstance(refused, ledger.Refusal) and refused.state == "poisoned"
    row = job(database, job_id)
    assert (row.state, row.attempts, row.last_error_class) == ("poisoned", CAP, "WorkerLost")


def test_failures_input_final_others_until_cap(database: Database):
    _, (input_job, crash_job) = make_run(database, images=2)
    got = claim(database, input_job, "h:1:x")
    with database.transaction() as session:
        assert (
            ledger.fail_job(session, got, ValueError("not an image"), final=True, max_attempts=CAP)
            == "failed"
        )
    assert isinstance(claim(database, input_job, "h:1:x"), ledger.Refusal)

    states = []
    for _ in range(CAP):
        got = claim(database, crash_job, "h:1:x")
        with database.transaction() as session:
            states.append(ledger.fail_job(session, got, RuntimeError("boom"), final=False, max_attempts=CAP))
    assert states == ["queued"] * (CAP - 1) + ["poisoned"]
    row = job(database, crash_job)
    assert (row.attempts, row.last_error_class, row.last_error_message) == (CAP, "RuntimeError", "boom")


def test_release_does_not_count_an_attempt(database: Database):
    _, (job_id,) = make_run(database)
    got = claim(database, job_id, "h:1:x")
    with database.transaction() as session:
        assert ledger.release_job(session, got, ConnectionError("db down"))
    row = job(database, job_id)
    assert (row.state, row.attempts) == ("queued", 0)


def test_reconcile_expires_leases_and_lists_open_jobs(database: Database):
    run_id, ids = make_run(database, images=4)
    other_run, other_ids = make_run(database, images=1)
    claim(database, ids[0], "h:1:x")  # stays live
    claim(database, ids[1], "h:2:x")  # will expire
    with database.transaction() as session:
        session.execute(text("UPDATE jobs SET attempts = :cap WHERE id = :id"), {"cap": CAP, "id": ids[2]})
        session.execute(
            text("UPDATE jobs SET state = 'running', lease_expires_at = :t WHERE id = :id"),
            {"t": utcnow() - timedelta(seconds=1), "id": ids[2]},
        )
        session.execute(
            text("UPDATE jobs SET lease_expires_at = :t WHERE id = :id"),
            {"t": utcnow() - timedelta(seconds=1), "id": ids[1]},
        )
    with database.transaction() as session:
        plan = ledger.reconcile(session, max_attempts=CAP, run_id=run_id)
    assert (plan.expired, plan.poisoned, plan.running) == (2, 1, 1)
    assert sorted(job_id for job_id, _ in plan.requeue) == sorted([ids[1], ids[3]])
    assert job(database, ids[2]).state == "poisoned"
    assert job(database, ids[1]).last_error_class == "LeaseExpired"
    with database.transaction() as session:
        everything = ledger.reconcile(session, max_attempts=CAP)
        assert ledger.job_counts(session, run_id) == {"queued": 2, "running": 1, "poisoned": 1}
    assert {job_id for job_id, _ in everything.requeue} == {ids[1], ids[3], *other_ids}
    assert other_run


def test_a_reservation_names_the_next_job_holds_nothing_back_and_a_sweep_takes_it_from_the_dead(database: Database):
    _, ids = make_run(database, images=4)

    def reserved() -> dict[str, str | None]:
        return {job_id: job(database, job_id).reserved_by for job_id in ids}

    with database.transaction() as session:  # a process may hold several: fetched before the last is claimed
        for job_id, owner in zip(ids, ("h:1:me", "h:1:me", "h:2:dead", "h:3:other"), strict=True):
            ledger.reserve_job(session, job_id, owner, lease_s=60)
    assert reserved() == {ids[0]: "h:1:me", ids[1]: "h:1:me", ids[2]: "h:2:dead", ids[3]: "h:3:other"}
    # A claim by another process ignores the reservation and clears it; a running job is not reserved.
    claim(database, ids[1], "h:3:other")
    claim(database, ids[3], "h:3:other")
    with database.transaction() as session:
        ledger.reserve_job(session, ids[1], "h:1:me", lease_s=60)
    assert reserved() == {ids[0]: "h:1:me", ids[1]: None, ids[2]: "h:2:dead", ids[3]: None}
    # Only a reservation whose process stopped beating runs out: the sweep hands its job back, once.
    after_lease = utcnow() + timedelta(seconds=61)
    with database.transaction() as session:
        ledger.renew_leases(session, "h:1:me", 60, now=after_lease)
        ledger.renew_leases(session, "h:3:other", 60, now=after_lease)
    with database.transaction() as session:
        first = ledger.expire_leases(session, max_attempts=CAP, now=after_lease, queues=["q"])
    with database.transaction() as session:
        second = ledger.expire_leases(session, max_attempts=CAP, now=after_lease, queues=["q"])
    assert first == ledger.ExpiredLeases([], [], [(ids[2], "q")]) and first.to_bring_back == [(ids[2], "q")]
    assert second == ledger.ExpiredLeases([], [])
    assert reserved() == {ids[0]: "h:1:me", ids[1]: None, ids[2]: None, ids[3]: None}
    assert (job(database, ids[2]).state, job(database, ids[2]).attempts) == ("queued", 0)  # nothing else changed
    with database.transaction() as session:  # a clean stop gives its reservations up
        ledger.drop_reservations(session, "h:1:me")
        assert ledger.waiting_job(session, ids[1], "h:1:me") is None  # another's
        assert ledger.waiting_job(session, ids[1], "h:3:other").job_id == ids[1]  # claimed by the reader
        waiting = ledger.waiting_job(session, ids[0], "h:1:me")
    assert waiting == ledger.WaitingJob(ids[0], Path("/data/img0.png"), "tiny", {"mode": "gundam"})
    assert reserved() == dict.fromkeys(ids)


def test_a_reservation_runs_out_with_its_holders_lease_so_one_sweep_brings_both_back(database: Database):
    """The job a process fetched next, reserved after its claim (a moment past its last beat), comes back in
    the sweep that takes back its running job: the two go to the head of the queue together."""
    _, (running, fetched, later) = make_run(database, images=3)
    claimed_at = utcnow()
    claim(database, running, "h:1:dead", now=claimed_at)
    with database.transaction() as session:
        ledger.reserve_job(session, fetched, "h:1:dead", lease_s=60, now=claimed_at + timedelta(seconds=1))
        ledger.reserve_job(session, later, "h:2:idle", lease_s=60, now=claimed_at + timedelta(seconds=1))
    assert job(database, fetched).reserved_until == job(database, running).lease_expires_at
    with database.transaction() as session:
        swept = ledger.expire_leases(session, max_attempts=CAP, now=claimed_at + timedelta(seconds=60.5))
    assert swept == ledger.ExpiredLeases([(running, "q")], [], [(fetched, "q")])
    assert job(database, later).reserved_by == "h:2:idle"  # it holds no lease: lease_s from its reservation


def _claim_everything(url: str, job_ids: list[str], worker_id: str) -> int:
    db = open_database(url)
    owner = f"h:{os.getpid()}:x"
    done = 0
    for job_id in job_ids:
        with db.transaction() as session:
            got = ledger.claim_job(session, job_id, owner, lease_s=60, max_attempts=CAP, is_dead=no_owner_is_dead)
        if isinstance(got, ledger.Claim):
            with db.transaction() as session:
                done += ledger.complete_job(session, got, result_row(worker_id))
    return done


def test_sqlite_three_concurrent_writers_never_locked(sqlite_url):
    db = open_database(sqlite_url)
    _, ids = make_run(db, images=40)
    worker_id = add_worker(db)
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        done = pool.starmap(_claim_everything, [(sqlite_url, ids, worker_id)] * 3)
    assert sum(done) == len(ids)
    with db.transaction() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == len(ids)


def test_heartbeat_renews_only_its_own_leases(database: Database):
    _, ids = make_run(database, images=2)
    mine, other = claim(database, ids[0], "h:1:a"), claim(database, ids[1], "h:2:b")
    later = utcnow() + timedelta(seconds=50)
    with database.transaction() as session:
        assert ledger.renew_leases(session, "h:1:a", 60, now=later) == 1
    assert job(database, ids[0]).lease_expires_at == later + timedelta(seconds=60)
    assert job(database, ids[1]).lease_expires_at == other.lease_expires_at
    assert job(database, ids[0]).lease_expires_at > mine.lease_expires_at


def test_sweep_takes_back_expired_jobs_once_spares_its_own_and_poisons_at_the_cap(database: Database):
    run_id, ids = make_run(database, images=4)
    for i, owner in enumerate(("h:1:dead", "h:2:dead", "h:3:sweeper", "h:4:live")):
        claim(database, ids[i], owner)
    with database.transaction() as session:
        session.execute(text("UPDATE jobs SET attempts = :cap WHERE id = :id"), {"cap": CAP, "id": ids[1]})
    after_lease = utcnow() + timedelta(seconds=61)
    with database.transaction() as session:  # the live holder beat in time; the others did not
        ledger.renew_leases(session, "h:4:live", 60, now=after_lease)

    def sweep(queues):
        with database.transaction() as session:
            return ledger.expire_leases(
                session, max_attempts=CAP, now=after_lease, queues=queues, spare_owner="h:3:sweeper"
            )

    assert sweep(["another-queue"]) == ledger.ExpiredLeases([], [])
    first, second = sweep(["q"]), sweep(["q"])
    assert first == ledger.ExpiredLeases([(ids[0], "q")], [ids[1]])
    assert second == ledger.ExpiredLeases([], [])  # a second sweeper finds nothing left to send
    states = {i: job(database, i) for i in ids}
    assert (states[ids[0]].state, states[ids[0]].lease_owner, states[ids[0]].queued_at) == ("queued", None, after_lease)
    assert states[ids[0]].last_error_class == "LeaseExpired" and "h:1:dead" in states[ids[0]].last_error_message
    assert states[ids[1]].state == "poisoned"
    assert states[ids[2]].state == states[ids[3]].state == "running"  # the sweeper's own job; a live one
    with database.transaction() as session:
        assert ledger.job_counts(session, run_id) == {"queued": 1, "poisoned": 1, "running": 2}
