"""What a worker warms at start: the model, modes, token budgets, n-gram bans and concurrency of the runs
open on its queues (farm/job/warm.py), read from the real ledger, and carried to the children through the
environment; a worker serving a concurrency starts its batched engine in its start-up worker session."""

from __future__ import annotations

import gc
import re
import uuid

import pytest
from sqlalchemy import select

from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import DEFAULT_NGRAM, Warmup, plan_warmup
from dsocr_workers.farm.run_options import ModelKey, RunOptions
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Job, Run, WorkerSession, job_id_for


def open_run(db: Database, parameters: dict, jobs: int = 1, queue: str = "q") -> None:
    run_id = uuid.uuid4().hex[:12]
    with db.transaction() as session:
        session.add(Run(id=run_id, name="t", filelist="list.txt", root="/data", model="tiny",
                        model_label="preset:tiny (RANDOM WEIGHTS, seed 0)", random_weights=True, queue=queue,
                        parameters=parameters, tags={}))  # fmt: skip
        session.flush()
        for i in range(jobs):
            session.add(Job(id=job_id_for(run_id, f"img{i}.png", 0), run_id=run_id, image=f"img{i}.png",
                            line=i + 1, repeat=0, state="queued"))  # fmt: skip


def test_the_warm_up_covers_the_open_runs_decode_graphs(database: Database):
    fallback = ModelKey("tiny")
    assert plan_warmup(database, ["q"], "auto", RunOptions(max_new_tokens=64)) == Warmup(
        fallback, ("gundam",), (64,), (DEFAULT_NGRAM,)
    )
    # A run with the vendor's ban, one without it and one windowed: the fast engine's decode step is a
    # graph per ban, so each is warmed (a run the warm-up missed compiled on its first job).
    open_run(database, {"mode": "base", "max_new_tokens": 128}, jobs=3)
    open_run(database, {"mode": "base", "max_new_tokens": 128, "no_repeat_ngram_size": 0})
    open_run(database, {"mode": "tiny", "max_new_tokens": 256, "no_repeat_ngram_size": 20, "ngram_window": 90})
    open_run(database, {"mode": "large", "no_repeat_ngram_size": 3}, queue="elsewhere")
    plan = plan_warmup(database, ["q"], "auto", RunOptions())
    assert plan is not None and plan.key == fallback  # the runs' model (the same preset here)
    # (the order is the ledger's)
    assert set(plan.modes) == {"base", "tiny"} and set(plan.budgets) == {128, 256}
    assert set(plan.ngrams) == {(20, None), (0, None), (20, 90)}
    assert plan.concurrency == 1
    # The largest open run at concurrency 32: the batched engine started is its (mode, budget, ban first).
    open_run(database, {"mode": "tiny", "max_new_tokens": 512, "concurrency": 32}, jobs=5)
    plan = plan_warmup(database, ["q"], "auto", RunOptions())
    assert plan is not None and plan.concurrency == 32
    # Its run recorded no --prefill, as a run before the option: whole prefills.
    assert plan.batch_options() == RunOptions(mode="tiny", max_new_tokens=512, concurrency=32, prefill="whole")
    # A batch-1 run as large: of equal runs the batched one's engine starts, whatever order the ledger
    # gives (a batch-1 run needs no engine started).
    open_run(database, {"mode": "base", "max_new_tokens": 128}, jobs=5)
    for _ in range(5):
        assert plan_warmup(database, ["q"], "auto", RunOptions()).concurrency == 32
    # No run open on its queues: the runs the worker was told of (`dsocr worker --model ... --concurrency`).
    told = RunOptions(max_new_tokens=64, concurrency=128, prefill="whole")
    assert plan_warmup(database, ["none"], "auto", told) == Warmup(fallback, ("gundam",), (64,), concurrency=128,
                                                                     prefill="whole")  # fmt: skip
    # A larger one with split prefills: its engine is started with them.
    open_run(database, {"mode": "tiny", "max_new_tokens": 64, "concurrency": 16, "prefill": "split"}, jobs=9)
    plan = plan_warmup(database, ["q"], "auto", RunOptions())
    assert plan is not None and plan.batch_options() == RunOptions(
        mode="tiny", max_new_tokens=64, concurrency=16, prefill="split"
    )


def test_a_worker_told_its_concurrency_starts_its_batched_engine_at_start(database: Database):
    """`dsocr worker --concurrency 4` (the eager engine on the CPU, its batched step eager): the start-up
    warm-up loads the model, warms it and starts the batched engine, each bucket's step run once, all in
    one worker session whose record says so; a run at that concurrency joins that engine, starting none,
    however it stops its pages."""
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        warmup = Warmup(ModelKey("tiny", "eager"), ("tiny",), (8,), concurrency=4)
        modes_warmed_at_pages_for = []  # what the model had warmed at each call for its page processes
        pages_for = process.pages_for

        def watched_pages_for(session):
            modes_warmed_at_pages_for.append(sorted(process.models.loaded.warmed))
            return pages_for(session)

        process.pages_for = watched_pages_for
        process.warm_at_start(warmup)
        # The page-preparing processes started right after the load, beside the warm-up, not after it.
        assert modes_warmed_at_pages_for[0] == [], modes_warmed_at_pages_for
        batch = process.batch
        assert batch is not None and batch.serves(RunOptions(mode="tiny", max_new_tokens=8, engine="eager",
                                                             concurrency=4, repeats=3))  # fmt: skip
        assert not batch.serves(RunOptions(mode="tiny", max_new_tokens=8, engine="eager", concurrency=2))
        # A run that stops its pages otherwise joins it too (each page brings its rule); one profiled does not.
        assert batch.serves(RunOptions(mode="tiny", max_new_tokens=8, engine="eager", concurrency=4,
                                       ignore_eos=True, stop_on_repetition=True))  # fmt: skip
        assert not batch.serves(RunOptions(mode="tiny", max_new_tokens=8, engine="eager", concurrency=4,
                                           profile_every=2))  # fmt: skip
        assert list(batch.started.captures_ms) == [1, 2, 4] and batch.started.compiled == 0
        with database.transaction() as tx:
            rows = tx.scalars(select(WorkerSession)).all()
        assert len(rows) == 1 and rows[0].load_ms > 0
        assert rows[0].warmup.startswith("tiny (8 tokens); warm-up ")  # its phases, then the batched engine's start
        assert "; batched engine: concurrency 4, 4 slots" in rows[0].warmup
        assert "no CUDA graphs for buckets 1, 2, 4; started in " in rows[0].warmup
        assert "first steps by bucket 1 " in rows[0].warmup and "no graph compiled" in rows[0].warmup
    finally:
        process.close()


def test_a_warm_process_freezes_its_heap_for_the_jobs(database: Database):
    """Once loaded and warm, a process freezes what survives a collection (farm/job/process.py settle_heap):
    a full collection during jobs scans none of it. Closing the process unfreezes it."""
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        unfrozen = gc.get_freeze_count()
        # (a `then` with nothing to say adds no empty part to the worker session's warm-up text)
        process.models.warm(Warmup(ModelKey("tiny"), ("tiny",), (2,), (DEFAULT_NGRAM,)), then=lambda _: "")
        assert gc.get_freeze_count() > unfrozen + 100_000  # the model's, the tokenizer's, torch's own
        with database.transaction() as tx:
            (warmed,) = [row.warmup for row in tx.scalars(select(WorkerSession))]
        # The shapes, then where the warm-up's time went (nothing after it: `then` said nothing).
        assert re.fullmatch(r"tiny \(2 tokens\); warm-up [\d.]+ s \(pass 1 [\d.]+ s[^;]*\)", warmed)
    finally:
        process.close()
    assert gc.get_freeze_count() == 0


def test_a_first_load_leaves_the_imports_frozen_by_the_parent_frozen(database: Database):
    """`dsocr worker`'s parent freezes its imports before it forks (farm/celery/worker.py): a child's first
    load and warm-up keep them frozen, so none of its collections scans them (or copies their pages)."""
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    gc.freeze()  # as the parent did
    frozen, seen = gc.get_freeze_count(), []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(gc.get_freeze_count())

    gc.callbacks.append(watch)
    try:
        process.models.warm(Warmup(ModelKey("tiny"), ("tiny",), (2,), (DEFAULT_NGRAM,)))
    finally:
        gc.callbacks.remove(watch)
        process.close()
    # (a few frozen objects die on their own: their count only dips, it never drops to nothing)
    assert frozen > 100_000 and seen and min(seen) > frozen // 2


def test_warm_up_modes_are_the_warmed_model_s_family_s(database: Database):
    """`dsocr worker --warmup MODES` names modes of the model it warms (the open runs' or --model's): a
    mode only another family has is refused, naming this family's modes."""
    from dsocr_workers.errors import InputError
    from dsocr_workers.model.families import family_of_preset

    ocr2 = RunOptions(model="ocr2-tiny")
    assert plan_warmup(database, ["q"], "small", ocr2).modes == ("small",)
    modes = ", ".join(family_of_preset("ocr2-tiny").modes)
    with pytest.raises(InputError, match=f"modes of DeepSeek-OCR-2 \\(ocr2-tiny\\): {modes}$"):
        plan_warmup(database, ["q"], "gundam,tiny", ocr2)  # tiny: a DeepSeek-OCR mode
    open_run(database, {"mode": "large"})  # an open DeepSeek-OCR run: its model is warmed, and its modes
    assert plan_warmup(database, ["q"], "tiny", ocr2).modes == ("tiny",)
