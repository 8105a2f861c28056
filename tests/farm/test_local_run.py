"""Preparing a run from a file list (farm/submit.py `prepare_run`) and `dsocr run`'s steps around its
in-process loop (farm/local_run.py), called directly on SQLite; tests/farm/test_workers.py runs them
through `dsocr run`, tests/farm/test_interrupt.py interrupts it. The loop prefetches the next page of its
line (farm/job/prefetch.py); a run at --concurrency above 1 runs on the farm's batched engine."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from accounting import some_host_gap_is_small
from sqlalchemy import func, select

from dsocr_workers.errors import FailuresError, InputError
from dsocr_workers.farm.job.execute import Outcome
from dsocr_workers.farm.local_run import (
    FAILURES_NAMED,
    raise_for_failures,
    record_local_run,
    work_local_run,
)
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import RunRequest, prepare_run
from dsocr_workers.settings import Settings
from dsocr_workers.store.models import IN_PROCESS_QUEUE, BatchStep, Job, Result, Run


@pytest.fixture
def listing(tmp_path, make_png):
    for name in ("a.png", "b.png"):
        make_png(name, folder=tmp_path)
    path = tmp_path / "list.txt"
    path.write_text("a.png\nmissing.png\nb.png\n")
    return path


def test_bad_lines_are_described_then_the_list_is_refused(listing):
    told: list[str] = []
    with pytest.raises(InputError, match="refused, nothing was recorded"):
        prepare_run(RunRequest(listing, RunOptions()), told.append)
    assert len(told) == 1 and told[0].startswith(f"1 bad line(s) in {listing}:\n{listing}:2: missing.png: ")


def test_skip_invalid_leaves_bad_lines_out_and_a_clean_list_tells_nothing(listing):
    told: list[str] = []
    prepared = prepare_run(RunRequest(listing, RunOptions(), tags=("team=ocr",), skip_invalid=True), told.append)
    assert [image.image for image in prepared.listed.images] == ["a.png", "b.png"]
    assert prepared.tags == {"team": "ocr"} and len(told) == 1
    listing.write_text("a.png\n")
    prepare_run(RunRequest(listing, RunOptions()), told.append)
    assert len(told) == 1
    with pytest.raises(InputError, match="--tag 'team'"):
        prepare_run(RunRequest(listing, RunOptions(), tags=("team",)), told.append)


def test_record_local_run_creates_the_embedded_ledger_and_records_one_device(listing, tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'fresh.db'}")  # no file, no schema yet
    request = RunRequest(listing, RunOptions(repeats=2), name="here", skip_invalid=True)
    with pytest.raises(InputError, match="one device"):
        record_local_run(settings, request, gpus="0,1", queue=None, on_bad_lines=print)
    local = record_local_run(settings, request, gpus="cpu", queue=None, on_bad_lines=print)
    assert (local.device, local.run.queue, len(local.run.job_ids)) == ("cpu", IN_PROCESS_QUEUE, 4)
    with local.db.transaction() as session:
        run = session.get_one(Run, local.run.run_id)
        assert (run.name, run.queue) == ("here", IN_PROCESS_QUEUE)
        assert session.scalar(select(func.count()).select_from(Job).where(Job.run_id == run.id)) == 4
    named = record_local_run(settings, request, gpus="cpu", queue="gpu-farm", on_bad_lines=print)
    assert named.run.queue == "gpu-farm"
    local.db.dispose()
    named.db.dispose()


def test_raise_for_failures_counts_by_state_and_names_the_first_by_image(listing, tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'dsocr.db'}")
    request = RunRequest(listing, RunOptions(repeats=6), skip_invalid=True)  # 12 jobs
    local = record_local_run(settings, request, gpus="cpu", queue=None, on_bad_lines=print)
    done = [Outcome(job_id, "done") for job_id in local.run.job_ids]
    raise_for_failures(local, done)  # every job done: nothing to say
    failed = [Outcome(job_id, "failed" if k % 2 else "poisoned", f"E{k}") for k, job_id in enumerate(local.run.job_ids)]
    with pytest.raises(FailuresError) as raised:
        raise_for_failures(local, failed)
    message = str(raised.value)
    assert message.startswith(f"run {local.run.run_id}: 6 poisoned, 6 failed of 12 jobs: a.png: poisoned (E0); ")
    assert message.count("png: ") == FAILURES_NAMED and message.endswith(f"; and {12 - FAILURES_NAMED} more")
    local.db.dispose()


def test_the_next_page_of_the_line_is_prefetched_and_a_bad_one_fails_its_own_job(tmp_path, make_png):
    # A small page first, then a large one (its preprocessing takes many times longer), a page that cannot
    # be read (its header passes the list check), and another small one.
    for name, size in (("small.png", (320, 420)), ("large.png", (2400, 3000)), ("small2.png", (330, 420))):
        make_png(name, size, folder=tmp_path)
    broken = make_png("broken.png", (640, 480), folder=tmp_path)
    broken.write_bytes(broken.read_bytes()[:120])
    listing = tmp_path / "list.txt"
    listing.write_text("small.png\nlarge.png\nbroken.png\nsmall2.png\n")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'dsocr.db'}")
    request = RunRequest(listing, RunOptions(mode="tiny", max_new_tokens=4))
    local = record_local_run(settings, request, gpus="cpu", queue=None, on_bad_lines=print)
    finals = work_local_run(settings, local, on_final=lambda outcome: None)

    assert [o.status for o in finals] == ["done", "done", "failed", "done"]
    assert finals[2].detail.startswith("InputError: ")
    with local.db.transaction() as session:
        jobs = {j.image: j for j in session.scalars(select(Job))}
        image_of = {j.id: image for image, j in jobs.items()}
        results = {image_of[r.job_id]: r for r in session.scalars(select(Result))}
        session.expunge_all()
    local.db.dispose()
    # The bad page was prefetched while the large one ran: its own job failed with its InputError, once,
    # and the running job and the next one never noticed.
    assert (jobs["broken.png"].state, jobs["broken.png"].attempts) == ("failed", 1)
    assert jobs["broken.png"].last_error_class == "InputError"
    small, large, small2 = results["small.png"], results["large.png"], results["small2.png"]
    assert not small.prefetched and large.prefetched and small2.prefetched
    # A prefetched page was prepared while the previous job ran, ahead of its own claim (after a job that
    # failed at once, its claim may come first), and its preprocess time is its own: the large page's,
    # many times the small ones'.
    def preprocessed(r: Result) -> datetime:
        return r.device_started_at - timedelta(milliseconds=r.page_wait_ms + r.preprocess_ms)

    assert jobs["small.png"].started_at < preprocessed(large) < jobs["large.png"].started_at
    assert jobs["broken.png"].started_at < preprocessed(small2) < small2.device_started_at
    assert min(large.preprocess_ms, small2.preprocess_ms) > 0 and min(large.page_wait_ms, small2.page_wait_ms) >= 0
    assert large.preprocess_ms > 3 * max(small.preprocess_ms, small2.preprocess_ms)
    for r in (small, large, small2):
        # The accounting still adds up, the page's wait outside it; TTFT both ways.
        parts = (r.preprocess_ms + r.setup_ms + r.prefill_ms + r.first_token_ms + r.decode_ms
                 + r.wasted_decode_ms + r.readback_ms + r.postprocess_ms + r.host_gap_ms)  # fmt: skip
        assert parts == pytest.approx(r.e2e_ms, abs=1e-3) and r.host_gap_ms >= 0
        assert r.ttft_ms == pytest.approx(r.preprocess_ms + r.ttft_from_device_start_ms)
        assert 0 < r.ttft_from_device_start_ms < r.ttft_from_claim_ms
        assert r.device_started_at < r.device_finished_at
    assert some_host_gap_is_small([small, large, small2])
    # Prepared in line after its claim, the first page's TTFT from the claim holds its preprocessing.
    assert small.ttft_from_claim_ms >= small.ttft_ms
    # One device, one job at a time: each job's span ends before the next one's begins.
    assert small.device_finished_at <= large.device_started_at and large.device_finished_at <= small2.device_started_at


def test_a_run_at_concurrency_3_decodes_its_jobs_together_on_the_batched_engine(tmp_path, make_png):
    for name, size in (("a.png", (320, 420)), ("b.png", (640, 480)), ("c.png", (400, 900)), ("d.png", (500, 500))):
        make_png(name, size, folder=tmp_path)
    broken = make_png("broken.png", (640, 480), folder=tmp_path)
    broken.write_bytes(broken.read_bytes()[:120])  # its header passes the list check
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nb.png\nbroken.png\nc.png\nd.png\n")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'dsocr.db'}")
    request = RunRequest(listing, RunOptions(mode="tiny", max_new_tokens=16, concurrency=3))
    local = record_local_run(settings, request, gpus="cpu", queue=None, on_bad_lines=print)
    heard: list[Outcome] = []
    finals = work_local_run(settings, local, on_final=heard.append)

    assert heard == finals and len(finals) == 5
    with local.db.transaction() as session:
        jobs = session.scalars(select(Job)).all()
        image_of = {j.id: j.image for j in jobs}
        spans = [(j.started_at, j.finished_at) for j in jobs if j.state == "done"]
        status = {image_of[o.job_id]: o.status for o in finals}
        assert status == {"a.png": "done", "b.png": "done", "broken.png": "failed", "c.png": "done", "d.png": "done"}
        assert next(o.detail for o in finals if image_of[o.job_id] == "broken.png").startswith("InputError: ")
        results = session.scalars(select(Result)).all()
        steps = session.scalars(select(BatchStep)).all()
    local.db.dispose()
    # Decoded together: several pages a step, their results and the engine's steps written as a worker's are.
    assert len(results) == 4 and max(r.batch_occupancy for r in results) > 1
    joined = sum(step.kind in ("prefill", "join") for step in steps)  # whole, or split where others decoded
    assert joined == 4 and max(step.occupancy for step in steps) > 1
    assert sorted(start for start, _ in spans)[1] < min(end for _, end in spans)  # two claimed before one ended
