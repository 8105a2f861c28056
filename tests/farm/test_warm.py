"""What a worker warms at start: the model, modes, token budgets and n-gram bans of the runs open on its
queues (farm/job/warm.py), read from the real ledger, and carried to the children through the environment."""

from __future__ import annotations

import gc
import uuid

from dsocr_workers.farm.job.process import JobProcess
from dsocr_workers.farm.job.warm import DEFAULT_NGRAM, Warmup, plan_warmup
from dsocr_workers.farm.run_options import ModelKey
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Job, Run, job_id_for


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
    assert plan_warmup(database, ["q"], "auto", fallback, 64) == Warmup(fallback, ("gundam",), (64,), (DEFAULT_NGRAM,))
    # A run with the vendor's ban, one without it and one windowed: the fast engine's decode step is a
    # graph per ban, so each is warmed (a run the warm-up missed compiled on its first job).
    open_run(database, {"mode": "base", "max_new_tokens": 128}, jobs=3)
    open_run(database, {"mode": "base", "max_new_tokens": 128, "no_repeat_ngram_size": 0})
    open_run(database, {"mode": "tiny", "max_new_tokens": 256, "no_repeat_ngram_size": 20, "ngram_window": 90})
    open_run(database, {"mode": "large", "no_repeat_ngram_size": 3}, queue="elsewhere")
    plan = plan_warmup(database, ["q"], "auto", fallback)
    assert plan is not None and plan.key == fallback  # the runs' model (the same preset here)
    # (the order is the ledger's)
    assert set(plan.modes) == {"base", "tiny"} and set(plan.budgets) == {128, 256}
    assert set(plan.ngrams) == {(20, None), (0, None), (20, 90)}


def test_a_warm_process_freezes_its_heap_for_the_jobs(database: Database):
    """Once loaded and warm, a process freezes what survives a collection (farm/job/process.py settle_heap):
    a full collection during jobs scans none of it. Closing the process unfreezes it."""
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        unfrozen = gc.get_freeze_count()
        process.models.warm(Warmup(ModelKey("tiny"), ("tiny",), (2,), (DEFAULT_NGRAM,)))
        assert gc.get_freeze_count() > unfrozen + 100_000  # the model's, the tokenizer's, torch's own
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
