"""`dsocr submit --concurrency N`: a worker keeps up to N of the run's jobs in flight on the batched
engine (farm/job/batched.py); every job is claimed and finished once, with its batch-1 tokens, and the
engine's steps are stored (`batch_steps`). DeepSeek-OCR-2 (ocr2-tiny) too, on the same worker."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import select
from test_workers import dsocr, wait_until_final

from dsocr_workers.farm.celery.app import create_app
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import enqueue
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import BatchStep, Job, Result, Run, WorkerSession, job_id_for

PAGES = {"a.png": (320, 420), "b.png": (640, 480), "c.png": (400, 900)}
# A batched job's parts its own prefill launch and host stages measure (vision: inside its prefill), and
# the stages the batch does not time per page.
MEASURED = ("preprocess_ms", "prefill_ms", "postprocess_ms", "vision_ms")
UNTIMED = ("setup_ms", "sam_ms", "clip_ms", "qwen2_ms", "projector_ms", "lm_prefill_ms", "first_token_ms",
           "decode_ms", "wasted_decode_ms", "readback_ms")  # fmt: skip
REPEATS = 2
# A job's tokens: enough steps that a batched job is still decoding when the lane has handed the child two
# more (a hand-over and a claim each), on a loaded machine too; with 6, a third of the first job's time.
TOKENS = 32
# DeepSeek-OCR-2's runs after them, one repeat each: the first page's prefill (SAM over its 768-px view)
# gives the lane time to hand the child the other two, and they join while it decodes.
OCR2_TOKENS = 24
OCR2 = ("--model", "ocr2-tiny", "--mode", "small", "--max-new-tokens", str(OCR2_TOKENS))


@pytest.fixture
def pages(page_list) -> Path:
    return page_list(PAGES)


def most_at_once(spans: list[tuple[object, object]]) -> int:
    """The most intervals (start, end) open at one instant."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    open_now = most = 0
    for _, change in edges:
        open_now += change
        most = max(most, open_now)
    return most


def worker_story(database_url: str, log: str) -> str:
    """What a failed start-up check needs to be understood: the worker's sessions in order and what its
    log says of warm-ups, batches and jobs that did not go straight through."""
    db = open_database(database_url)
    with db.transaction() as session:
        sessions = session.execute(
            select(WorkerSession.ready_at, WorkerSession.model, WorkerSession.warmup).order_by(WorkerSession.ready_at)
        ).all()
    db.dispose()
    notable = re.compile(r"WARNING|ERROR|warm|batched engine|retry|refused|not open|back in line|Task .* received")
    return "\n".join([*(f"session {row.ready_at} {row.model}: {row.warmup}" for row in sessions),
                      *(line for line in log.splitlines() if notable.search(line))])  # fmt: skip


@pytest.mark.postgres
@pytest.mark.redis
def test_a_run_at_concurrency_3_decodes_jobs_together_with_their_batch_1_tokens(
    pages, postgres_url, broker_env, subprocess_env, tmp_path
):  # fmt: skip
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url}
    # First in line, a message for a job the ledger does not know (its run deleted, another ledger's): it is
    # refused and must leave the worker's start-up batch to the batched jobs behind it.
    stray = job_id_for("stray", "a.png", 0)
    stray_db = open_database(postgres_url)
    assert enqueue(stray_db, create_app(Settings.from_env(env)), [(stray, broker_env["DSOCR_QUEUE"])]) == 1
    stray_db.dispose()
    common = ("--mode", "tiny", "--max-new-tokens", str(TOKENS), "--repeats", str(REPEATS))
    run_ids = {}
    for concurrency in (3, 1):  # the batched run first: the batch-1 run's jobs come after it drained
        submitted = dsocr("submit", str(pages), *common, "--concurrency", str(concurrency),
                          "--name", f"c{concurrency}", env=env)  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        run_ids[concurrency] = submitted.stdout.strip().splitlines()[-1]
    ocr2_ids = {}  # fewer open jobs than tiny's: the worker starts with tiny's batched engine, then switches
    for concurrency in (3, 1):
        submitted = dsocr("submit", str(pages), *OCR2, "--concurrency", str(concurrency), env=env)
        assert submitted.returncode == 0, submitted.stderr
        ocr2_ids[concurrency] = submitted.stdout.strip().splitlines()[-1]
    jobs = len(PAGES) * REPEATS
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dsocr_workers", "worker", "--gpus", "cpu", "--loglevel", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            for run_id in run_ids.values():
                assert wait_until_final(postgres_url, run_id, timeout=300) == {"done": jobs}
            for run_id in ocr2_ids.values():
                assert wait_until_final(postgres_url, run_id, timeout=300) == {"done": len(PAGES)}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    text = log_path.read_text()
    assert worker.returncode == 0, text[-3000:]
    assert f"job {stray}: refused unknown job" in text
    assert "in the batch, 3 in flight" in text and "decoded in the batch" in text

    db = open_database(postgres_url)
    with db.transaction() as session:
        parameters = session.execute(select(Run.parameters).where(Run.id == run_ids[3])).scalar_one()
        rows = session.execute(
            select(Job.run_id, Job.image, Job.repeat, Job.attempts, Job.started_at, Job.finished_at,
                   Result.token_ids, Result.stop_reason, Result.decode_step_ms, Result.decode_ms_per_token_p50,
                   Result.batch_occupancy, Result.tpot_ms, Result.ttft_ms, Result.queue_wait_ms, Result.e2e_ms,
                   Result.ttft_from_claim_ms, Result.device_started_at, Result.prompt_tokens, WorkerSession.warmup,
                   WorkerSession.ready_at, *(getattr(Result, c) for c in MEASURED + UNTIMED), Result.host_gap_ms)
            .join(Result, Result.job_id == Job.id).join(WorkerSession, WorkerSession.id == Result.worker_session_id)
            .where(Job.run_id.in_(run_ids.values()))
        ).all()  # fmt: skip
        columns = (BatchStep.run_id, BatchStep.kind, BatchStep.occupancy, BatchStep.bucket)
        steps = session.execute(select(*columns).where(BatchStep.run_id.in_(run_ids.values()))).all()
        ocr2_rows = session.execute(
            select(Job.run_id, Job.image, Job.attempts, Result.token_ids, Result.batch_occupancy, Result.image_tokens,
                   Result.clip_ms, Result.qwen2_ms, Result.sam_ms, Result.vision_ms)
            .join(Result, Result.job_id == Job.id).where(Job.run_id.in_(ocr2_ids.values()))
        ).all()  # fmt: skip
        ocr2_steps = Counter(session.scalars(select(BatchStep.kind).where(BatchStep.run_id == ocr2_ids[3])))
    db.dispose()
    assert RunOptions.from_parameters("tiny", parameters).concurrency == 3
    # One result per job (results are keyed by job and attempt: a job finished twice would show twice).
    assert len(rows) == 2 * jobs and all(row.attempts == 1 for row in rows)
    tokens = {(row.run_id, row.image, row.repeat): row.token_ids for row in rows}
    for image in PAGES:
        for repeat in range(REPEATS):
            batched, alone = tokens[run_ids[3], image, repeat], tokens[run_ids[1], image, repeat]
            assert len(alone) == TOKENS and batched == alone, (image, repeat)
    for row in rows:  # a batched job's per-token times are the gaps between its tokens (its inter-token latency)
        assert len(row.decode_step_ms) == TOKENS - 1 and row.decode_ms_per_token_p50 > 0, row
        # TPOT, first to last token over the tokens after the first: a batched job's mean gap; on the batch-1
        # path the decode stage over its steps (the steps' events and the loop between them).
        if row.run_id == run_ids[3]:
            assert row.tpot_ms == pytest.approx(sum(row.decode_step_ms) / (TOKENS - 1), rel=1e-6), row
        else:
            assert row.tpot_ms >= sum(row.decode_step_ms) / (TOKENS - 1) * (1 - 1e-9), row
        assert 0 < row.ttft_ms < row.e2e_ms and row.queue_wait_ms >= 0, row
    batched = [row for row in rows if row.run_id == run_ids[3]]
    # The batched engine starts with the worker (its start-up session, which the batched jobs point at),
    # ready before any of them was claimed, its KV plan sized for the mode's longest prompt (every tiny
    # page has the same), not for the model's whole context.
    assert len({row.warmup for row in batched}) == 1 and "; batched engine: concurrency 3," in batched[0].warmup, (
        worker_story(postgres_url, text)
    )
    planned = re.search(rf"\((\d+) prompt \+ {TOKENS} new\)", batched[0].warmup)
    assert planned is not None and int(planned.group(1)) == max(row.prompt_tokens for row in batched), batched[0].warmup
    assert all(row.ready_at <= row.started_at for row in batched)
    # Its prefill launch timed as its prefill and vision; the stages the batch does not time per page NULL,
    # not 0; its measured parts and its host gap still make up e2e. The batch-1 rows time every stage.
    for row in batched:
        assert row.prefill_ms > row.vision_ms > 0 and all(getattr(row, c) is None for c in UNTIMED), row
        parts = sum(getattr(row, c) for c in MEASURED[:3]) + row.host_gap_ms
        assert parts == pytest.approx(row.e2e_ms), row
    assert all(row.sam_ms > 0 and row.decode_ms > 0 for row in rows if row.run_id == run_ids[1])
    latency = {row["metric"].strip(): row for row in json.loads(dsocr(
        "report", "--run", run_ids[3], "--format", "json", "--table", "Latency and output", env=env
    ).stdout)["tables"]["Latency and output"]}  # fmt: skip
    assert latency["prefill ms"]["mean"] > latency["vision ms"]["mean"] > 0 and "decode ms/token" in latency
    assert not {"SAM ms", "CLIP ms", "projector ms", "LM prefill ms", "decode ms"} & set(latency)
    # A batched job's TTFT runs from its claim (its page's preparation and its wait for a slot inside).
    assert all(row.ttft_from_claim_ms == pytest.approx(row.ttft_ms) and row.device_started_at is not None
               for row in batched)  # fmt: skip
    occupancy = {run_id: [row.batch_occupancy for row in rows if row.run_id == run_id] for run_id in run_ids.values()}
    assert all(o is None for o in occupancy[run_ids[1]])  # the batch-1 path
    assert all(1 <= o <= 3 for o in occupancy[run_ids[3]]) and max(occupancy[run_ids[3]]) > 1
    serving = {row["measure"]: row["value"] for row in json.loads(
        dsocr("report", "--run", run_ids[3], "--format", "json", "--table", "Serving", env=env).stdout)["tables"]["Serving"]}
    assert serving["concurrency (jobs in flight per GPU)"] == 3 and serving["mean batch occupancy"] > 1
    # The batched run's engine steps, each once (no other run shared its batch); none at concurrency 1.
    assert {step.run_id for step in steps} == {run_ids[3]}
    kinds = Counter(step.kind for step in steps)
    # Each job joins whole, or split in a sam and a join step (where others decoded when it joined).
    # (which ones split depends on when their pages were ready: the engine tests pin that down)
    assert kinds["prefill"] + kinds["join"] == jobs and kinds["sam"] == kinds["join"]
    assert kinds["decode"] >= TOKENS - 1 and {"prefill", "decode"} <= set(kinds) <= {"prefill", "sam", "join", "decode"}
    assert all(1 <= step.occupancy <= step.bucket <= 3 for step in steps if step.kind != "sam")
    assert all(step.occupancy == 0 and step.bucket == 1 for step in steps if step.kind == "sam")  # no token
    assert max(step.occupancy for step in steps) > 1
    report = dsocr("report", "--run", run_ids[3], "--format", "json", "--table", "Batch steps", env=env)
    batch_steps = {row["measure"]: row["value"] for row in json.loads(report.stdout)["tables"]["Batch steps"]}
    assert batch_steps["prefill steps (a page joining whole)"] == kinds["prefill"]
    assert batch_steps["split prefills (a page joining in a sam and a join step)"] == kinds["join"]
    assert batch_steps["decode steps"] == kinds["decode"]
    tables = json.loads(dsocr("report", "--run", run_ids[1], "--format", "json", env=env).stdout)["tables"]
    assert "Serving" in tables and "Batch steps" not in tables
    spans = {run_id: [(row.started_at, row.finished_at) for row in rows if row.run_id == run_id] for run_id in run_ids.values()}
    assert most_at_once(spans[run_ids[3]]) >= 2  # claimed before others of its run were finished
    assert most_at_once(spans[run_ids[1]]) == 1  # batch 1: one job at a time

    # DeepSeek-OCR-2: its batched engine decodes its pages together, each with its batch-1 tokens. Its
    # batch-1 rows time its Qwen2 encoder and hold NULL for CLIP, a stage it does not have; its batched
    # rows time their vision whole (NULL for SAM and either encoder).
    assert len(ocr2_rows) == 2 * len(PAGES) and all(row.attempts == 1 for row in ocr2_rows)
    ocr2_tokens = {(row.run_id, row.image): row.token_ids for row in ocr2_rows}
    for image in PAGES:
        batched, alone = ocr2_tokens[ocr2_ids[3], image], ocr2_tokens[ocr2_ids[1], image]
        assert len(alone) == OCR2_TOKENS and batched == alone, image
    assert all(row.image_tokens == 145 and row.clip_ms is None for row in ocr2_rows)
    assert all(row.qwen2_ms > 0 and row.sam_ms > 0 for row in ocr2_rows if row.run_id == ocr2_ids[1])
    assert all(row.qwen2_ms is None and row.sam_ms is None and row.vision_ms > 0
               for row in ocr2_rows if row.run_id == ocr2_ids[3])  # fmt: skip
    assert max(row.batch_occupancy for row in ocr2_rows if row.run_id == ocr2_ids[3]) > 1
    assert ocr2_steps["prefill"] + ocr2_steps["join"] == len(PAGES) and ocr2_steps["sam"] == ocr2_steps["join"]
    assert ocr2_steps["decode"] >= OCR2_TOKENS - 1


def test_concurrency_is_checked_and_stored():
    assert RunOptions().concurrency == 1 and RunOptions(concurrency=4).parameters["concurrency"] == 4
    assert RunOptions.from_parameters("tiny", {}).concurrency == 1  # a run recorded before the option
    with pytest.raises(Exception, match="--concurrency must be at least 1"):
        RunOptions(concurrency=0)


def test_prefill_is_checked_and_stored():
    assert RunOptions().prefill == "split" and RunOptions().split_prefill
    assert RunOptions.from_parameters("tiny", {"concurrency": 2}).prefill == "whole"  # recorded before it
    options = RunOptions(concurrency=2, prefill="whole")
    assert RunOptions.from_parameters("tiny", options.parameters) == replace(options, model="tiny")
    assert RunOptions.from_parameters("tiny", RunOptions().parameters).prefill == "split"
    with pytest.raises(Exception, match="unknown prefill 'chunks'; choices: split, whole"):
        RunOptions(concurrency=2, prefill="chunks")


def test_dsocr_run_with_whole_prefills_records_and_reports_them(pages, tmp_path, subprocess_env):
    """`--prefill whole`: the run records it (its parameters, its engine's start), and every page joins
    in one prefill step of its own in `batch_steps`, even while others decode."""
    url = f"sqlite:///{tmp_path / 'embedded.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    done = dsocr("run", str(pages), "--mode", "tiny", "--max-new-tokens", "6", "--repeats", "2", "--concurrency", "3",
                 "--prefill", "whole", "--gpus", "cpu", "--format", "json", env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tables = json.loads(done.stdout)["tables"]
    parameters = next(row["value"] for row in tables["Run"] if row["field"] == "parameters")
    assert "prefill=whole" in parameters
    serving = {row["measure"]: row["value"] for row in tables["Serving"]}
    assert serving["prefill (split or whole)"] == "whole"
    batch_steps = {row["measure"]: row["value"] for row in tables["Batch steps"]}
    db = open_database(url)
    with db.transaction() as tx:
        kinds = [s.kind for s in tx.execute(select(BatchStep)).scalars()]
        results = tx.execute(select(Result)).scalars().all()
        warmups = [w.warmup for w in tx.execute(select(WorkerSession)).scalars()]
    assert batch_steps["prefill steps (a page joining whole)"] == kinds.count("prefill") == len(results)
    assert batch_steps["split prefills (a page joining in a sam and a join step)"] == 0
    assert set(kinds) == {"prefill", "decode"}
    assert any("whole prefills" in (warmup or "") for warmup in warmups)


def test_dsocr_run_at_concurrency_3_reports_its_batched_serving_as_the_farm_does(pages, tmp_path, subprocess_env):
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'embedded.db'}"}
    done = dsocr("run", str(pages), "--mode", "tiny", "--max-new-tokens", str(TOKENS), "--repeats", str(REPEATS),
                 "--concurrency", "3", "--gpus", "cpu", "--format", "json", env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tables = json.loads(done.stdout)["tables"]
    serving = {row["measure"]: row["value"] for row in tables["Serving"]}
    assert serving["concurrency (jobs in flight per GPU)"] == 3 and serving["mean batch occupancy"] > 1
    batch_steps = {row["measure"]: row["value"] for row in tables["Batch steps"]}
    # Each page joins whole, or split (sam, then join) where others decoded when it joined.
    whole, split = batch_steps["prefill steps (a page joining whole)"], batch_steps["split prefills (a page joining in a sam and a join step)"]
    assert whole + split == len(PAGES) * REPEATS and whole > 0 and batch_steps["decode steps"] > 0
