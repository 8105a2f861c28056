"""What a worker process loads and warms before it takes a job, and the record of it.

Loading a model and warming it up (eager: every page shape once; fast: compilation and graph capture
for every shape of the modes named) belong to the worker, never to a job: the time goes into a
`worker_sessions` row, and a job's timings start only after its session is ready.

Two moments: at process start (`dsocr worker --warmup`), for the runs open on the worker's queues;
and before a job is claimed, when its run asks for a model or mode this process has not warmed (a run
submitted after the worker started). Either way no job pays for it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants import AUTO
from dsocr_workers.errors import InputError
from dsocr_workers.model.config import MODES
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Job, Run

WARMUP_ENV = "DSOCR_WORKER_WARMUP"  # the plan, as JSON, from `dsocr worker` to its children
# What users run most (the vendor's default mode) when nothing else says what to warm.
DEFAULT_WARMUP_MODES = ("gundam",)


@dataclass(frozen=True)
class ModelKey:
    """The settings that make one loaded model (a worker process holds one at a time)."""

    model: str
    engine: str = AUTO
    dtype: str | None = None
    seed: int = 0

    @classmethod
    def of_run(cls, model: str, parameters: dict[str, Any]) -> ModelKey:
        return cls(model, parameters.get("engine", AUTO), parameters.get("dtype"), parameters.get("seed", 0))


# A run's no-repeat n-gram ban as the compiled decode step sees it: (size, window); the vendor's default.
NGram = tuple[int, int | None]
DEFAULT_NGRAM: NGram = (DecodeOptions.no_repeat_ngram_size, DecodeOptions.ngram_window)


def run_ngram(parameters: dict[str, Any]) -> NGram:
    return (parameters.get("no_repeat_ngram_size", DEFAULT_NGRAM[0]), parameters.get("ngram_window", DEFAULT_NGRAM[1]))


@dataclass(frozen=True)
class Warmup:
    """Modes to warm for one model, with the token budgets that size its KV cache buckets (None: the
    model's positions) and the n-gram bans its decode step is compiled for (a run without the ban met
    a decode step warmed with it and compiled on its first job: 14.8 s on an H200)."""

    key: ModelKey
    modes: tuple[str, ...]
    budgets: tuple[int | None, ...] = (None,)
    ngrams: tuple[NGram, ...] = (DEFAULT_NGRAM,)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Warmup:
        data = json.loads(text)
        return cls(ModelKey(**data["key"]), tuple(data["modes"]), tuple(data["budgets"]),
                   tuple((size, window) for size, window in data["ngrams"]))  # fmt: skip


def parse_modes(spec: str) -> tuple[str, ...] | None:
    """`auto` → None (decided from the open runs), `none` → (), else a comma list of mode names."""
    text = spec.strip().lower()
    if text == "auto":
        return None
    if text == "none":
        return ()
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise InputError(f"--warmup {spec!r}: expected auto, none, or modes from {', '.join(MODES)}")
    return modes


def plan_warmup(
    db: Database, queues: list[str], spec: str, fallback: ModelKey, fallback_budget: int | None = None
) -> Warmup | None:
    """The start-up warm-up: the model of the run with the most open jobs on these queues (else
    `fallback` with `fallback_budget` tokens), and the modes `spec` names, or with `auto` the modes of
    that model's open runs (else DEFAULT_WARMUP_MODES). None with `--warmup none`."""
    modes = parse_modes(spec)
    if modes == ():
        return None
    with db.transaction() as session:
        counts = dict(session.execute(
            select(Job.run_id, func.count())
            .join(Run, Job.run_id == Run.id)
            .where(Run.queue.in_(queues), Job.state.in_(("queued", "running")))
            .group_by(Job.run_id)
        ).all())  # fmt: skip
        rows = session.execute(select(Run.id, Run.model, Run.parameters).where(Run.id.in_(counts))).all()
    open_jobs: Counter[ModelKey] = Counter()
    for run_id, model, parameters in rows:
        open_jobs[ModelKey.of_run(model, parameters)] += counts[run_id]
    if not open_jobs:
        return Warmup(fallback, modes or DEFAULT_WARMUP_MODES, (fallback_budget,))
    key = open_jobs.most_common(1)[0][0]
    runs = [parameters for _, model, parameters in rows if ModelKey.of_run(model, parameters) == key]
    if modes is None:
        modes = tuple(dict.fromkeys(p.get("mode", "gundam") for p in runs))
    return Warmup(key, modes, tuple(dict.fromkeys(p.get("max_new_tokens") for p in runs)),
                  tuple(dict.fromkeys(run_ngram(p) for p in runs)))  # fmt: skip


def plan_from_env() -> Warmup | None:
    text = os.environ.get(WARMUP_ENV)
    return Warmup.from_env(text) if text else None
