"""A run at `--concurrency` above 1 stores its batched engine's steps (`batch_steps`, farm/job/batched.py),
written on the child's results thread a few hundred at a time, and its report sums them up in the Batch
steps table. The job process, its batched engine (the tiny preset on the CPU), its ledger threads and the
ledger (SQLite and PostgreSQL) are the real ones; the tasks are called as the Celery task calls them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import event, select

from dsocr_workers.cli import main
from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job import batch_steps
from dsocr_workers.farm.job.execute import run_in_batch
from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import job_warmup
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store.models import BatchStep, Job, Result

CONCURRENCY = 3
OPTIONS = RunOptions(mode="tiny", max_new_tokens=6, engine="eager", concurrency=CONCURRENCY)
# Two runs with the same settings share the worker's batch: A's three pages and B's two join it in turns.
PAGES_A = {"a.png": (320, 420), "b.png": (640, 480), "c.png": (400, 900)}
PAGES_B = {"d.png": (500, 500), "e.png": (420, 320)}
STEPS_PER_WRITE = 8  # a few hand-overs to the results thread in a run this short


def report_json(url: str, args: list[str], monkeypatch) -> dict:
    monkeypatch.setenv("DSOCR_DATABASE_URL", url)
    result = CliRunner().invoke(main, ["report", *args, "--format", "json", "--table", "Batch steps"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_batched_run_stores_each_engine_step_once_per_run_it_served_and_reports_them(
    database, tmp_path, make_png, monkeypatch
):  # fmt: skip
    monkeypatch.setattr(batch_steps, "STEPS_PER_WRITE", STEPS_PER_WRITE)
    runs = {}
    for name, pages in (("a", PAGES_A), ("b", PAGES_B)):
        for image, size in pages.items():
            make_png(image, size, folder=tmp_path / name)
        listing = tmp_path / name / "list.txt"
        listing.write_text("\n".join(pages) + "\n")
        runs[name] = record_run(database, read_filelist(listing), OPTIONS, queue="q", name=name)
    a, b = runs["a"].job_ids, runs["b"].job_ids
    order = [a[0], a[1], b[0], a[2], b[1]]
    url = database.engine.url.render_as_string(hide_password=False)
    process = JobProcess.open(Settings(database_url=url, queue="q"), "cpu", queues=("q",))
    inserts: list[str] = []  # statements inserting into batch_steps, on any thread

    def count(_conn, _cursor, sql, *_args) -> None:
        if sql.startswith("INSERT INTO batch_steps"):
            inserts.append(sql)

    event.listen(process.db.engine, "before_cursor_execute", count)
    try:
        process.models.warm(job_warmup(OPTIONS))
        process.start_batch(OPTIONS)  # before the claims, as `prepare_for` does
        for i, job_id in enumerate(order):
            outcome = run_in_batch(process, job_id, OPTIONS, more_coming=i < len(order) - 1)
            assert outcome.status == "decoding", outcome
            assert process.batch is not None and process.batch.engine.steps == []  # taken after every step
    finally:
        process.close()  # the results thread writes what it was handed before it stops
    columns = [getattr(BatchStep, c.name) for c in BatchStep.__table__.columns]
    with database.transaction() as tx:
        steps = tx.execute(select(*columns)).all()
        jobs = {j.id: j for j in tx.execute(select(Job.id, Job.state, Job.started_at, Job.finished_at))}
        sessions = set(tx.scalars(select(Result.worker_session_id)))
    assert {j.state for j in jobs.values()} == {"done"}
    # Handed over in batches (each but the last of STEPS_PER_WRITE rows or more), one insert each.
    assert 2 <= len(inserts) <= len(steps) // STEPS_PER_WRITE + 1
    by_run = {name: [s for s in steps if s.run_id == runs[name].run_id] for name in runs}
    for name, job_ids in (("a", a), ("b", b)):
        joining = [s for s in by_run[name] if s.kind in ("prefill", "join")]
        sam = [s for s in by_run[name] if s.kind == "sam"]
        decode = [s for s in by_run[name] if s.kind == "decode"]
        # A page joining: one whole prefill, or a sam and a join step (split while others decoded).
        assert len(joining) == len(job_ids) and len(sam) == sum(s.kind == "join" for s in joining)
        assert all(s.occupancy == s.bucket == 1 and s.prompt_tokens > 0 and s.vision_ms > 0 for s in joining)
        assert all(s.occupancy == s.prompt_tokens == 0 and s.vision_ms > 0 for s in sam)
        # 5 decode steps after each page's first token; pages decoding together share them.
        assert 5 <= len(decode) <= 5 * len(job_ids)
        assert all(1 <= s.occupancy <= s.bucket <= CONCURRENCY for s in decode)
        assert all(s.prompt_tokens is None and s.vision_ms is None for s in decode)
        assert all(s.occupancy <= s.kv_longest <= s.kv_positions for s in decode)
        assert all(s.kv_positions is None and s.kv_longest is None for s in joining + sam)
        assert max(s.occupancy for s in decode) > 1
        assert len({s.step_index for s in by_run[name]}) == len(by_run[name])  # each step once per run
        # On the wall clock between the run's first claim and its last finish.
        claimed = min(jobs[j].started_at for j in job_ids) - timedelta(milliseconds=50)
        finished = max(jobs[j].finished_at for j in job_ids) + timedelta(milliseconds=50)
        assert all(claimed <= s.started_at <= finished and s.duration_ms > 0 for s in by_run[name]), name
    assert {s.worker_session_id for s in steps} == sessions and len(sessions) == 1
    # The engine's every step is some run's: B's pages decoded beside A's, and steps serving both are in both.
    indices = {name: {s.step_index for s in by_run[name]} for name in runs}
    every = indices["a"] | indices["b"]
    assert indices["a"] & indices["b"] and every == set(range(max(every) + 1))

    rows = report_json(url, ["--run", runs["a"].run_id], monkeypatch)["tables"]["Batch steps"]
    table = {row["measure"]: row["value"] for row in rows}
    decode_a = [s for s in by_run["a"] if s.kind == "decode"]
    split_a = sum(s.kind == "join" for s in by_run["a"])
    assert table["prefill steps (a page joining whole)"] + table["split prefills (a page joining in a sam and a join step)"] == 3
    assert table["split prefills (a page joining in a sam and a join step)"] == split_a
    assert table["decode steps"] == len(decode_a)
    prefills_a = [s.duration_ms for s in by_run["a"] if s.kind != "decode"]
    assert table["mean prefill step ms"] == pytest.approx(sum(prefills_a) / len(prefills_a), rel=1e-4)
    assert min(prefills_a) <= table["p50 prefill step ms"] <= table["p90 prefill step ms"] <= max(prefills_a)
    mean_occupancy = sum(s.occupancy for s in decode_a) / len(decode_a)
    assert table["mean occupancy (pages per decode step)"] == pytest.approx(mean_occupancy, rel=1e-4)
    bands = {measure for measure in table if measure.startswith("occupancy ")}
    assert "occupancy 2-7: p50 decode step ms" in bands and not any("8-31" in measure for measure in bands)
    assert sum(v for measure, v in table.items() if measure.endswith(": decode steps")) == len(decode_a)
    band_2_7 = [s for s in decode_a if 2 <= s.occupancy <= 7]
    kv_per_page = sum(s.kv_positions for s in band_2_7) / sum(s.occupancy for s in band_2_7)
    assert table["occupancy 2-7: KV positions a page's attention read, mean"] == pytest.approx(kv_per_page, rel=1e-4)
    longest = sum(s.kv_longest for s in band_2_7) / len(band_2_7)
    assert table["occupancy 2-7: the longest page's KV positions, mean"] == pytest.approx(longest, rel=1e-4)
    device_s = sum(s.duration_ms for s in by_run["a"]) / 1e3
    assert table["device time in steps s"] == pytest.approx(device_s, rel=1e-4)
    assert 0 < table["prefill share of the time in steps %"] < 100
    assert 0 < table["time in steps per GPU, % of the wall span"] <= 100
    pairs = report_json(url, ["--run", runs["a"].run_id, "--vs", runs["b"].run_id], monkeypatch)
    pair = {row["measure"]: (row["A"], row["B"]) for row in pairs["tables"]["Batch steps"]}
    whole, split = pair["prefill steps (a page joining whole)"], pair["split prefills (a page joining in a sam and a join step)"]
    assert (whole[0] + split[0], whole[1] + split[1]) == (3, 2)


def test_a_sampled_steps_profile_is_collected_on_the_engines_thread(database, tmp_path, make_png, monkeypatch):
    """`--profile 1`: every step's profile is read and summed up on the engine's thread as the step is
    taken, not on the results thread, where it would hold the GIL while the engine launches the next
    steps; each is stored with its step."""
    import threading

    from dsocr_workers.engine.profiling import SampledStep
    from dsocr_workers.store.models import Profile

    threads: list[str] = []
    collect = SampledStep.collect

    def collect_noting_thread(self, step_ms):
        threads.append(threading.current_thread().name)
        return collect(self, step_ms)

    monkeypatch.setattr(SampledStep, "collect", collect_noting_thread)
    for image, size in PAGES_A.items():
        make_png(image, size, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(PAGES_A) + "\n")
    options = RunOptions(mode="tiny", max_new_tokens=3, engine="eager", concurrency=CONCURRENCY, profile_every=1)
    run = record_run(database, read_filelist(listing), options, queue="q")
    url = database.engine.url.render_as_string(hide_password=False)
    process = JobProcess.open(Settings(database_url=url, queue="q"), "cpu", queues=("q",))
    try:
        process.models.warm(job_warmup(options))
        process.start_batch(options)
        for i, job_id in enumerate(run.job_ids):
            assert run_in_batch(process, job_id, options, more_coming=i < len(run.job_ids) - 1).status == "decoding"
    finally:
        process.close()
    with database.transaction() as tx:
        profiled = tx.scalars(select(BatchStep.id).where(BatchStep.profiled)).all()
        profiles = tx.scalars(select(Profile.batch_step_id)).all()
    assert profiled and sorted(profiled) == sorted(profiles)
    assert threads and set(threads) == {"dsocr-batch-engine"}, threads
