"""While a batch-1 job's setup and prefill are launched on a GPU, the ledger threads start no claim or
write (farm/job/ledger_threads.py `hold`): a claim handed over then waits for `release`, or at most
HOLD_LIMIT_S. A job with a next one known leaves them held: the next job's claim goes once that job's
prefill is queued, and this job's result row is built then; that row and the reservation its lane makes
as the next job starts are written once that claim is. On a CPU nothing is held: its launches are the
work. The ledger (SQLite and PostgreSQL), the threads, the job process and the tiny preset on the CPU are
the real ones (the job process's threads told to hold as on a GPU)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

from sqlalchemy import func, select, text

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job import ledger_threads
from dsocr_workers.farm.job.execute import execute_job
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.models import Job, Result


def test_a_claim_handed_over_during_a_hold_starts_at_its_release(database):
    threads = LedgerThreads(database)
    try:
        threads.hold()
        claim = threads.claim(lambda tx: tx.execute(text("SELECT 1")).scalar_one())
        time.sleep(0.3)
        assert not claim.done()
        threads.release()
        assert claim.result(timeout=10) == 1
    finally:
        threads.close()


def test_threads_that_do_not_hold_start_a_claim_at_once(database, monkeypatch):
    monkeypatch.setattr(ledger_threads, "HOLD_LIMIT_S", 600.0)  # held, the claim would wait that long
    threads = LedgerThreads(database, holds=False)  # a CPU process's
    try:
        threads.hold()
        claim = threads.claim(lambda tx: tx.execute(text("SELECT 1")).scalar_one())
        assert claim.result(timeout=60) == 1
    finally:
        threads.close()


def test_a_hold_never_outlasts_its_limit(database, monkeypatch):
    monkeypatch.setattr(ledger_threads, "HOLD_LIMIT_S", 0.2)
    threads = LedgerThreads(database)
    try:
        threads.hold()  # and never released: a job that died between hold and release
        began = time.monotonic()
        claim = threads.claim(lambda tx: tx.execute(text("SELECT 1")).scalar_one())
        assert claim.result(timeout=10) == 1
        assert time.monotonic() - began >= 0.2
    finally:
        threads.close()


def test_held_rows_are_built_once_claims_go_before_the_writes_are_released(database, monkeypatch):
    monkeypatch.setattr(ledger_threads, "HOLD_LIMIT_S", 60.0)  # only the gates open them
    threads = LedgerThreads(database)
    built = threading.Event()

    def rows() -> list[dict]:
        built.set()
        return []

    try:
        threads.hold()
        threads.record_steps(rows)
        time.sleep(0.3)
        assert not built.is_set()  # nothing beside the launches
        threads.let_claims_go()  # the writes stay held: the row is built beside the decode's launches
        assert built.wait(timeout=10)
    finally:
        threads.release()
        threads.close()


def test_after_a_job_with_a_next_one_the_next_claim_waits_for_its_prefill_and_the_writes_for_that_claim(
    database, tmp_path, make_png, monkeypatch
):
    monkeypatch.setattr(ledger_threads, "HOLD_LIMIT_S", 60.0)  # only the next job's launches release them
    options = RunOptions(mode="tiny", max_new_tokens=4, engine="eager")
    for image in ("a.png", "b.png", "c.png"):
        make_png(image, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nb.png\nc.png\n")
    first, second, third = record_run(database, read_filelist(listing), options, queue="q", name="r").job_ids
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    threads = process.ledger_threads
    assert not threads.holds
    threads.holds = True  # as on a GPU
    seen: dict[str, tuple[str | None, int, str | None]] = {}  # the second's state, first's results, third's reservation

    def ledger_now() -> tuple[str | None, int, str | None]:
        with database.transaction() as tx:
            results = tx.scalar(select(func.count()).select_from(Result).where(Result.job_id == first))
            return ledger.job_state(tx, second), results, reserved_by_in(tx, third)

    def seen_at(gate: str, opens: Callable[[], None]) -> Callable[[], None]:
        def counted() -> None:
            seen.setdefault(gate, ledger_now())
            opens()

        return counted

    def run(job_id: str, next_job: str | None) -> str:
        # As a Celery child runs them: the next job's page prefetched, so that it starts before its claim.
        upcoming = None if next_job is None else partial(ledger.waiting_job, job_id=next_job, owner=process.owner)
        infer = partial(process.infer, upcoming=upcoming, next_job_known=lambda: next_job is not None)
        return execute_job(process.db, job_id, owner=process.owner, settings=settings, infer=infer,
                           ledger_threads=threads).status  # fmt: skip

    try:
        process.models.warm(job_warmup(options))
        assert run(first, next_job=second) == "completing"
        # The lane fetches the message after next as the second job starts: its reservation waits too.
        reserving = threading.Thread(target=process.reserve, args=(third,))
        reserving.start()
        time.sleep(1.0)  # a result, claim or reservation let out would be written by now
        assert ledger_now() == ("pending", 0, None)
        for gate in ("let_claims_go", "release"):
            monkeypatch.setattr(threads, gate, seen_at(gate, getattr(threads, gate)))
        assert run(second, next_job=None) == "completing"
        assert threads.wait() is True
        reserving.join(timeout=30)
        assert seen["let_claims_go"] == ("pending", 0, None)  # nothing written beside the second job's launches
        assert seen["release"] == ("running", 0, None)  # its claim first, alone; the writes after it
        assert ledger_now() == ("done", 1, process.owner)
    finally:
        process.close()


def reserved_by_in(tx, job_id: str) -> str | None:
    return tx.scalar(select(Job.reserved_by).where(Job.id == job_id))


def reserved_by(database, job_id: str) -> str | None:
    with database.transaction() as tx:
        return reserved_by_in(tx, job_id)


def test_a_reservation_made_during_a_hold_is_written_at_its_release(database, tmp_path, make_png, monkeypatch):
    monkeypatch.setattr(ledger_threads, "HOLD_LIMIT_S", 60.0)
    make_png("a.png", folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\n")
    (job_id,) = record_run(database, read_filelist(listing), RunOptions(mode="tiny"), queue="q", name="r").job_ids
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    process.ledger_threads.holds = True  # as on a GPU

    try:
        process.ledger_threads.hold()  # a job's launches under way
        reserving = threading.Thread(target=process.reserve, args=(job_id,))  # as `NextMessage.follow` does
        reserving.start()
        time.sleep(1.0)
        assert reserved_by(database, job_id) is None
        process.ledger_threads.release()
        reserving.join(timeout=30)
        assert reserved_by(database, job_id) == process.owner
    finally:
        process.close()
