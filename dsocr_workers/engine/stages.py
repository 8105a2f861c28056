"""Stage timings and NVTX ranges for one inference job (DESIGN §3).

Every stage is an NVTX range in the domain `dsocr` and a timing: CUDA events on a CUDA device, so
asynchronous GPU work is timed on the GPU's own clock, and `time.perf_counter` on the CPU, where the
work is synchronous and a host clock is right. `preprocess` is host work on every device and always
uses the host clock: CUDA events around it would measure the previous job's GPU tail instead.

Nothing here synchronizes until `finish()`, which synchronizes once and turns the events into
milliseconds. Decode steps use events preallocated per clock (pooled across jobs), so a step
boundary costs one `cudaEventRecord` and no allocation.

StageClock is host code: call it around compiled regions, never from inside a function handed to
`torch.compile` or captured into a CUDA graph. The engine's stage boundaries (and `mark_step`) sit in
the Python decode loop, outside the compiled decode step; `stage()` refuses to run while dynamo
traces.

NVTX: messages are registered strings, so a message per stage name costs nothing per call; the job
id goes into the message ("decode [job 42]") because NVTX's classic payloads are numbers only, and
into the int64 payload as well when the id is an integer. With no profiler attached the `nvtx`
package hands out a dummy domain whose push/pop do nothing (see benchmarks/bench_nvtx.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import nvtx
import torch

from dsocr_workers.engine.result import StageTimings

NVTX_DOMAIN = "dsocr"
STAGES = ("preprocess", "prefill", "vision/sam", "vision/clip", "vision/projector", "lm_prefill", "decode")
HOST_STAGES = frozenset({"preprocess"})
VISION_STAGES = ("vision/sam", "vision/clip", "vision/projector")
# `DSOCR_INSTRUMENTATION=0` turns NVTX ranges and timings off for clocks built with the defaults:
# the benchmark's "instrumentation off" arm, without threading a flag through the session.
INSTRUMENTATION_ENV = "DSOCR_INSTRUMENTATION"


def instrumentation_default() -> bool:
    return os.environ.get(INSTRUMENTATION_ENV, "1") != "0"


@dataclass
class _Entry:
    """One entry into a stage: its start/end marks and the entry it was nested in."""

    name: str
    parent: int | None  # index into StageClock.entries
    start: torch.cuda.Event | float | None = None
    end: torch.cuda.Event | float | None = None


# Decode step events are reused across clocks on the same device: building 8k CUDA events per job
# would cost milliseconds. A clock takes a list at construction and gives it back in finish().
_STEP_EVENT_POOL: dict[torch.device, list[list[torch.cuda.Event]]] = {}


def _take_step_events(device: torch.device, capacity: int) -> list[torch.cuda.Event]:
    pool = _STEP_EVENT_POOL.setdefault(device, [])
    events = pool.pop() if pool else []
    events.extend(torch.cuda.Event(enable_timing=True) for _ in range(capacity - len(events)))
    return events


class StageClock:
    """Times and annotates the stages of one job. Use one clock per job:

        clock = StageClock(device, job_id="42")
        with clock.stage("preprocess"): ...
        with clock.stage("prefill"):
            with clock.stage("vision/sam"): ...
            ...
        clock.mark_first_token()
        with clock.stage("decode"):
            clock.mark_step()              # boundary 0
            for _ in range(n):
                step(); clock.mark_step()  # boundary i + 1: step i = boundary i -> i + 1
        clock.finish()                     # the one synchronization
        clock.ms("prefill"), clock.step_ms()
    """

    def __init__(
        self,
        device: torch.device | str,
        job_id: str | None = None,
        nvtx_enabled: bool | None = None,
        timing_enabled: bool | None = None,
        step_capacity: int = 8192,
    ) -> None:
        self.device = torch.device(device)
        self.job_id = job_id
        self.nvtx_enabled = instrumentation_default() if nvtx_enabled is None else nvtx_enabled
        self.timing_enabled = instrumentation_default() if timing_enabled is None else timing_enabled
        self.cuda = self.device.type == "cuda"
        self.entries: list[_Entry] = []
        # Every NVTX push/pop this clock issued, in order, as (kind, stage name): the observable
        # record of the ranges (checked by tests and `dsocr verify`), kept whether or not a profiler
        # is attached to receive them.
        self.nvtx_log: list[tuple[str, str]] = []
        self._open: list[int] = []
        self._domain = nvtx.get_domain(NVTX_DOMAIN)
        self._attributes: dict[str, object] = {}
        self._first_token: torch.cuda.Event | float | None = None
        self._n_steps = 0
        self._step_host: list[float] = []
        self._step_events: list[torch.cuda.Event] = []
        if self.cuda and self.timing_enabled:
            self._step_events = _take_step_events(self.device, step_capacity)
        self._resolved: dict[str, float] | None = None
        self._step_ms: list[float] = []
        self._ttft_ms = 0.0
        self._e2e_ms = 0.0

    # ---- marks -----------------------------------------------------------------------------------

    def _now(self, host: bool) -> torch.cuda.Event | float:
        if self.cuda and not host:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _nvtx_attributes(self, name: str) -> object:
        attributes = self._attributes.get(name)
        if attributes is None:
            job = self.job_id
            message = name if job is None else f"{name} [job {job}]"
            payload = int(job) if job is not None and job.isdigit() and len(job) <= 18 else None  # int64
            attributes = self._domain.get_event_attributes(message=message, payload=payload)
            self._attributes[name] = attributes
        return attributes

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
        if torch.compiler.is_compiling():
            raise RuntimeError("StageClock.stage() must sit outside compiled regions")
        if self._resolved is not None:
            raise RuntimeError("StageClock.finish() was already called")
        index = len(self.entries)
        entry = _Entry(name, self._open[-1] if self._open else None)
        self.entries.append(entry)
        self._open.append(index)
        if self.nvtx_enabled:
            self._domain.push_range(self._nvtx_attributes(name))
            self.nvtx_log.append(("push", name))
        if self.timing_enabled:
            entry.start = self._now(name in HOST_STAGES)
        try:
            yield
        finally:
            if self.timing_enabled:
                entry.end = self._now(name in HOST_STAGES)
            if self.nvtx_enabled:
                self._domain.pop_range()
                self.nvtx_log.append(("pop", name))
            self._open.pop()

    def mark_step(self) -> None:
        """A decode step boundary. Records one preallocated CUDA event (no sync, no allocation
        unless more than `step_capacity` boundaries are marked), or reads perf_counter on the CPU."""
        if not self.timing_enabled:
            self._n_steps += 1
            return
        if self.cuda:
            if self._n_steps == len(self._step_events):
                self._step_events.append(torch.cuda.Event(enable_timing=True))
            self._step_events[self._n_steps].record(torch.cuda.current_stream(self.device))
        else:
            self._step_host.append(time.perf_counter())
        self._n_steps += 1

    def mark_first_token(self) -> None:
        """The point where the first token has been chosen from the prefill logits (end of TTFT)."""
        if self.timing_enabled:
            self._first_token = self._now(host=False)

    # ---- results ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Synchronize once and resolve every mark into milliseconds. Idempotent."""
        if self._resolved is not None:
            return
        if self._open:
            raise RuntimeError(f"stages still open: {[self.entries[i].name for i in self._open]}")
        if self.cuda:
            torch.cuda.synchronize(self.device)
        totals = dict.fromkeys(STAGES, 0.0)
        if self.timing_enabled:
            for entry in self.entries:
                totals[entry.name] += self._elapsed(entry.start, entry.end)
            if self.cuda:
                marks = self._step_events[: self._n_steps]
                self._step_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]
            else:
                marks_s = self._step_host
                self._step_ms = [(b - a) * 1e3 for a, b in zip(marks_s, marks_s[1:], strict=False)]
            self._ttft_ms, self._e2e_ms = self._ttft_and_e2e(totals["preprocess"])
        if self.cuda and self.timing_enabled:
            _STEP_EVENT_POOL.setdefault(self.device, []).append(self._step_events)
            self._step_events = []
        self._resolved = totals

    def _elapsed(self, start: torch.cuda.Event | float | None, end: torch.cuda.Event | float | None) -> float:
        if isinstance(start, float) and isinstance(end, float):
            return (end - start) * 1e3
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return start.elapsed_time(end)
        raise RuntimeError("a stage has no start or end mark")

    def _ttft_and_e2e(self, preprocess_ms: float) -> tuple[float, float]:
        """TTFT = preprocess + (first GPU-clock stage start -> first token chosen); e2e likewise to the
        end of the last stage. Preprocess is host work that precedes the GPU work of the job."""
        gpu = [e for e in self.entries if e.name not in HOST_STAGES]
        if not gpu:
            return preprocess_ms, preprocess_ms
        first = gpu[0].start
        last = max(gpu, key=lambda e: self._elapsed(first, e.end)).end
        ttft = preprocess_ms
        if self._first_token is not None:
            ttft += self._elapsed(first, self._first_token)
        return ttft, preprocess_ms + self._elapsed(first, last)

    def _require_finished(self) -> dict[str, float]:
        if self._resolved is None:
            raise RuntimeError("call StageClock.finish() first")
        return self._resolved

    def ms(self, name: str) -> float:
        """Total milliseconds spent in a stage (summed over its entries; 0.0 if never entered)."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}")
        return self._require_finished()[name]

    def step_ms(self) -> list[float]:
        """Per decode step milliseconds: boundary i -> i + 1 for consecutive `mark_step` calls."""
        self._require_finished()
        return list(self._step_ms)

    @property
    def steps_marked(self) -> int:
        return self._n_steps

    def count(self, name: str) -> int:
        """How many times a stage was entered (e.g. the vision stages: exactly once per job)."""
        return sum(1 for e in self.entries if e.name == name)

    def nesting_ok(self) -> bool:
        """Every nested stage lies within its parent's interval, and its time within the parent's.
        Host-clock stages can only be compared with host-clock parents and vice versa."""
        self._require_finished()
        if not self.timing_enabled:
            return True
        for entry in self.entries:
            if entry.parent is None:
                continue
            parent = self.entries[entry.parent]
            if (entry.name in HOST_STAGES) != (parent.name in HOST_STAGES):
                continue
            if self._elapsed(parent.start, entry.start) < 0 or self._elapsed(entry.end, parent.end) < 0:
                return False
        return True

    def stage_timings(self) -> StageTimings:
        totals = self._require_finished()
        return StageTimings(
            clock="cuda_event" if self.cuda else "perf_counter",
            preprocess_ms=totals["preprocess"],
            prefill_ms=totals["prefill"],
            vision_ms=sum(totals[name] for name in VISION_STAGES),
            sam_ms=totals["vision/sam"],
            clip_ms=totals["vision/clip"],
            projector_ms=totals["vision/projector"],
            lm_prefill_ms=totals["lm_prefill"],
            decode_ms=totals["decode"],
            decode_step_ms=list(self._step_ms),
            ttft_ms=self._ttft_ms,
            e2e_ms=self._e2e_ms,
        )
