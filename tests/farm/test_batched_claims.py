"""The batch decodes while a task waits for its claim: on SQLite a claim waits its turn at the writer's
lock behind the other workers' writes, and a task that stepped the engine itself left the batch's pages
idle meanwhile. The job process, its batched engine (the tiny preset on the CPU, on the engine's own
thread) and the ledger are the real ones; another connection holds SQLite's write lock as a busy
neighbour would."""

from __future__ import annotations

import sqlite3
import threading
import time

from sqlalchemy import select

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job

OPTIONS = RunOptions(mode="tiny", max_new_tokens=24, engine="eager", concurrency=3)
HELD_S = 1.0  # the lock is held this long after the first job left the batch
LEFT_WITHIN_S = 20.0  # under the ledger's busy timeout (30 s), which the waiting claim must not reach


def test_the_batch_decodes_while_a_claim_waits_for_the_ledger(sqlite_url, tmp_path, make_png):
    for image in ("a.png", "b.png"):
        make_png(image, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nb.png\n")
    database = open_database(sqlite_url)
    run = record_run(database, read_filelist(listing), OPTIONS, queue="q", name="r")
    first, second = run.job_ids
    process = JobProcess.open(Settings(database_url=sqlite_url, queue="q"), "cpu", queues=("q",))
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=30, isolation_level=None,
                             check_same_thread=False)
    try:
        process.models.warm(job_warmup(OPTIONS))
        process.start_batch(OPTIONS)  # before the claims, as `prepare_for` does
        assert run_in_batch(process, first, OPTIONS, more_coming=True).status == "decoding"
        batch = process.batch
        assert batch is not None and first in batch.jobs  # 24 tokens to decode on the engine's thread
        holding, seen = threading.Event(), {}

        def hold_the_write_lock() -> None:
            # Held until the first job has left the batch (however slow the machine), then a moment more.
            holder.execute("BEGIN IMMEDIATE")
            holding.set()
            deadline = time.monotonic() + LEFT_WITHIN_S
            while first in batch.jobs and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["first_left_while_held"] = first not in batch.jobs
            time.sleep(HELD_S)
            holder.execute("COMMIT")

        neighbour = threading.Thread(target=hold_the_write_lock)
        neighbour.start()
        assert holding.wait(timeout=30)
        began = time.perf_counter()
        assert run_in_batch(process, second, OPTIONS, more_coming=True).status == "decoding"
        waited_s = time.perf_counter() - began
        neighbour.join()
        assert waited_s >= HELD_S * 0.9  # the claim did wait for the lock
        # Meanwhile the batch went on: the first job decoded its tokens and left.
        assert seen["first_left_while_held"] and second in batch.jobs
        batch.drain()
    finally:
        holder.close()
        process.close()
    with database.transaction() as tx:
        states = tx.scalars(select(Job.state).where(Job.run_id == run.run_id)).all()
    database.dispose()
    assert sorted(states) == ["done", "done"]
