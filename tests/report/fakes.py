"""Runs for report tests, written through the farm's own claim → complete path with given inference
results. Their timings satisfy the engine's accounting identity (dsocr_workers/stages.py StageTimings):
e2e = the sum of the named parts, TTFT = preprocess + setup + prefill + first token; their device span
starts as the fake inference is made, after the claim, so TTFT from the claim is a little more than
TTFT from the device start."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from dsocr_workers.engine.loops import RepetitionLoop
from dsocr_workers.engine.result import (
    DeviceSpan,
    InferenceResult,
    JobMemory,
    ModelSource,
    StopReason,
)
from dsocr_workers.errors import InputError
from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import Ran, execute_job
from dsocr_workers.farm.job.fingerprint import environment_fingerprint
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import attach_ground_truth, record_run
from dsocr_workers.settings import Settings
from dsocr_workers.stages import TIMINGS, StageTimings
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Job, Run, Worker, WorkerSession, job_id_for
from dsocr_workers.store.upsert import upsert

SOURCE = ModelSource(kind="preset", name="tiny", random_weights=True, seed=0)
WORKER = environment_fingerprint("cpu", SOURCE)


@dataclass(frozen=True)
class Page:
    """What one job measures: every time is a fixed multiple of `scale` ms."""

    scale: float = 1.0
    markup: str = "same"
    boxes: int = 1
    steps: int = 4
    wasted: int = 0
    cold_reason: str | None = None
    session: str | None = None  # the worker_sessions row that ran it (None: a result older than sessions)
    memory_mib: tuple[int, int, int] | None = None  # CUDA: weights, KV cache, activation peak
    stop_reason: StopReason = "max_new_tokens"
    loop: RepetitionLoop | None = None
    mode: str = "tiny"
    encoder: str = "clip_ms"  # the model family's view encoder stage: "qwen2_ms" for DeepSeek-OCR-2
    image_tokens: int = 16
    # Decoded in the batched engine: its prefill and vision measured, its other device stages None (their
    # time in its host gap), as engine/session.py `BatchFigures` leaves them.
    batched: bool = False


def fake_result(page: Page) -> InferenceResult:
    s = page.scale
    parts = StageTimings(
        clock="perf_counter", preprocess_ms=1 * s, setup_ms=0.5 * s, prefill_ms=10 * s, vision_ms=6 * s,
        sam_ms=3 * s, projector_ms=1 * s, lm_prefill_ms=4 * s, first_token_ms=0.5 * s,
        decode_ms=page.steps * 2 * s, decode_step_ms=[2 * s] * page.steps, wasted_decode_ms=page.wasted * 2 * s,
        readback_ms=0.2 * s, postprocess_ms=0.3 * s, host_gap_ms=0.1 * s,
    )  # fmt: skip
    parts = replace(parts, **{page.encoder: 2 * s})
    # A nested figure named nowhere above (a stage added to the registry later) gets a time of its own, so
    # that every figure has a spread over pages; nested figures are no parts, the identity holds. Another
    # family's view encoder stays unmeasured (None), as the engine leaves it.
    named = {"vision_ms", "sam_ms", "clip_ms", "qwen2_ms", "projector_ms", "lm_prefill_ms"}
    parts = replace(parts, **{
        t.column: 0.1 * s for t in TIMINGS if t.parent is not None and t.column not in named and not t.family_stage
    })
    from_start = parts.setup_ms + parts.prefill_ms + parts.first_token_ms
    timings = replace(parts, ttft_ms=parts.preprocess_ms + from_start, e2e_ms=sum(parts.parts_ms.values()),
                      ttft_from_device_start_ms=from_start, tpot_ms=2 * s)  # fmt: skip
    assert math.isclose(timings.e2e_ms, (12 + 0.6 + 2 * page.steps + 2 * page.wasted) * s)
    if page.batched:
        untimed = ("setup_ms", "sam_ms", "clip_ms", "qwen2_ms", "projector_ms", "lm_prefill_ms", "first_token_ms",
                   "decode_ms", "wasted_decode_ms", "readback_ms")  # fmt: skip
        gap = timings.e2e_ms - timings.preprocess_ms - timings.prefill_ms - timings.postprocess_ms
        timings = replace(timings, **dict.fromkeys(untimed), host_gap_ms=gap)
    on_device = timings.e2e_ms - parts.preprocess_ms - parts.postprocess_ms - parts.host_gap_ms
    started = time.perf_counter()
    span = DeviceSpan(started, started + from_start / 1e3, started + on_device / 1e3)
    return InferenceResult(
        text=page.markup, token_ids=list(range(page.steps + 1)), stop_reason=page.stop_reason,
        prompt_tokens=4 + page.image_tokens, image_tokens=page.image_tokens, crop_grid=(1, 1), mode=page.mode, image_size=(320, 420),
        timings=timings, boxes=[{"label": "text", "box": [0, 0, 1, 1]}] * page.boxes, skipped_spans=0,
        memory=memory(page.memory_mib), engine="eager", device="cpu", dtype="float32", model=SOURCE, kv_length=25,
        vision_calls=1, wasted_steps=page.wasted,
        cold_reasons=(page.cold_reason,) if page.cold_reason else (), loop=page.loop, device_span=span,
    )  # fmt: skip


def memory(mib: tuple[int, int, int] | None) -> JobMemory | None:
    if mib is None:
        return None
    weights, kv_cache, activations = (x * 2**20 for x in mib)
    return JobMemory(weights + kv_cache + activations, weights, kv_cache, activations)


def make_run(
    db: Database, folder: Path, make_png, pages: dict[tuple[str, int], Page | None], ground_truth: Path | None = None,
    **options: Any,
) -> str:
    """A run with one job per (image, repeat) key, every image with the same repeats; None makes that
    job fail as an input error. With `ground_truth` (an OmniDocBench file naming every image) each job
    carries its reference and its result is scored, as `dsocr submit --ground-truth` does. `options`: the
    run's options other than its defaults (RunOptions)."""
    images = list(dict.fromkeys(image for image, _ in pages))
    for image in images:
        make_png(image, folder=folder)
    listing = folder / "list.txt"
    listing.write_text("\n".join(images) + "\n")
    repeats = 1 + max(repeat for _, repeat in pages)
    listed, references = read_filelist(listing), {}
    if ground_truth is not None:
        listed, references = attach_ground_truth(listed, ground_truth)
        assert not listed.bad, listed.bad
    run = record_run(db, listed, RunOptions(**{"mode": "tiny", **options}, repeats=repeats), queue="q",
                     ground_truth=ground_truth, references=references)  # fmt: skip
    with db.transaction() as session:
        upsert(session, Worker, WORKER, ["id"])

    def infer(claiming):
        claim = claiming.result()
        page = pages[(claim.image, claim.repeat)]
        if page is None:
            raise InputError("corrupt page")
        return Ran(fake_result(page), WORKER["id"], page.session)

    for job_id in run.job_ids:
        outcome = execute_job(db, job_id, owner="test:1:x", settings=Settings(max_attempts=2), infer=infer)
        assert outcome.status in ("done", "failed")
    return run.run_id


def session_pid(session_id: str) -> int:
    return 4000 + sum(map(ord, session_id))


def add_session(
    db: Database, session_id: str, started_at: datetime, ready_at: datetime, pid: int | None = None
) -> None:
    """A worker session that loaded and warmed its model from `started_at` to `ready_at`, in its own
    worker process unless `pid` names one it shares."""
    load_ms = (ready_at - started_at).total_seconds() * 1000
    with db.transaction() as session:
        upsert(session, Worker, WORKER, ["id"])
        session.add(
            WorkerSession(
                id=session_id, worker_id=WORKER["id"], host="gpu-host", pid=pid or session_pid(session_id), device="cuda:0",
                model="tiny", engine="eager", dtype="float32", warmup="gundam", started_at=started_at,
                load_ms=0.75 * load_ms, warmup_ms=0.25 * load_ms, ready_at=ready_at, last_seen_at=ready_at,
            )
        )  # fmt: skip


def set_times(
    db: Database, run_id: str, created_at: datetime, times: dict[tuple[str, int], tuple[float, float]]
) -> None:
    """The run's creation, and each job's (started, finished) in seconds after it."""
    with db.transaction() as session:
        session.get(Run, run_id).created_at = created_at
        for (image, repeat), (started, finished) in times.items():
            job = session.get(Job, job_id_for(run_id, image, repeat))
            job.started_at = created_at + timedelta(seconds=started)
            job.finished_at = created_at + timedelta(seconds=finished)
