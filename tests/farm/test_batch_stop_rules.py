"""Runs that differ only in how their pages stop (EOS kept or ignored, loops) share one batched engine
in a job process: the job process, its batched engine (the tiny preset on the CPU) and the ledger are the
real ones."""

from __future__ import annotations

import time
from dataclasses import replace

from sqlalchemy import select

from dsocr_workers.engine import stopping
from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Result

OPTIONS = RunOptions(mode="tiny", max_new_tokens=24, engine="eager", concurrency=2)


def test_runs_that_differ_only_in_how_pages_stop_share_one_batch(sqlite_url, tmp_path, make_png, monkeypatch):
    """A batch started for a run that stops at EOS serves a run that ignores it, without a restart: each
    job's page stops by its own run's rule. EOS here is a token the random weights produce mid-page (the
    stop rule's EOS id patched), the same page each time."""
    make_png("a.png", folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\n")
    database = open_database(sqlite_url)
    keeps = replace(OPTIONS, repeats=2)
    ignores = replace(OPTIONS, ignore_eos=True)
    kept = record_run(database, read_filelist(listing), keeps, queue="q", name="keeps")
    (ignored,) = record_run(database, read_filelist(listing), ignores, queue="q", name="ignores").job_ids
    first, second = kept.job_ids
    process = JobProcess.open(Settings(database_url=sqlite_url, queue="q"), "cpu", queues=("q",))

    def outputs() -> dict[str, tuple[list[int], str]]:
        with database.transaction() as tx:
            rows = tx.execute(select(Result.job_id, Result.token_ids, Result.stop_reason)).all()
        return {job_id: (tokens, reason) for job_id, tokens, reason in rows}

    try:
        process.models.warm(job_warmup(keeps))
        process.start_batch(keeps)
        batch = process.batch
        assert batch is not None
        assert run_in_batch(process, first, keeps, more_coming=False).status == "decoding"
        batch.drain()
        process.ledger_threads.release()
        deadline = time.monotonic() + 30
        while first not in outputs() and time.monotonic() < deadline:
            time.sleep(0.1)
        tokens, _ = outputs()[first]
        assert len(tokens) == OPTIONS.max_new_tokens
        monkeypatch.setattr(stopping, "EOS_TOKEN_ID", tokens[5])
        assert run_in_batch(process, ignored, ignores, more_coming=True).status == "decoding"
        assert run_in_batch(process, second, keeps, more_coming=False).status == "decoding"
        assert process.batch is batch  # no second engine
        batch.drain()
    finally:
        process.close()
    done = outputs()
    database.dispose()
    assert done[ignored] == (tokens, "max_new_tokens")
    assert done[second] == (tokens[: tokens.index(tokens[5]) + 1], "eos")
