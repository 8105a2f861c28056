"""What a worker process warms before it takes a job (farm/job/opening.py does it): at process start
(`dsocr worker --warmup --concurrency`), the modes of the runs open on its queues and the batched engine
of the concurrency they (or the worker) serve; before a job's claim, what its run needs. Either way no
job pays for it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlalchemy import func, select

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.errors import InputError
from dsocr_workers.farm.run_options import ModelKey, NGram, RunOptions
from dsocr_workers.model.families import family_of_model
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Job, Run


def default_modes(model: str) -> tuple[str, ...]:
    """What users run most (the vendor's default mode of the model's family) when nothing else says what
    to warm."""
    return (family_of_model(model).default_mode,)


# The vendor's n-gram ban (RunOptions' default), the one a warm-up compiles for when no run says otherwise.
DEFAULT_NGRAM: NGram = RunOptions().ngram


@dataclass(frozen=True)
class Warmup:
    """Modes to warm for one model, with the token budgets that size its KV cache buckets (None: the
    model's positions) and the n-gram bans its decode step is compiled for (the compiled step is
    specialised on the ban: a run with another one would compile on its first job). `concurrency` above
    1: the batched engine is started too, for the first mode, budget and ban (`batch_options`), and the
    artifacts looked up are those built for that concurrency; `prefill`: its prefills
    (RunOptions')."""

    key: ModelKey
    modes: tuple[str, ...]
    budgets: tuple[int | None, ...] = (None,)
    ngrams: tuple[NGram, ...] = (DEFAULT_NGRAM,)
    concurrency: int = 1
    prefill: str = "split"

    def batch_options(self) -> RunOptions:
        """The run options of the batched engine this warm-up starts (`concurrency` above 1)."""
        key, (size, window) = self.key, self.ngrams[0]
        return RunOptions(
            model=key.model, engine=key.engine, dtype=key.dtype, seed=key.seed, mode=self.modes[0],
            max_new_tokens=self.budgets[0], no_repeat_ngram_size=size, ngram_window=window,
            concurrency=self.concurrency, prefill=self.prefill,
        )  # fmt: skip


def job_warmup(options: RunOptions) -> Warmup:
    """What one job needs warm: its run's model, mode, token budget and n-gram ban (and the artifacts of
    its concurrency)."""
    return Warmup(
        options.model_key, (options.mode_name,), (options.max_new_tokens,), (options.ngram,), options.concurrency
    )


def ngram_options(ngram: NGram) -> DecodeOptions:
    """The decode options a warm-up of jobs with this n-gram ban runs with: the same in the build step's
    plan and in the worker's warm-up, or the worker finds no artifacts for its plan."""
    return DecodeOptions(no_repeat_ngram_size=ngram[0], ngram_window=ngram[1])


def parse_modes(spec: str, model: str) -> tuple[str, ...] | None:
    """`auto` → None (decided from the open runs), `none` → (), else a comma list of modes of `model`'s
    family (an InputError naming them otherwise)."""
    text = spec.strip().lower()
    if text == "auto":
        return None
    if text == "none":
        return ()
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    family = family_of_model(model)
    unknown = [mode for mode in modes if mode not in family.modes]
    if unknown or not modes:
        raise InputError(
            f"--warmup {spec!r}: expected auto, none, or modes of {family.title} ({model}): "
            f"{', '.join(family.modes)}"
        )
    return modes


def plan_warmup(
    db: Database,
    queues: list[str],
    spec: str,
    fallback: RunOptions,
) -> Warmup | None:
    """The start-up warm-up: the model of the run with the most open jobs on these queues (else the
    `fallback` runs': their model, token budget, ban, concurrency and prefills), and the modes
    `spec` names, or with `auto` the modes of that model's open runs (else `default_modes`); the
    concurrency and prefills of its run with the most open jobs. None with `--warmup none`."""
    if spec.strip().lower() == "none":
        return None
    with db.transaction() as tx:
        counts = dict(
            tx.execute(
                select(Job.run_id, func.count())
                .join(Run, Job.run_id == Run.id)
                .where(Run.queue.in_(queues), Job.state.in_(("queued", "running")))
                .group_by(Job.run_id)
            ).all()
        )
        rows = tx.execute(select(Run.id, Run.model, Run.parameters).where(Run.id.in_(counts))).all()
    runs = [RunOptions.from_parameters(model, parameters) for _, model, parameters in rows]
    open_jobs: Counter[ModelKey] = Counter()
    for (run_id, _, _), options in zip(rows, runs, strict=True):
        open_jobs[options.model_key] += counts[run_id]
    if not open_jobs:
        fallback_modes = parse_modes(spec, fallback.model) or default_modes(fallback.model)
        return Warmup(
            fallback.model_key, fallback_modes, (fallback.max_new_tokens,), (fallback.ngram,),
            fallback.concurrency, fallback.prefill,
        )  # fmt: skip
    key = open_jobs.most_common(1)[0][0]
    modes = parse_modes(spec, key.model)  # the modes of the model warmed
    largest = max(
        ((counts[run_id], options) for (run_id, _, _), options in zip(rows, runs, strict=True)
         if options.model_key == key), key=lambda pair: (pair[0], pair[1].concurrency),
    )[1]  # fmt: skip
    # The largest run first (of equal ones the most concurrent: a batch-1 run needs no engine started):
    # its mode, budget and ban are the batched engine's (`Warmup.batch_options`).
    runs = [largest, *(options for options in runs if options.model_key == key and options is not largest)]
    if modes is None:
        modes = tuple(dict.fromkeys(options.mode_name for options in runs))
    return Warmup(
        key,
        modes,
        tuple(dict.fromkeys(options.max_new_tokens for options in runs)),
        tuple(dict.fromkeys(options.ngram for options in runs)),
        largest.concurrency,
        largest.prefill,
    )
