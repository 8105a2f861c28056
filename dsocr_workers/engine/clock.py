"""Stage timings and NVTX ranges for one inference job: the stage clock.

Every stage (named in the registry, dsocr_workers/stages.py) is an NVTX range in the domain `dsocr` and
a timing: CUDA events on a CUDA device, so GPU work is timed on the GPU's clock, `time.perf_counter` on
the CPU and for host stages (`preprocess`, `postprocess`). End-to-end is the host time from entering the
first stage to leaving the last; what no part covers is `host_gap`. `page_wait` (a page prepared ahead
waiting for its job) is left out of end-to-end. The job's span on the device (`DeviceSpan`) is in host
time, comparable across a process's jobs.

Nothing synchronizes until `finish()`. Decode steps use events pooled across clocks, so a step boundary
costs one `cudaEventRecord`. A clock is host code: never call it inside a compiled or captured function
(`stage()` refuses while dynamo traces). The session decides whether its clocks instrument.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import nvtx
import torch

from dsocr_workers.engine.result import DeviceSpan
from dsocr_workers.stages import HOST_STAGES, JOB_PARTS, STAGES, TIMINGS, VISION_STAGES, StageTimings

if TYPE_CHECKING:
    from dsocr_workers.engine.profiling import JobProfiler

NVTX_DOMAIN = "dsocr"


@dataclass
class _Entry:
    """One entry into a stage: its start/end marks and the entry it was nested in."""

    name: str
    parent: int | None  # index into StageClock.entries
    start: torch.cuda.Event | float | None = None
    end: torch.cuda.Event | float | None = None
    # perf_counter at entry and exit whatever the stage's clock: end-to-end is a host interval.
    host_start: float = 0.0
    host_end: float = 0.0


# Decode step events are reused across clocks on the same device, rather than `STEP_CAPACITY` new CUDA
# events per job: a clock takes a list at construction and gives it back in finish().
_STEP_EVENT_POOL: dict[torch.device, list[list[torch.cuda.Event]]] = {}
# Step boundaries a clock holds events for: a batch-1 job's decode steps at the largest token budget.
STEP_CAPACITY = 8192


def _take_step_events(device: torch.device, capacity: int) -> list[torch.cuda.Event]:
    pool = _STEP_EVENT_POOL.setdefault(device, [])
    events = pool.pop() if pool else []
    events.extend(torch.cuda.Event(enable_timing=True) for _ in range(capacity - len(events)))
    return events


class StageClock:
    """Times and annotates the stages of one job. Use one clock per job:

        clock = StageClock(device, job_id="42")
        with clock.stage("preprocess"): ...
        with clock.stage("setup"): ...
        with clock.stage("prefill"):
            with clock.stage("vision/sam"): ...
            ...
        with clock.stage("first_token"): ...
        with clock.stage("decode"):
            clock.mark_step()              # boundary 0
            for _ in range(n):
                step(); clock.mark_step()  # boundary i + 1: step i = boundary i -> i + 1
        with clock.stage("readback"): ...  # waits for the device
        with clock.stage("postprocess"): ...
        clock.finish()                     # resolves the events (a no-op wait after a readback)
        clock.ms("prefill"), clock.step_ms(), clock.stage_timings(kept_steps)

    `stages`: the stages of the job's model (stages.model_stages); the others, another model family's,
    are refused and None in its timings. Default: every stage.
    """

    def __init__(
        self,
        device: torch.device | str,
        job_id: str | None = None,
        nvtx_enabled: bool = True,
        timing_enabled: bool = True,
        step_capacity: int = STEP_CAPACITY,
        stages: tuple[str, ...] = STAGES,
    ) -> None:
        self.device = torch.device(device)
        self.stages = stages
        self.job_id = job_id
        self.nvtx_enabled = nvtx_enabled
        self.timing_enabled = timing_enabled
        self.cuda = self.device.type == "cuda"
        self.entries: list[_Entry] = []
        # Every NVTX push/pop this clock issued, in order, as (kind, stage name): the record `dsocr
        # verify` checks, kept whether or not a profiler is attached.
        self.nvtx_log: list[tuple[str, str]] = []
        self._open: list[int] = []
        self._domain = nvtx.get_domain(NVTX_DOMAIN)
        self._attributes: dict[str, object] = {}
        self._n_steps = 0
        self._step_host: list[float] = []
        self._step_events: list[torch.cuda.Event] = []
        if self.cuda and self.timing_enabled and step_capacity:
            self._step_events = _take_step_events(self.device, step_capacity)
        self._resolved: dict[str, float] | None = None
        self._step_ms: list[float] = []
        self._ttft_from_device_start_ms = 0.0
        self._device_span: DeviceSpan | None = None
        # A profiled job's profiler, set by the session: its ranges open around the stages.
        self.profiler: JobProfiler | None = None

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
        if name not in self.stages:
            raise ValueError(f"unknown stage {name!r}; this model's stages are {', '.join(self.stages)}")
        if torch.compiler.is_compiling():
            raise RuntimeError("StageClock.stage() must sit outside compiled regions")
        if self._resolved is not None:
            raise RuntimeError("StageClock.finish() was already called")
        with self.profiler.stage(name) if self.profiler is not None else nullcontext(), self._marked(name):
            yield

    @contextmanager
    def _marked(self, name: str) -> Iterator[None]:
        index = len(self.entries)
        entry = _Entry(name, self._open[-1] if self._open else None)
        self.entries.append(entry)
        self._open.append(index)
        if self.nvtx_enabled:
            self._domain.push_range(self._nvtx_attributes(name))
            self.nvtx_log.append(("push", name))
        if self.timing_enabled:
            entry.host_start = time.perf_counter()
            entry.start = self._now(name in HOST_STAGES)
        try:
            yield
        finally:
            if self.timing_enabled:
                entry.end = self._now(name in HOST_STAGES)
                entry.host_end = time.perf_counter()
            if self.nvtx_enabled:
                self._domain.pop_range()
                self.nvtx_log.append(("pop", name))
            self._open.pop()

    def record_host_stage(self, name: str, started_s: float, ended_s: float) -> None:
        """A host stage that ran elsewhere, from `started_s` to `ended_s` on perf_counter: a page prepared
        in another process, timed in this one from its hand-over to its return. Top-level and without an
        NVTX range (a thread's ranges nest, and this interval spans threads)."""
        if name not in self.stages or name not in HOST_STAGES:
            raise ValueError(f"{name!r} is none of this model's host stages")
        if self._resolved is not None:
            raise RuntimeError("StageClock.finish() was already called")
        self.entries.append(_Entry(name, None, started_s, ended_s, started_s, ended_s))

    def mark_step(self) -> None:
        """A decode step boundary: one preallocated CUDA event, or perf_counter on the CPU."""
        if self.timing_enabled and self.cuda:
            if self._n_steps == len(self._step_events):
                self._step_events.append(torch.cuda.Event(enable_timing=True))
            self._step_events[self._n_steps].record(torch.cuda.current_stream(self.device))
        elif self.timing_enabled:
            self._step_host.append(time.perf_counter())
        if self.profiler is not None:
            self.profiler.step(self._n_steps)  # the step this boundary begins
        self._n_steps += 1

    # ---- results ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for this clock's own marks (not the whole device: the next job may already run) and resolve
        them into milliseconds. Idempotent."""
        if self._resolved is not None:
            return
        if self._open:
            raise RuntimeError(f"stages still open: {[self.entries[i].name for i in self._open]}")
        if self.cuda:
            # Every stage's end and the last step mark (steps complete in order).
            ends = [entry.end for entry in self.entries if isinstance(entry.end, torch.cuda.Event)]
            for mark in ends + self._step_events[: self._n_steps][-1:]:
                mark.synchronize()
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
            self._ttft_from_device_start_ms = self._ttft_from_device_start()
            self._device_span = self._span()
        if self.cuda and self.timing_enabled and self._step_events:
            _STEP_EVENT_POOL.setdefault(self.device, []).append(self._step_events)
            self._step_events = []
        self._resolved = totals

    def _elapsed(self, start: torch.cuda.Event | float | None, end: torch.cuda.Event | float | None) -> float:
        if isinstance(start, float) and isinstance(end, float):
            return (end - start) * 1e3
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return start.elapsed_time(end)
        raise RuntimeError("a stage has no start or end mark")

    def _ttft_from_device_start(self) -> float:
        """The device's time from its first stage's start to the end of `first_token`, idle gaps between
        those stages included (TTFT = preprocess + this)."""
        device = self._device_entries()
        first_token = [e for e in device if e.name == "first_token"]
        return self._elapsed(device[0].start, first_token[-1].end) if first_token else 0.0

    def _device_entries(self) -> list[_Entry]:
        return [e for e in self.entries if e.name not in HOST_STAGES]

    def _span(self) -> DeviceSpan | None:
        """The job on the device, on the host clock, anchored at the end of its last device stage (which
        waits for the device)."""
        device = self._device_entries()
        if not device:
            return None
        first, last = device[0], device[-1]
        started = last.host_end - self._elapsed(first.start, last.end) / 1e3
        first_token = [e for e in device if e.name == "first_token"]
        chosen = started + self._elapsed(first.start, first_token[-1].end) / 1e3 if first_token else started
        return DeviceSpan(started, chosen, last.host_end)

    def _page_wait_ms(self) -> float:
        """From the end of the `preprocess` before the first device stage to that stage's start."""
        device = self._device_entries()
        if not device:
            return 0.0
        before = [e for e in self.entries if e.name == "preprocess" and e.host_end <= device[0].host_start]
        return (device[0].host_start - before[-1].host_end) * 1e3 if before else 0.0

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

    def parent_name(self, entry: _Entry) -> str | None:
        """The stage `entry` was entered in; None for a top-level stage."""
        return None if entry.parent is None else self.entries[entry.parent].name

    def nesting_ok(self) -> bool:
        """Every nested stage lies within its parent's interval (compared on the same clock only)."""
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

    def e2e_ms(self) -> float:
        """Host time from entering the first stage to leaving the last, less the page's wait."""
        self._require_finished()
        if not self.timing_enabled or not self.entries:
            return 0.0
        span = max(e.host_end for e in self.entries) - min(e.host_start for e in self.entries)
        return span * 1e3 - self._page_wait_ms()

    def finished_s(self) -> float:
        """When the job's last stage ended, on this process's perf_counter clock."""
        self._require_finished()
        return max((e.host_end for e in self.entries), default=0.0)

    def device_span(self) -> DeviceSpan | None:
        """When the device worked on the job (host clock); None without timings or device stages."""
        self._require_finished()
        return self._device_span

    def stage_timings(self, kept_steps: int | None = None) -> StageTimings:
        """The job's timings. `kept_steps`: how many decode steps produced output that was kept (the
        rest ran past EOS); their time is `decode_ms`, the rest of the decode stage `wasted_decode_ms`."""
        totals = self._require_finished()
        kept_steps = len(self._step_ms) if kept_steps is None else kept_steps
        kept, wasted = self._step_ms[:kept_steps], self._step_ms[kept_steps:]
        # Every stage of this model's into its field (another family's stage keeps its default, None);
        # the decode stage's steps after EOS are waste, not decode.
        stage_ms = {
            t.column: totals[t.stage] for t in TIMINGS if t.stage is not None and t.stage in self.stages
        }
        decode_ms = stage_ms["decode_ms"] = totals["decode"] - sum(wasted)
        e2e = self.e2e_ms()
        return StageTimings(
            clock="cuda_event" if self.cuda else "perf_counter",
            decode_step_ms=kept,
            **stage_ms,
            vision_ms=sum(totals[name] for name in VISION_STAGES),
            wasted_decode_ms=sum(wasted),
            host_gap_ms=e2e - sum(totals[name] for name in JOB_PARTS) if self.timing_enabled else 0.0,
            ttft_ms=totals["preprocess"] + self._ttft_from_device_start_ms,
            # One token per kept decode step after the first (chosen from the prefill's logits).
            tpot_ms=decode_ms / len(kept) if kept else 0.0,
            e2e_ms=e2e,
            page_wait_ms=self._page_wait_ms() if self.timing_enabled else 0.0,
            ttft_from_device_start_ms=self._ttft_from_device_start_ms,
        )
