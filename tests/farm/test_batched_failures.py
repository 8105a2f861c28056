"""A batched job whose result cannot be built (its postprocess raises once the engine finished it) fails
alone, as on the batch-1 path: the jobs finishing beside it are written, the batch goes on, and the job is
queued again with its attempt counted. The job process, its batched engine (the tiny preset on the CPU)
and the ledger are the real ones; the tasks are called as the Celery task calls them."""

from __future__ import annotations

from sqlalchemy import select

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.model import postprocess
from dsocr_workers.settings import Settings
from dsocr_workers.store.models import Job

OPTIONS = RunOptions(mode="tiny", max_new_tokens=6, engine="eager", concurrency=3)
PAGES = {"a.png": (320, 420), "b.png": (640, 480), "c.png": (400, 900)}


def test_a_batched_job_whose_result_cannot_be_built_fails_alone(database, tmp_path, make_png, monkeypatch):
    for image, size in PAGES.items():
        make_png(image, size, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(PAGES) + "\n")
    run = record_run(database, read_filelist(listing), OPTIONS, queue="q", name="r")
    parse = postprocess.parse_markup
    calls: list[int] = []

    def first_one_breaks(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a markup the parser cannot take")
        return parse(*args, **kwargs)

    url = database.engine.url.render_as_string(hide_password=False)
    process = JobProcess.open(Settings(database_url=url, queue="q"), "cpu", queues=("q",))
    try:
        process.models.warm(job_warmup(OPTIONS))
        process.start_batch(OPTIONS)  # before the claims, as `prepare_for` does
        monkeypatch.setattr(postprocess, "parse_markup", first_one_breaks)  # after the warm-up's pages
        for i, job_id in enumerate(run.job_ids):
            outcome = run_in_batch(process, job_id, OPTIONS, more_coming=i < len(run.job_ids) - 1)
            assert outcome.status == "decoding", outcome
        assert process.batch is not None and not process.batch.jobs  # the batch went on and drained
    finally:
        process.close()
    with database.transaction() as tx:
        jobs = tx.execute(select(Job.state, Job.attempts, Job.last_error_class, Job.lease_owner)
                          .where(Job.run_id == run.run_id)).all()  # fmt: skip
    assert len(calls) == 3
    assert sorted(j.state for j in jobs) == ["done", "done", "queued"]
    failed = next(j for j in jobs if j.state == "queued")
    assert (failed.attempts, failed.last_error_class, failed.lease_owner) == (1, "ValueError", None)
