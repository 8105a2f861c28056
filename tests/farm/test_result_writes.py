"""Results handed to the results thread while it is busy are written together, in one transaction: a
batch's pages that finish together would otherwise take SQLite's writer lock once each while the next
pages' claims wait for it. The job process, its batched engine (the tiny preset on the CPU) and the
ledger are the real ones; another connection holds SQLite's write lock as a busy neighbour would."""

from __future__ import annotations

import contextlib
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
from dsocr_workers.store.models import BatchStep, Job

# Room for a fifth page: no claim of the four waits for a page to finish.
OPTIONS = RunOptions(mode="tiny", max_new_tokens=48, engine="eager", concurrency=5)
PAGES = ("a.png", "b.png", "c.png", "d.png")


class CountedTransactions:
    """The process's database, counting the transactions committed through it (a try that met the lock
    past SQLite's busy timeout, on a loaded machine, and was tried again counts once)."""

    def __init__(self, db) -> None:
        self.db, self.count = db, 0

    @contextlib.contextmanager
    def transaction(self):
        with self.db.transaction() as tx:
            yield tx
        self.count += 1


def test_results_finished_together_are_written_in_one_transaction(sqlite_url, tmp_path, make_png):
    for image in PAGES:
        make_png(image, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(PAGES) + "\n")
    database = open_database(sqlite_url)
    run = record_run(database, read_filelist(listing), OPTIONS, queue="q", name="r")
    process = JobProcess.open(Settings(database_url=sqlite_url, queue="q"), "cpu", queues=("q",))
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=30, isolation_level=None,
                             check_same_thread=False)  # fmt: skip
    try:
        process.models.warm(job_warmup(OPTIONS))
        process.start_batch(OPTIONS)  # before the claims, as `prepare_for` does
        counted = process.ledger_threads._db = CountedTransactions(process.ledger_threads._db)
        batch = process.batch
        # The batch's condition (re-entrant) held across the claims: the engine's thread starts no page
        # before the writer lock below is held, however loaded the machine.
        with batch._changed:
            for job_id in run.job_ids:
                assert run_in_batch(process, job_id, OPTIONS, more_coming=True).status == "decoding"
            claims = counted.count
            # The results thread's first write waits here until the engine's thread has finished all four
            # and handed its steps over (once it is idle).
            holder.execute("BEGIN IMMEDIATE")

        def release_once_all_finished() -> None:
            while batch.jobs or not batch._idle:
                time.sleep(0.01)
            holder.execute("COMMIT")

        releasing = threading.Thread(target=release_once_all_finished)
        releasing.start()
        batch.drain()  # the four finish, and the batch's steps are handed over
        releasing.join()
        assert process.ledger_threads.wait() is True
    finally:
        holder.close()
        process.close()
    # At most the first result's transaction (begun before the others were handed over), then one for
    # the other results and the steps; one each would have been five.
    assert counted.count - claims <= 2
    with database.transaction() as tx:
        states = tx.scalars(select(Job.state).where(Job.run_id == run.run_id)).all()
        steps = tx.scalars(select(BatchStep.kind).where(BatchStep.run_id == run.run_id)).all()
    database.dispose()
    assert states == ["done"] * 4 and steps.count("prefill") == 4
