"""A Celery child's claims and results are written on its ledger thread (farm/job/ledger_threads.py): the
task does not wait for its result's write, the job keeps the time it finished, a ledger outage during
the write is waited out, and closing in an outage gives the write up without hanging; a prefetched job
runs on the device while its claim is written, waits for it before reading its output back, and a
refused claim drops what ran and records nothing. The model (tiny, CPU), the ledger (PostgreSQL, through a proxy
the test cuts) and the thread are the real ones; a write is held back by a row lock another connection
takes, as a busy database would. Last, through a real farm:
a child that dies between its task's return and its result's write loses no job."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta

import psycopg
import pytest
from faulty_dsocr import Faults
from reliability_harness import FAST_JOB, TcpProxy, check_invariants, make_pages, record
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import Ran, execute_job
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Result, utcnow

OPTIONS = RunOptions(mode="tiny", max_new_tokens=2, engine="eager")


@dataclass
class Setup:
    process: JobProcess
    settings: Settings
    proxy: TcpProxy
    job_ids: list[str]
    direct_url: str  # the ledger, not through the proxy


@pytest.fixture
def setup(postgres_url, tmp_path, make_png) -> Iterator[Setup]:
    for name in ("a.png", "b.png"):
        make_png(name, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nb.png\n")
    direct = open_database(postgres_url)
    run = record_run(direct, read_filelist(listing), OPTIONS, queue="writer")
    direct.dispose()
    proxy = TcpProxy(5432)
    proxied = make_url(postgres_url).set(port=proxy.port).render_as_string(hide_password=False)
    settings = Settings(database_url=proxied, queue="writer")
    process = JobProcess.open(settings, "cpu", queues=("writer",))
    try:
        process.models.warm(job_warmup(OPTIONS))
        yield Setup(process, settings, proxy, run.job_ids, postgres_url)
    finally:
        if not proxy.up:
            proxy.restore()
        process.close()
        proxy.cut()


class RowLock:
    """A job's row locked by another connection (not through the proxy): the writer's UPDATE waits
    until `release()`."""

    def __init__(self, url: str, job_id: str) -> None:
        self._dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._job_id = job_id
        self._conn: psycopg.Connection | None = None

    def acquire(self) -> None:
        self._conn = psycopg.connect(self._dsn)  # a transaction is open from the first statement
        # A write that waits on the lock in the caller's own thread would wait for ever: the server
        # ends this session (and the lock) after 15 s idle, so such a test fails instead of hanging.
        self._conn.execute("SET idle_in_transaction_session_timeout = '15s'")
        self._conn.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (self._job_id,))

    def release(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):  # ended by the server already
                self._conn.rollback()
            self._conn.close()
            self._conn = None


def job_state(url: str, job_id: str) -> tuple[str, object, int]:
    db = open_database(url)
    try:
        with db.transaction() as tx:
            state, finished_at = tx.execute(select(Job.state, Job.finished_at).where(Job.id == job_id)).one()
            results = tx.scalar(select(func.count()).select_from(Result).where(Result.job_id == job_id))
    finally:
        db.dispose()
    return state, finished_at, results


def run_job(s: Setup, job_id: str, lock: RowLock | None = None):
    """`execute_job` as the Celery task calls it; with `lock`, the job's row is locked once the job
    has run (after its claim committed), so its result's write waits for `lock.release()`."""

    def infer(claiming):
        ran = s.process.infer(claiming)
        if lock is not None:
            lock.acquire()
        return ran

    return execute_job(s.process.db, job_id, owner=s.process.owner, settings=s.settings, infer=infer,
                       ledger_threads=s.process.ledger_threads)  # fmt: skip


def test_the_task_returns_before_its_result_is_written_and_the_job_keeps_its_finish_time(setup):
    job_id = setup.job_ids[0]
    lock = RowLock(setup.direct_url, job_id)
    try:
        outcome = run_job(setup, job_id, lock)
        returned = utcnow()
        assert outcome.status == "completing"  # returned while the write waits on the lock
        time.sleep(0.5)
        assert job_state(setup.direct_url, job_id)[:1] == ("running",)
    finally:
        lock.release()
    assert setup.process.ledger_threads.wait() is True
    state, finished_at, results = job_state(setup.direct_url, job_id)
    assert (state, results) == ("done", 1)
    assert finished_at <= returned  # when the job finished, not when its row could be written (0.5 s later)


def test_a_ledger_outage_during_the_write_is_waited_out(setup):
    job_id = setup.job_ids[0]
    lock = RowLock(setup.direct_url, job_id)
    try:
        assert run_job(setup, job_id, lock).status == "completing"
        setup.proxy.cut()  # the writer's connection breaks; its next tries are refused
    finally:
        lock.release()
    time.sleep(3)
    assert job_state(setup.direct_url, job_id)[:1] == ("running",)
    setup.proxy.restore()
    assert setup.process.ledger_threads.wait() is True
    assert job_state(setup.direct_url, job_id)[::2] == ("done", 1)
    # The process goes on: its next job is claimed, run and written as usual.
    assert run_job(setup, setup.job_ids[1]).status == "completing"
    assert setup.process.ledger_threads.wait() is True


def test_closing_in_an_outage_gives_the_write_up_and_leaves_the_job_to_be_swept(setup):
    job_id = setup.job_ids[0]
    lock = RowLock(setup.direct_url, job_id)
    try:
        assert run_job(setup, job_id, lock).status == "completing"
        setup.proxy.cut()
    finally:
        lock.release()
    time.sleep(1)  # the first try failed; the writer waits before the next (2 s, then longer)
    closed = threading.Thread(target=setup.process.ledger_threads.close)
    closed.start()
    closed.join(timeout=30)
    assert not closed.is_alive(), "close() kept waiting for a ledger that is down"
    assert setup.process.ledger_threads.wait() is False
    # Still running under this process's lease: the sweep puts it back in line once the process is gone.
    assert job_state(setup.direct_url, job_id)[::2] == ("running", 0)


def prefetch(s: Setup, job_id: str) -> None:
    """Prepare `job_id`'s page on the prefetch thread, as while a previous job runs."""
    loaded = s.process.models.loaded
    assert loaded is not None
    s.process.prefetcher.start(lambda tx: ledger.waiting_job(tx, job_id, s.process.owner), loaded.key, loaded.session)


def released_after(lock: RowLock, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lock.release)
    timer.start()
    return timer


def test_a_prefetched_job_runs_on_the_device_while_its_claim_is_written_and_reads_back_after(setup, monkeypatch):
    job_id = setup.job_ids[0]
    prefetch(setup, job_id)
    lock = RowLock(setup.direct_url, job_id)
    lock.acquire()  # the claim's UPDATE waits on it until 0.6 s after the job's decode starts
    session = setup.process.models.loaded.session
    decode = session.decode
    at_decode: list[str] = []

    def decode_then_release(*args, **kwargs):
        at_decode.append(job_state(setup.direct_url, job_id)[0])
        released_after(lock, 0.6)  # from the decode's start, however long a loaded machine took to get there
        return decode(*args, **kwargs)

    monkeypatch.setattr(session, "decode", decode_then_release)
    outcome = run_job(setup, job_id)
    assert outcome.status == "completing"
    assert setup.process.ledger_threads.wait() is True
    db = open_database(setup.direct_url)
    try:
        with db.transaction() as tx:
            prefetched, decode_ms, host_gap_ms, tokens = tx.execute(
                select(Result.prefetched, Result.decode_ms, Result.host_gap_ms, Result.decode_tokens)
                .where(Result.job_id == job_id)
            ).one()
    finally:
        db.dispose()
    assert prefetched and tokens == OPTIONS.max_new_tokens
    assert at_decode and at_decode[0] != "running"  # the decode began before the claim was written
    # The readback waited for the claim: that wait is in the job's own time (its decode, then the gap
    # between its stages), not hidden.
    assert decode_ms + host_gap_ms > 500, (decode_ms, host_gap_ms)


def test_a_refused_claim_drops_the_job_it_overlapped_and_records_nothing(setup):
    job_id, other = setup.job_ids
    prefetch(setup, job_id)
    with setup.process.db.transaction() as tx:  # another live worker holds the job
        holder = ledger.claim_job(tx, job_id, "elsewhere:1:x", lease_s=60, max_attempts=3, is_dead=lambda owner: False)
    assert isinstance(holder, ledger.Claim)
    lock = RowLock(setup.direct_url, job_id)
    lock.acquire()
    released_after(lock, 1.0)
    outcome = run_job(setup, job_id)
    assert (outcome.status, outcome.retry_in_s is not None) == ("refused", True), outcome
    assert job_state(setup.direct_url, job_id)[::2] == ("running", 0)  # still the other worker's, no result
    # The session is whole after the dropped job: the next one runs and is written.
    assert run_job(setup, other).status == "completing"
    assert setup.process.ledger_threads.wait() is True
    assert job_state(setup.direct_url, other)[::2] == ("done", 1)


class UnfinishableRun:
    """A job's device part whose host part fails, as a bug in the engine's postprocessing would: no
    real input does it on demand."""

    def finish(self):
        raise RuntimeError("the host part failed")


def test_a_result_that_cannot_be_built_fails_its_job_instead_of_holding_it(setup):
    job_id = setup.job_ids[0]

    def infer(claiming):
        claiming.result()
        return Ran(UnfinishableRun(), setup.process.models.loaded.worker_id)  # type: ignore[arg-type, union-attr]

    outcome = execute_job(setup.process.db, job_id, owner=setup.process.owner, settings=setup.settings, infer=infer,
                          ledger_threads=setup.process.ledger_threads)  # fmt: skip
    assert outcome.status == "completing"
    assert setup.process.ledger_threads.wait() is False
    db = open_database(setup.direct_url)
    try:
        with db.transaction() as tx:
            state, error, owner = tx.execute(
                select(Job.state, Job.last_error_class, Job.lease_owner).where(Job.id == job_id)
            ).one()
    finally:
        db.dispose()
    # Final and released: a live process's heartbeat would otherwise renew its lease for good.
    assert (state, error, owner) == ("failed", "RuntimeError", None)


def test_a_result_the_ledger_refuses_for_good_lets_the_job_go_instead_of_holding_it(setup):
    # A NUL in the markup: PostgreSQL refuses it in a text column on every try (no outage to wait out).
    job_id = setup.job_ids[0]

    def infer(claiming):
        ran = setup.process.infer(claiming)
        result = ran.finished()
        return replace(ran, result=replace(result, text=result.text + "\x00"))

    outcome = execute_job(setup.process.db, job_id, owner=setup.process.owner, settings=setup.settings, infer=infer,
                          ledger_threads=setup.process.ledger_threads)  # fmt: skip
    assert outcome.status == "completing", outcome
    assert setup.process.ledger_threads.wait() is False
    heartbeat = setup.process.heartbeat
    # Its lease is renewed no more (a heartbeat keeps it `running` for good otherwise): once it runs out a
    # sweep takes the job back. A later beat of this process renews none of its leases.
    later = utcnow() + timedelta(seconds=setup.settings.lease_s + 1)
    assert heartbeat.beat(utcnow()).renewed == 0
    db = open_database(setup.direct_url)
    try:
        with db.transaction() as tx:
            swept = ledger.expire_leases(tx, max_attempts=3, now=later)
    finally:
        db.dispose()
    assert (job_id, "writer") in swept.requeued  # (the session's database may hold other tests' jobs)
    assert job_state(setup.direct_url, job_id)[::2] == ("queued", 0)


LEASE_S, HEARTBEAT_S = 15, 3


def test_a_child_killed_after_its_task_returned_but_before_its_result_was_written_loses_nothing(new_farm, tmp_path):
    """The window the writer opens: a job's message is acknowledged when its task returns, its result is
    written after. A child that dies in between (here: its result dropped, itself killed a second later)
    leaves the job running under a dead lease; a live worker's sweep puts it back in line once the lease
    has run out, and it is done on its second attempt, with one result."""
    farm = new_farm(faults=Faults(lose_result=("lost*.png",)), DSOCR_LEASE_SECONDS=str(LEASE_S),
                    DSOCR_HEARTBEAT_SECONDS=str(HEARTBEAT_S))  # fmt: skip
    pages = tmp_path / "pages"
    listing = pages / "all.txt"
    listing.parent.mkdir(parents=True)
    listing.write_text(make_pages(pages, 6).read_text() + make_pages(pages, 2, prefix="lost").read_text())
    run_id = farm.submit(listing, *FAST_JOB)
    workers = [farm.start_worker() for _ in range(2)]
    farm.wait_until_final(run_id, timeout=120 + 2 * (LEASE_S + HEARTBEAT_S))
    tally = check_invariants(farm, run_id, max_attempts=3)
    lost = [job for job in farm.jobs(run_id) if job.image.startswith("lost")]
    assert [(job.state, job.attempts, job.last_error_class) for job in lost] == [("done", 2, "LeaseExpired")] * 2
    assert tally.done == 8 and tally.results == 8
    assert all(worker.alive() for worker in workers)  # the parents replaced their killed children
    record("results written after the task returned: child killed in between", workers=2,
           faults="2 results dropped, their children killed", lost=8 - tally.done, duplicated=tally.duplicates,
           tally=tally)  # fmt: skip
