"""Kernel-level profiles through the farm (issue 33): `dsocr submit --profile N`, a real Celery worker
process on Redis + PostgreSQL runs every N-th job under torch.profiler (at `--concurrency` above 1, every
N-th batch step of each kind) and stores its trace and kernels with it; other processes read them back
(`dsocr trace`, `dsocr report`). DeepSeek-OCR-2 (ocr2-tiny) too, on the same worker: its view encoder's
stage is profiled as `vision/qwen2`."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from test_workers import dsocr, wait_until_final

from dsocr_workers.cli import main
from dsocr_workers.kernels import KernelSummary
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import BatchStep, Job, Profile, Result

PAGES = {"p1.png": (320, 420), "p2.png": (640, 480)}


@pytest.fixture
def pages(page_list) -> Path:
    return page_list(PAGES)


def report_tables(env: dict[str, str], *args: str) -> dict[str, list[dict]]:
    done = dsocr("report", *args, "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["tables"]


@pytest.mark.postgres
@pytest.mark.redis
def test_every_nth_job_is_profiled_by_a_worker_and_read_back_from_another_process(
    pages, postgres_url, broker_env, subprocess_env, tmp_path
):
    queue = broker_env["DSOCR_QUEUE"] + "-profile"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url, "DSOCR_QUEUE": queue}
    runs = []
    for tokens in ("6", "10"):  # A and B: --vs compares their kernels
        submitted = dsocr("submit", str(pages), "--mode", "tiny", "--max-new-tokens", tokens, "--repeats", "2",
                          "--profile", "2", env=env)  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        runs.append(submitted.stdout.strip().splitlines()[-1])
    a, b = runs
    # After them (fewer open jobs: the worker starts on tiny), DeepSeek-OCR-2's second page profiled.
    submitted = dsocr("submit", str(pages), "--model", "ocr2-tiny", "--mode", "small", "--max-new-tokens", "4",
                      "--profile", "2", env=env)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    ocr2 = submitted.stdout.strip().splitlines()[-1]

    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "dsocr_workers", "worker", "--gpus", "cpu"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            for run in runs:
                assert wait_until_final(postgres_url, run, timeout=240) == {"done": 2 * len(PAGES)}
            assert wait_until_final(postgres_url, ocr2, timeout=240) == {"done": len(PAGES)}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)

    db = open_database(postgres_url)
    with db.transaction() as session:
        jobs = session.execute(select(Job.id, Job.image, Job.repeat, Job.profile).where(Job.run_id == a)).all()
        profiled = dict(session.execute(select(Result.job_id, Result.profiled).where(Result.run_id == a)).all())
        profiles = {p.job_id: (p.activity, p.trace_bytes, KernelSummary.from_json(p.summary))
                    for p in session.scalars(select(Profile).where(Profile.run_id == a))}  # fmt: skip
        ocr2_profiles = {p.job_id: KernelSummary.from_json(p.summary)
                         for p in session.scalars(select(Profile).where(Profile.run_id == ocr2))}  # fmt: skip
        ocr2_jobs = dict(session.execute(select(Job.id, Job.image).where(Job.run_id == ocr2)).all())
    db.dispose()
    # Every 2nd job in file-list order: with 2 repeats, repeat 1 of each page; flagged on job and result.
    chosen = {job_id for job_id, _, repeat, profile in jobs if profile}
    assert chosen == {job_id for job_id, _, repeat, _ in jobs if repeat == 1}
    assert {job_id for job_id, flag in profiled.items() if flag} == chosen == set(profiles)
    for activity, trace_bytes, summary in profiles.values():
        assert activity == "cpu" and trace_bytes > 0
        assert summary.decode_steps == [0, 1, 2, 3, 4]  # 6 tokens: the first from the prefill, 5 steps
        assert [s.stage for s in summary.stages][:3] == ["setup", "prefill", "vision/sam"]
        assert summary.stage("lm_prefill").kernels and summary.stage("decode").kernel_ms > 0

    # Another process reads a trace back, by job id and by run and image.
    job_id = sorted(chosen)[0]
    by_id = tmp_path / "by-id.json.gz"
    done = dsocr("trace", "--job", job_id[:13], "--out", str(by_id), env=env)
    assert done.returncode == 0, done.stderr
    events = json.loads(gzip.decompress(by_id.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"dsocr::prefill", "dsocr::vision/sam", "dsocr::lm_prefill", "dsocr::decode step 0"} <= names
    plain = tmp_path / "p2.json"
    done = dsocr("trace", "--run", a, "--image", "p2.png", "--out", str(plain), env=env)
    assert done.returncode == 0 and "repeat 1" in done.stdout, done.stderr
    assert "dsocr::decode step 4" in {e.get("name") for e in json.loads(plain.read_text())["traceEvents"]}
    done = dsocr("trace", "--run", a, "--image", "p2.png", "--repeat", "0", env=env)
    assert done.returncode == 2 and "has no profile" in done.stderr

    # The report: profiled jobs out of the latency statistics unless asked, their kernels per stage.
    tables = report_tables(env, "--run", a)
    facts = {row["field"]: row["value"] for row in tables["Run"]}
    assert facts["profiled results"] == 2 and facts["left out of statistics"] == 2
    latency = {row["metric"]: row for row in tables["Latency and output"]}
    assert latency["end-to-end ms"]["jobs"] == 2
    with_profiled = report_tables(env, "--run", a, "--include-profiled")
    assert {row["metric"]: row for row in with_profiled["Latency and output"]}["end-to-end ms"]["jobs"] == 4
    kernels = tables["Kernels per stage"]
    assert {"setup", "prefill", "vision/sam", "lm_prefill", "decode"} <= {row["stage"] for row in kernels}
    assert all(row["calls/job"] > 0 and 0 <= row["share of stage %"] <= 100 for row in kernels)
    busy = {row["stage"]: row for row in tables["Device busy and idle per stage"]}
    assert busy["decode"]["jobs"] == 2
    assert busy["decode"]["busy ms"] <= busy["decode"]["clock ms"]
    assert busy["prefill"]["cross-check"].startswith(("PASS", "explained"))
    overhead = {row["measure"]: row for row in tables["Profiler overhead"]}
    assert overhead["profiled jobs"]["value"] == 2 and overhead["e2e profiled / not profiled"]["value"] > 0

    compared = report_tables(env, "--run", a, "--vs", b)["Kernels per stage, B vs A"]
    decode = [row for row in compared if row["stage"] == "decode"]
    # A kernel outside one run's top ones per stage has no figure there (None): the rows both runs list
    # carry both figures.
    assert decode and all((row["A ms/job"] or 0) >= 0 and (row["B ms/job"] or 0) >= 0 for row in decode)
    assert any(row["A ms/job"] and row["B ms/job"] for row in decode)
    assert {row["kernel"]: row for row in decode}["aten::mm"]["B/A"] > 0
    # B samples 8 decode steps to A's 5: 8/5 of its decode kernels' calls per job. Counted, not timed: on
    # a loaded 2-core CI machine B/A of aten::mm's time came out 0.92 once.
    def decode_calls(tables):
        return {row["kernel"]: row["calls/job"] for row in tables["Kernels per stage"] if row["stage"] == "decode"}
    assert 5 * decode_calls(report_tables(env, "--run", b))["aten::mm"] == 8 * decode_calls(tables)["aten::mm"]

    # DeepSeek-OCR-2's profiled job: its stages are SAM, its Qwen2 encoder and the projector (no CLIP), in
    # its kernel tables and its trace (read back in this process: the commands' imports cost more).
    ((job_id, summary),) = ocr2_profiles.items()
    assert ocr2_jobs[job_id] == "p2.png" and summary.decode_steps == [0, 1, 2]  # 4 tokens: 3 steps
    assert [s.stage for s in summary.stages][:5] == ["setup", "prefill", "vision/sam", "vision/qwen2",
                                                     "vision/projector"]  # fmt: skip
    assert summary.stage("vision/qwen2").kernels and "vision/clip" not in {s.stage for s in summary.stages}
    env_here = {"DSOCR_DATABASE_URL": postgres_url}
    shown = CliRunner().invoke(main, ["report", "--run", ocr2, "--format", "json", "--table", "Kernels per stage"],
                               env=env_here)  # fmt: skip
    assert shown.exit_code == 0, shown.output
    kernels = json.loads(shown.stdout)["tables"]["Kernels per stage"]
    assert {"vision/sam", "vision/qwen2", "vision/projector"} <= {row["stage"] for row in kernels}
    assert "vision/clip" not in {row["stage"] for row in kernels}

    # --kernels: the rows a stage lists (8 by default), its longest first.
    def listed(*args: str) -> dict[str, list[str]]:
        shown = CliRunner().invoke(
            main, ["report", "--run", a, "--format", "json", "--table", "Kernels per stage", *args], env=env_here
        )
        assert shown.exit_code == 0, shown.output
        by_stage: dict[str, list[str]] = {}
        for row in json.loads(shown.stdout)["tables"]["Kernels per stage"]:
            by_stage.setdefault(row["stage"], []).append(row["kernel"])
        return by_stage

    default, two, more = listed(), listed("--kernels", "2"), listed("--kernels", "20")
    assert max(map(len, default.values())) == 8 and max(map(len, more.values())) > 8
    assert two == {stage: kernels[:2] for stage, kernels in default.items()}
    assert more.keys() == default.keys()
    ocr2_trace = tmp_path / "ocr2.json"
    done = CliRunner().invoke(main, ["trace", "--job", job_id, "--out", str(ocr2_trace)], env=env_here)
    assert done.exit_code == 0, done.output
    names = {e.get("name") for e in json.loads(ocr2_trace.read_text())["traceEvents"]}
    assert {"dsocr::vision/sam", "dsocr::vision/qwen2", "dsocr::decode step 2"} <= names
    assert "dsocr::vision/clip" not in names


@pytest.mark.postgres
@pytest.mark.redis
def test_a_batched_runs_every_nth_step_of_each_kind_is_profiled_by_a_worker_and_read_back_from_another_process(
    pages, postgres_url, broker_env, subprocess_env, tmp_path
):  # fmt: skip
    """`--profile 2 --concurrency 2`: the worker's batched engine runs every 2nd prefill step and every 2nd
    decode step under torch.profiler; the steps are flagged, their kernels and traces stored with them."""
    queue = broker_env["DSOCR_QUEUE"] + "-batch-profile"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url, "DSOCR_QUEUE": queue}
    runs = []
    for tokens in ("8", "12"):  # A and B: --vs compares their batch steps' kernels
        submitted = dsocr("submit", str(pages), "--mode", "tiny", "--max-new-tokens", tokens, "--repeats", "2",
                          "--concurrency", "2", "--prefill", "whole", "--profile", "2", env=env)  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        runs.append(submitted.stdout.strip().splitlines()[-1])
    a, b = runs

    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "dsocr_workers", "worker", "--gpus", "cpu"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            for run in runs:
                assert wait_until_final(postgres_url, run, timeout=300) == {"done": 2 * len(PAGES)}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    # Kineto started on the task's thread, not first on the engine's: it said nothing in the worker's log.
    assert "External init callback" not in (tmp_path / "worker.log").read_text()

    db = open_database(postgres_url)
    with db.transaction() as session:
        columns = (BatchStep.id, BatchStep.worker_session_id, BatchStep.step_index, BatchStep.kind,
                   BatchStep.occupancy, BatchStep.duration_ms, BatchStep.profiled)  # fmt: skip
        steps = session.execute(select(*columns).where(BatchStep.run_id == a)).all()
        profiles = {p.batch_step_id: (p.job_id, p.activity, p.trace_bytes, KernelSummary.from_json(p.summary))
                    for p in session.scalars(select(Profile).where(Profile.run_id == a))}  # fmt: skip
        flags = session.execute(
            select(Job.profile, Result.profiled).join(Result).where(Job.run_id == a)
        ).all()
    db.dispose()
    # Every 2nd step of each kind its engine launched, in launch order: 2 of the 4 pages' prefills, half
    # the decode steps; the others ran with no profiler. A batched run's jobs are not profiled themselves.
    by_kind: dict[tuple[str, str], list] = {}
    for step in sorted(steps, key=lambda s: s.step_index):
        by_kind.setdefault((step.worker_session_id, step.kind), []).append(step)
    assert {kind for _, kind in by_kind} == {"prefill", "decode"}
    for (_, kind), launched in by_kind.items():
        assert [s.profiled for s in launched] == [n % 2 == 0 for n in range(1, len(launched) + 1)], kind
    sampled = {s.id: s for s in steps if s.profiled}
    assert set(profiles) == set(sampled) and sum(s.kind == "prefill" for s in sampled.values()) == 2
    assert flags == [(False, False)] * 2 * len(PAGES)
    for step_id, (job_id, activity, trace_bytes, summary) in profiles.items():
        step = sampled[step_id]
        assert job_id is None and activity == "cpu" and trace_bytes > 0
        (stage,) = summary.stages  # the step's one range, its clock the step's own time
        assert stage.stage == f"batched/{step.kind}" and stage.event_ms == pytest.approx(step.duration_ms)
        assert stage.kernel_ms > 0 and any(k.name == "aten::mm" for k in stage.kernels)

    # Another process reads a step's trace back; a step or job that was not profiled is refused.
    decode = next(s for s in sampled.values() if s.kind == "decode")
    path = tmp_path / "step.json.gz"
    done = dsocr("trace", "--run", a, "--step", str(decode.step_index), "--out", str(path), env=env)
    assert done.returncode == 0 and f"batch decode step {decode.step_index}" in done.stdout, done.stderr
    names = {e.get("name") for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}
    assert "dsocr::batched/decode" in names and "aten::mm" in names
    plain = next(
        s for s in steps if not s.profiled and s.step_index not in {p.step_index for p in sampled.values()}
    )
    done = dsocr("trace", "--run", a, "--step", str(plain.step_index), env=env)
    assert done.returncode == 2 and "has no profiled batch step" in done.stderr, done.stderr
    done = dsocr("trace", "--run", a, "--image", "p1.png", env=env)
    assert done.returncode == 2 and f"--run {a} --step N" in done.stderr, done.stderr

    # The report: kernels per batch step by kind and occupancy band; the sampled steps out of the step times.
    tables = report_tables(env, "--run", a)
    rows = tables["Kernels per stage"]
    bands = {
        f"occupancy {'1' if s.occupancy == 1 else '2-7'}" for s in sampled.values() if s.kind == "decode"
    }
    assert "occupancy 2-7" in bands
    assert {row["stage"] for row in rows} == {"batch prefill step"} | {f"batch decode step, {band}"
                                                                                    for band in bands}  # fmt: skip
    assert all(row["calls/step"] > 0 and row["ms/step"] > 0 for row in rows)
    busy = {row["stage"]: row for row in tables["Device busy and idle per stage"]}
    assert sum(row["steps"] for row in busy.values()) == len(sampled)
    assert busy["batch prefill step"]["steps"] == 2
    overhead = {row["stage"]: row for row in tables["Profiler overhead"]}
    assert overhead["batch prefill step"]["profiled steps"] == 2
    assert overhead["batch prefill step"]["profiled / not profiled"] > 0
    batch_steps = {row["measure"]: row["value"] for row in tables["Batch steps"]}
    assert batch_steps["profiled steps (--profile: out of the step times)"] == len(sampled)
    assert batch_steps["prefill steps (a page joining whole)"] == 2 * len(PAGES)
    plain_prefills = sorted(s.duration_ms for s in steps if s.kind == "prefill" and not s.profiled)
    assert batch_steps["mean prefill step ms"] == pytest.approx(
        sum(plain_prefills) / len(plain_prefills), rel=1e-4
    )
    facts = {row["field"]: row["value"] for row in tables["Run"]}
    assert facts["profiled results"] == 0

    compared = report_tables(env, "--run", a, "--vs", b)["Kernels per stage, B vs A"]
    # Which operators rank in the prefill's top rows varies with the machine's load: any that ran in both.
    prefill = [row for row in compared if row["stage"] == "batch prefill step"]
    in_both = [row for row in prefill if row["change"] not in ("only in A", "only in B")]
    assert in_both and all(row["A ms/step"] > 0 and row["B/A"] > 0 for row in in_both), prefill
