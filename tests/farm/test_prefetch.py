"""A job whose page was prefetched reaches its claim without another ledger read (farm/job/prefetch.py,
farm/job/process.py): the run's model and parameters were read with the page, and every statement between
two jobs is host time the device waits through."""

from __future__ import annotations

import threading

from sqlalchemy import event

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger


def test_prepare_for_a_prefetched_job_reads_nothing_more(database, tmp_path, make_png):
    for name in ("a.png", "b.png"):
        make_png(name, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nb.png\n")
    options = RunOptions(mode="tiny", max_new_tokens=2, engine="eager")
    run = record_run(database, read_filelist(listing), options, queue="q")
    prefetched_job, other_job = run.job_ids
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        with process.db.transaction() as tx:
            waiting = ledger.waiting_job(tx, prefetched_job, process.owner)
        assert waiting is not None
        loaded = process.models.warm(job_warmup(RunOptions.from_parameters(waiting.model, waiting.parameters)))
        process.prefetcher.start(lambda tx: ledger.waiting_job(tx, prefetched_job, process.owner),
                                 loaded.key, loaded.session)  # fmt: skip

        statements: list[str] = []
        here = threading.get_ident()

        def count(_conn, _cursor, sql, *_args) -> None:  # this thread's only: the heartbeat has its own
            if threading.get_ident() == here:
                statements.append(sql)

        event.listen(process.db.engine, "before_cursor_execute", count)
        try:
            process.prepare_for(prefetched_job)
            assert statements == []
            process.prepare_for(other_job)  # no page prefetched for it: its run is read
            assert any("SELECT" in sql for sql in statements)
        finally:
            event.remove(process.db.engine, "before_cursor_execute", count)
    finally:
        process.close()
