"""A batched engine's steps as `batch_steps` rows: every engine step (prefill or decode, occupancy, bucket,
start and duration on the device), once per run whose jobs it served. The engine's thread takes the
engine's new steps after each of its steps and hands them to the results thread `STEPS_PER_WRITE` at a
time, and once the batch has drained or failed: one insert there, none on the device's thread. A step
the engine's profiler sampled (a `--profile N` run) is flagged, its profile collected on the engine's
thread as the step is taken and written with it (`profiles`): on the results thread the collection would
hold the GIL while the engine launches the next steps, stretching their timings."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from dsocr_workers.farm.job.columns import profile_row
from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.job.loaded import OpenModel
from dsocr_workers.store import ledger
from dsocr_workers.store.models import utcnow

if TYPE_CHECKING:  # the engine imports torch: the lane's parent imports this module and never torch
    from dsocr_workers.engine.batched import StepEvents, StepRecord
    from dsocr_workers.engine.profiling import StepProfiler
    from dsocr_workers.engine.result import ProfileCapture

# Steps handed to the results thread at once: one insert of small rows every few hundred steps, and the
# steps a killed child loses with its batch stay few.
STEPS_PER_WRITE = 256


@dataclass(frozen=True)
class ServedStep:
    """An engine step and a run whose jobs it served (runs with the same settings share a batch)."""

    run_id: str
    record: StepRecord
    profile: ProfileCapture | None = None  # run under torch.profiler: its profile, collected


def step_rows(steps: list[ServedStep], worker_session_id: str) -> list[dict[str, Any]]:
    """The `batch_steps` rows of `steps`, their perf_counter times made UTC times as a result's device
    span is (farm/job/columns.py `device_columns`); a sampled step's with its profile (ledger.PROFILE)."""
    now_s, now = time.perf_counter(), utcnow()
    rows = []
    for step in steps:
        record, prefill = step.record, step.record.kind != "decode"
        rows.append(
            {
                "run_id": step.run_id,
                "worker_session_id": worker_session_id,
                "step_index": record.index,
                "kind": record.kind,
                "occupancy": record.occupancy,
                "bucket": record.bucket,
                "started_at": now - timedelta(seconds=now_s - record.started_s),
                "duration_ms": record.ms,
                "prompt_tokens": record.prompt_tokens if prefill else None,
                "vision_ms": record.vision_ms if prefill else None,
                "kv_positions": None if prefill else record.kv_positions,
                "kv_longest": None if prefill else record.kv_longest,
                "profiled": step.profile is not None,
            }
        )
        if step.profile is not None:
            rows[-1][ledger.PROFILE] = profile_row(step.profile)
    return rows


class StepLog:
    """(The engine's thread.) The steps taken from the engine and not yet handed to the results thread."""

    def __init__(
        self, ledger_threads: LedgerThreads, loaded: OpenModel, profiler: StepProfiler | None
    ) -> None:
        self._ledger_threads, self._loaded = ledger_threads, loaded  # its latest worker session: the batch's
        self._profiler = profiler  # the engine's, whose sampled steps' profiles are taken with the steps
        self._steps: list[ServedStep] = []
        self._last_runs: tuple[str, ...] = ()  # the runs of the latest step taken

    def take(self, records: list[StepRecord], events: StepEvents, run_of: dict[str, str]) -> None:
        """The engine's new steps (`records`, emptied here: it does not grow with the batch's life), read
        back in the call that returned `events`, each with the runs it served:
        a prefill's (or a part's), its page's run; otherwise those of the pages it gave a token (a token
        event carries the end of the step that produced it); a step that gave none (launched for pages
        whose EOS was read back only after it) is the previous step's runs'. `run_of`: each job in
        flight's run."""
        taken = list(records)
        records.clear()
        runs_at: dict[float, set[str]] = {}
        for token in events.tokens:
            runs_at.setdefault(token.at_s, set()).add(run_of[token.request_id])
        for record in taken:
            if record.request_id in run_of:
                self._last_runs = (run_of[record.request_id],)
            elif record.ended_s in runs_at:
                self._last_runs = tuple(sorted(runs_at[record.ended_s]))
            sampled = self._profiler.take(record.index) if self._profiler is not None else None
            profile = sampled.collect(record.ms) if sampled is not None else None
            self._steps += [ServedStep(run_id, record, profile) for run_id in self._last_runs]

    def write(self, *, when_full: bool = False) -> None:
        """Hand the steps taken so far to the results thread (`when_full`: only `STEPS_PER_WRITE` or more)."""
        if self._steps and (not when_full or len(self._steps) >= STEPS_PER_WRITE):
            steps, self._steps = self._steps, []
            self._ledger_threads.record_steps(partial(step_rows, steps, self._loaded.worker_session_id))
