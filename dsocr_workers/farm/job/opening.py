"""Opening a job process's model: loading it, warming it up, and the `worker_sessions` row that records
what that cost. Reached at process start and before a job's claim (`JobProcess.prepare_for`), never from
a job: a claimed job whose model is not open goes back in line (`NotOpen`), and no job's time holds a
load or a warm-up."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, TypeVar

from dsocr_workers.errors import TransientError
from dsocr_workers.farm.job.fingerprint import environment_fingerprint
from dsocr_workers.farm.job.loaded import OpenModel
from dsocr_workers.farm.job.warm import DEFAULT_NGRAM, Warmup, job_warmup, ngram_options
from dsocr_workers.farm.run_options import ModelKey, NGram, RunOptions
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import Worker, WorkerSession, utcnow
from dsocr_workers.store.upsert import upsert

log = logging.getLogger("dsocr.worker")


class Described(Protocol):
    def describe(self) -> str: ...


Warming = TypeVar("Warming", bound=Described)


class NotOpen(TransientError):
    """A claimed job's model is not open in this process: the job is given back without counting an
    attempt, and its model is opened before its next claim."""


def settle_heap() -> None:
    """Once the model is loaded and warm: collect, then freeze what survives (a load and a warm-up leave
    about a million long-lived objects), so that no full collection in the middle of a run scans them
    again and holds the process between two jobs."""
    gc.collect()
    gc.freeze()


def unwarmed(loaded: OpenModel, warmup: Warmup) -> list[tuple[str, int | None, NGram]]:
    """The (mode, budget, n-gram ban) combinations of `warmup` that `loaded` has not warmed yet."""
    return [
        (mode, budget, ngram)
        for budget in warmup.budgets
        for ngram in warmup.ngrams
        for mode in warmup.modes
        if (mode, budget, ngram) not in loaded.warmed
    ]


@dataclass
class ModelOpener:
    """The model a job process has open, and what opening it cost, as `worker_sessions` rows."""

    db: Database
    owner: str
    device: str  # as the ledger names it
    runs_on: str  # as this process sees it
    register: Callable[[], None]  # the process's `worker_processes` row, before a worker session points at it
    # What the process's start spent importing: its first worker session's, 0 on the later ones (None:
    # not measured).
    import_ms: float | None = None
    loaded: OpenModel | None = None
    # Why the latest opening of a model (or a run's batch) failed: its jobs fail with it, not go back in line.
    failures: dict[ModelKey | RunOptions, Exception] = field(default_factory=dict)

    @property
    def loaded_key(self) -> ModelKey | None:
        return None if self.loaded is None else self.loaded.key

    def is_warm_for(self, options: RunOptions) -> bool:
        return self.is_warm(job_warmup(options))

    def warm_for(self, options: RunOptions) -> OpenModel:
        """What a job of a run with `options` needs: its model, mode, token budget and n-gram ban."""
        return self.warm(job_warmup(options))

    def warm_up(self, options: RunOptions, loaded: OpenModel, start: Callable[[], Warming]) -> Warming:
        """`start()` a warm-up of `loaded` for a run with `options` (its batched engine), recorded as a
        worker session that says what it made (`describe()`)."""
        began_at, began = utcnow(), time.perf_counter()
        try:
            made = start()
        except Exception as exc:
            self.failures[options] = exc
            raise
        self.failures.pop(options, None)
        self.record(loaded, made.describe(), began_at, 0.0, (time.perf_counter() - began) * 1e3)
        return made

    def is_warm(self, warmup: Warmup) -> bool:
        """Whether `warm(warmup)` would do nothing: its model loaded, every mode and budget warmed."""
        loaded = self.loaded
        return loaded is not None and loaded.key == warmup.key and not unwarmed(loaded, warmup)

    def opened(self, key: ModelKey) -> OpenModel:
        """The open model a job runs on; raises NotOpen, or why opening it failed."""
        if self.loaded is not None and self.loaded.key == key:
            return self.loaded
        if key in self.failures:
            raise self.failures[key]
        log.warning("%s is not open in this process; the job goes back in line to be opened first", key.model)
        raise NotOpen(f"{key.model} is not open in this process")

    def warm(
        self,
        warmup: Warmup,
        then: Callable[[OpenModel], str] | None = None,
        on_load: Callable[[OpenModel], None] | None = None,
    ) -> OpenModel:
        """Load `warmup.key` unless it is loaded, run the warm-up of whatever mode and budget it has not
        met yet, and record the cost as a new worker session; a no-op when all is warm already. `then`:
        what the process starts on the warm model before it is ready (a worker's batched engine), its
        time and what it says of itself in the same worker session; `on_load`: what it starts on a model
        it has just loaded, to run beside the warm-up."""
        try:
            loaded = self._warm(warmup, then, on_load)
        except Exception as exc:
            self.failures[warmup.key] = exc
            raise
        self.failures.pop(warmup.key, None)
        return loaded

    def _warm(
        self,
        warmup: Warmup,
        then: Callable[[OpenModel], str] | None,
        on_load: Callable[[OpenModel], None] | None,
    ) -> OpenModel:
        from dsocr_workers.engine.coldstart.warmup import warm as run_warmup

        began_at, began = utcnow(), time.perf_counter()
        load_ms = 0.0
        if self.loaded is None or self.loaded.key != warmup.key:
            if self.loaded is not None:
                # The previous model's objects may be collected again (settle_heap). Before a first load
                # the frozen ones are `dsocr worker`'s imports: left frozen, never scanned nor copied.
                gc.unfreeze()
            self.loaded = None  # free the previous model before loading the next one
            self.loaded = self._load(warmup.key)
            load_ms = (time.perf_counter() - began) * 1e3
            if on_load is not None:
                on_load(self.loaded)
        loaded = self.loaded
        missing = unwarmed(loaded, warmup)
        if not missing and not load_ms:
            return loaded
        warmup_ms, shapes, cold_start = 0.0, [], []
        for budget, ngram in dict.fromkeys((budget, ngram) for _, budget, ngram in missing):
            modes = [mode for mode, b, n in missing if (b, n) == (budget, ngram)]
            report = run_warmup(
                loaded.session, modes, max_new_tokens=budget, infer=ngram_options(ngram),
                concurrency=warmup.concurrency,
            )  # fmt: skip
            warmup_ms += report.ms
            if report.artifacts:  # prebuilt artifacts used, or why not (logged by the warm-up)
                cold_start.append(report.artifacts)
            cold_start.append(report.describe())
            if report.still_cold:  # the first jobs may be stored cold: say why here, once
                log.warning(
                    "warm-up of %s stopped after %d passes still meeting: %s",
                    ", ".join(modes),
                    report.passes,
                    "; ".join(report.still_cold),
                )
            ban = (
                ""
                if ngram == DEFAULT_NGRAM
                else f", no-repeat {ngram[0]}-grams" + (f" in {ngram[1]}" if ngram[1] else "")
            )
            shapes += [f"{shape} ({budget or 'max'} tokens{ban})" for shape in report.shapes]
            loaded.warmed.update((mode, budget, ngram) for mode in modes)
        settling = time.perf_counter()
        if then is not None:
            cold_start.append(then(loaded))
        settle_heap()
        warmup_ms += (time.perf_counter() - settling) * 1e3
        parts = [", ".join(shapes), *cold_start]  # no empty part (a load meeting no new shape, a silent `then`)
        self.record(loaded, "; ".join(part for part in parts if part), began_at, load_ms, warmup_ms)
        return loaded

    def record(
        self, loaded: OpenModel, warmup: str, began_at: datetime, load_ms: float, warmup_ms: float
    ) -> None:
        """Record what was just loaded or warmed as a new worker session, ready now: the jobs after it
        point at it, and the report counts them from its `ready_at` on."""
        self.register()
        row = WorkerSession(
            id=uuid.uuid4().hex,
            worker_id=loaded.worker_id,
            worker_process_id=self.owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=self.device,
            model=loaded.key.model,
            engine=loaded.session.engine_name,
            dtype=loaded.dtype,
            warmup=warmup,
            started_at=began_at,
            import_ms=self.import_ms,
            load_ms=load_ms,
            warmup_ms=warmup_ms,
            ready_at=utcnow(),
            last_seen_at=utcnow(),
        )
        with self.db.transaction() as tx:
            tx.add(row)
        loaded.worker_session_id = row.id
        if self.import_ms is not None:
            self.import_ms = 0.0

    def _load(self, key: ModelKey) -> OpenModel:
        from dsocr_workers.engine.session import DeepSeekOCRSession

        session = DeepSeekOCRSession.from_local(
            key.model, device=self.runs_on, dtype=key.dtype, engine=key.engine, seed=key.seed
        )
        fingerprint = environment_fingerprint(self.device, session.source, runs_on=self.runs_on)
        with self.db.transaction() as tx:
            upsert(tx, Worker, {**fingerprint, "last_seen": utcnow()}, ["id"], ["last_seen"])
        return OpenModel(key, session, fingerprint["id"], worker_session_id="")
