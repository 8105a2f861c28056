"""A job never opens a model (farm/job/opening.py): a claimed job whose model (or batch) is not open in
its process goes back in line without counting an attempt and is run once `prepare_for` opened it before
its next claim; a model whose opening failed fails its jobs with that error instead. The job process, the
tiny preset on the CPU and the ledger are the real ones; the jobs run as `dsocr run` and the Celery task
run them."""

from __future__ import annotations

import json
import logging

from sqlalchemy import select

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import execute_job, run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.model.deepseek_ocr.config import PRESETS
from dsocr_workers.settings import Settings
from dsocr_workers.store.models import Job, WorkerSession

OPTIONS = RunOptions(mode="tiny", max_new_tokens=4, engine="eager")


def recorded_run(database, tmp_path, make_png, options: RunOptions, images: tuple[str, ...] = ("a.png",)):
    for image in images:
        make_png(image, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(images) + "\n")
    return record_run(database, read_filelist(listing), options, queue="q", name="r")


def job_row(database, job_id: str):
    with database.transaction() as tx:
        return tx.execute(select(Job.state, Job.attempts, Job.last_error_class).where(Job.id == job_id)).one()


def test_a_job_whose_model_is_not_open_goes_back_in_line_and_runs_once_opened(database, tmp_path, make_png, caplog):
    (job_id,) = recorded_run(database, tmp_path, make_png, OPTIONS).job_ids
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        with caplog.at_level(logging.WARNING, logger="dsocr.worker"):
            outcome = execute_job(process.db, job_id, owner=process.owner, settings=settings, infer=process.infer)
        assert outcome.status == "released" and outcome.retry_in_s is not None, outcome
        assert "tiny is not open in this process" in caplog.text
        assert process.models.loaded is None  # the job's path loaded nothing
        assert job_row(database, job_id) == ("queued", 0, "NotOpen")  # no attempt counted
        with database.transaction() as tx:
            assert tx.scalars(select(WorkerSession.id)).all() == []

        assert process.prepare_for(job_id) == OPTIONS  # what the task does before the next claim
        outcome = execute_job(process.db, job_id, owner=process.owner, settings=settings, infer=process.infer)
        assert outcome.status == "done", outcome
        assert job_row(database, job_id)[:2] == ("done", 1)
    finally:
        process.close()


def test_a_model_that_failed_to_open_fails_its_job_with_that_error(database, tmp_path, make_png):
    # A directory with a family's config.json and no weights: recorded, its load raises a CheckpointError.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(PRESETS["tiny"].to_vendor()))
    broken = RunOptions(model=str(tmp_path / "empty"), mode="tiny", max_new_tokens=4, engine="eager")
    (job_id,) = recorded_run(database, tmp_path, make_png, broken).job_ids
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        assert process.prepare_for(job_id) == broken  # its opening failed, logged, before the claim
        outcome = execute_job(process.db, job_id, owner=process.owner, settings=settings, infer=process.infer)
    finally:
        process.close()
    assert outcome.status == "failed", outcome  # an InputError: final, not handed back for ever
    assert job_row(database, job_id)[0] == "failed"


def test_a_batched_job_whose_batch_is_not_open_goes_back_in_line(database, tmp_path, make_png):
    options = RunOptions(mode="tiny", max_new_tokens=4, engine="eager", concurrency=2)
    job_ids = recorded_run(database, tmp_path, make_png, options, ("a.png", "b.png")).job_ids
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        outcome = run_in_batch(process, job_ids[0], options, more_coming=False)
        assert outcome.status == "released", outcome
        assert process.batch is None and process.models.loaded is None
        assert job_row(database, job_ids[0]) == ("queued", 0, "NotOpen")
        for i, job_id in enumerate(job_ids):
            process.prepare_for(job_id)
            assert run_in_batch(process, job_id, options, more_coming=i == 0).status == "decoding"
    finally:
        process.close()
    assert [job_row(database, job_id)[0] for job_id in job_ids] == ["done", "done"]


def test_a_profiled_job_is_finished_on_its_own_thread_and_an_unprofiled_one_on_the_results_thread(
    database, tmp_path, make_png
):
    """A profiled job's trace is read and summed up before its task returns (the next job's stages would
    wait on the GIL the results thread held for it); an unprofiled job's host part stays on the results
    thread."""
    from dsocr_workers.engine.result import InferenceResult
    from dsocr_workers.engine.session import DeviceRun

    profiled = RunOptions(mode="tiny", max_new_tokens=4, engine="eager", profile_every=1)
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    held = []

    def infer(claiming):
        held.append(process.infer(claiming))
        return held[-1]

    try:
        for options, kind in ((profiled, InferenceResult), (OPTIONS, DeviceRun)):
            (job_id,) = recorded_run(database, tmp_path, make_png, options).job_ids
            process.prepare_for(job_id)
            outcome = execute_job(process.db, job_id, owner=process.owner, settings=settings, infer=infer)
            assert outcome.status == "done", outcome
            assert isinstance(held[-1].result, kind)
        assert held[0].result.profile is not None
    finally:
        process.close()
