"""Kernel-level profiles: torch.profiler around a profiled job's device part, each stage a profiler range,
the decode sampled; and around the sampled steps of a batched engine, one profile per step.

A job: the caller picks the jobs and hands a `JobProfiler` to `DeepSeekOCRSession.run_on_device`, which
starts it before the job's setup and stops it once the output is read back. The job's clock opens a
`dsocr::<stage>` range around every stage, and only the sampled decode steps (`DecodeSample`) are recorded, so that a long job's trace
stays small. `JobProfiler.collect` (host work, run after the clock finished) turns the profile into a
`ProfileCapture`: the gzipped Chrome trace and the kernel summary, from torch.profiler's own event list. On a
GPU a stage's kernels are those launched inside its range, so a replayed CUDA graph's kernels count for
the stage that replayed it; on the CPU, each range's operator tree.

A batched engine's steps: the caller attaches a `StepProfiler` to the engine (`BatchedEngine.profile_steps`);
the runner asks it at each launch, and a sampled step (`StepSample`) runs under a profiler of its own,
started before its launch and stopped after it, its one range `dsocr::batched/<kind>`; the other steps run
with none. `SampledStep.collect` makes the same `ProfileCapture` of it once its time is read back.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from dsocr_workers.engine.native_stderr import Dropping
from dsocr_workers.engine.result import ProfileCapture
from dsocr_workers.kernels import DECODE, OTHER, Activity, KernelSummary, KernelTime, StageKernels
from dsocr_workers.stages import HOST_STAGES

KINETO_QUIET = "6"  # above kineto's highest level: nothing printed
# What c10 logs at every toggle of the collection, whatever the activities (profiler_kineto.cpp).
TOGGLE_WARNINGS = ("Toggling CPU activity with GPU activity on", "Toggling GPU activity with CPU activity on")


class StageTimes(Protocol):
    """What the summary reads of a finished job clock (engine/clock.py `StageClock`, which opens this
    module's ranges: a protocol, not an import of it)."""

    timing_enabled: bool

    def ms(self, name: str) -> float: ...

    def step_ms(self) -> list[float]: ...


RANGE_PREFIX = "dsocr::"
STEP_RANGE = f"{DECODE} step "  # + the step's index: `dsocr::decode step 17`
BATCHED = "batched/"  # + a batched engine's sampled step's kind: `dsocr::batched/decode`
TOP_KERNELS = 30  # per stage in the summary; the rest are summed as one row
MAX_NAME = 300  # characters of a kernel's name kept in the summary (templated names run to thousands)


@dataclass(frozen=True)
class DecodeSample:
    """Which decode steps a profiled job records: the first `first`, then `width` steps from each of
    `later` (positions after the prompt): the cache grows, and a step's kernels with it."""

    first: int = 8
    later: tuple[int, ...] = (64, 256, 1024, 4096)
    width: int = 2

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and (
            step < self.first or any(at <= step < at + self.width for at in self.later)
        )


class JobProfiler:
    """torch.profiler over one job's device part; `StageClock` calls `stage` and `step`."""

    def __init__(self, device: torch.device, sample: DecodeSample | None = None) -> None:
        self.device = device
        self.activity: Activity = "cuda" if device.type == "cuda" else "cpu"
        self.activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if self.activity == "cuda" else []
        )
        self.sample = sample or DecodeSample()
        self.steps: list[int] = []  # the decode steps recorded
        self._profile = profile(
            activities=self.activities, record_shapes=False, with_stack=False, profile_memory=False
        )
        self._step: record_function | None = None
        self._collecting = True
        self._running = False
        self._toggle_warnings = Dropping(*TOGGLE_WARNINGS)

    def start(self) -> None:
        # Kineto prints its stages on stderr at its default level (read when the profiler first starts):
        # a worker's log is no place for them. A level set by the user is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        self._profile.start()
        self._running = True
        if self.activity == "cuda":
            # A session's first recorded copy can block the host inside CUPTI (docs/benchmarks.md): paid
            # here, before the job's clock starts, not by its setup's first copy.
            torch.empty(1, pin_memory=True).to(self.device, non_blocking=True).add_(1)

    def stop(self) -> None:
        if self._running:
            self._close_step()
            self._profile.stop()
            self._running = False
            self._toggle_warnings.close()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """A stage's range (host stages are no device work: not ranged). The decode stage's exit closes its
        last step's range and resumes the collection, so that the decode's own range ends in the trace."""
        if not self._running or name in HOST_STAGES:
            yield
            return
        with record_function(RANGE_PREFIX + name):
            try:
                yield
            finally:
                if name == DECODE:
                    if (
                        self._step is not None
                    ):  # each step that ran closed its range at the next mark: this one never ran
                        self.steps.pop()
                    self._close_step()
                    self._collect(True)

    def step(self, index: int) -> None:
        """Decode step `index` is next: record it (a range of its own) if it is sampled, else pause."""
        if not self._running:
            return
        self._close_step()
        sampled = index in self.sample
        self._collect(sampled)
        if sampled:
            self._step = record_function(f"{RANGE_PREFIX}{STEP_RANGE}{index}")
            self._step.__enter__()
            self.steps.append(index)

    def _close_step(self) -> None:
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None

    def _collect(self, on: bool) -> None:
        if on != self._collecting:
            # Warnings no torch switch silences but the process-wide TORCH_CPP_LOG_LEVEL: a worker's
            # log would get two per sampled stretch of every profiled job.
            with self._toggle_warnings.around():
                self._profile.toggle_collection_dynamic(on, self.activities)
            self._collecting = on

    def collect(self, clock: StageTimes) -> ProfileCapture:
        """The trace and the kernel summary, once `clock` is finished (its stage times are the summary's
        `event_ms`). Host work: call it off the device's path."""
        self.stop()
        return _capture(self._profile, summarize(self._profile.events(), clock, self.activity, self.steps))


@dataclass(frozen=True)
class StepSample:
    """Which steps of a batched engine a `--profile N` run records: of each kind (a whole prefill, a
    split prefill's sam or join part, a decode-only step), the N-th, 2N-th, ... the engine launches. As the
    batch-1 path's every N-th job: about 1/N of each kind, every kind in any run with N of them, and the
    engine's first step of a kind (the one most likely to meet a cold path) only at N = 1."""

    every: int

    def __contains__(self, ordinal: object) -> bool:
        return isinstance(ordinal, int) and ordinal % self.every == 0


@dataclass
class _StepTime:
    """A sampled step's clock for `summarize`: its one range's time."""

    clock_ms: float
    timing_enabled: bool = True

    def ms(self, name: str) -> float:
        return self.clock_ms

    def step_ms(self) -> list[float]:
        return []


class SampledStep:
    """A batched engine's step that ran under torch.profiler, collected once its clock time is known."""

    def __init__(self, activity: Activity, profiler: profile) -> None:
        self.activity = activity
        self._profile: profile | None = profiler
        self._capture: ProfileCapture | None = None

    def collect(self, step_ms: float) -> ProfileCapture:
        """Its trace and kernels, its clock time `step_ms` the summary's `event_ms` (the first call's: a
        step that served two runs is collected once). Host work: call it off the device's path."""
        if self._capture is None:
            assert self._profile is not None
            summary = summarize(self._profile.events(), _StepTime(step_ms), self.activity, [])
            self._capture, self._profile = _capture(self._profile, summary), None
        return self._capture


class StepProfiler:
    """torch.profiler around the sampled steps of a batched engine (`StepSample`), each step a profile
    of its own and one range, `dsocr::batched/<kind>`: an unsampled step runs with no profiler at all.
    The engine's runner calls `around` at each launch; `take` hands a step's profile over once it is read
    back."""

    def __init__(self, device: torch.device, sample: StepSample) -> None:
        self.activity: Activity = "cuda" if device.type == "cuda" else "cpu"
        self.activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if self.activity == "cuda" else []
        )
        self.sample = sample
        self._launched: dict[str, int] = defaultdict(int)  # steps launched so far, by kind
        self._sampled: dict[int, SampledStep] = {}  # by step index, until taken
        # Kineto starts up at a process's first profiler and, on a thread other than torch's (the engine's
        # own), prints an error line: one started and stopped here, which also keeps that start-up (CUPTI's
        # on a GPU) out of the first sampled step's time. Quiet as `JobProfiler.start`.
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        started = profile(activities=self.activities)
        started.start()
        started.stop()

    def around(self, index: int, kind: str) -> AbstractContextManager[None]:
        """The launch of step `index` of `kind`: under its own profiler if it is sampled."""
        self._launched[kind] += 1
        if self._launched[kind] not in self.sample:
            return nullcontext()
        return self._profiled(index, kind)

    @contextmanager
    def _profiled(self, index: int, kind: str) -> Iterator[None]:
        profiler = profile(
            activities=self.activities, record_shapes=False, with_stack=False, profile_memory=False
        )
        profiler.start()
        try:
            with record_function(f"{RANGE_PREFIX}{BATCHED}{kind}"):
                yield
        finally:  # on a GPU, stop waits for the device: the step's kernels are in
            profiler.stop()
        self._sampled[index] = SampledStep(self.activity, profiler)

    def take(self, index: int) -> SampledStep | None:
        """Step `index`'s profile, if it was sampled (once)."""
        return self._sampled.pop(index, None)


def _capture(profiler: profile, summary: KernelSummary) -> ProfileCapture:
    """The profile's Chrome trace, gzipped, with `summary`."""
    handle, path = tempfile.mkstemp(suffix=".json", prefix="dsocr-trace-")
    os.close(handle)
    try:
        profiler.export_chrome_trace(path)
        with open(path, "rb") as raw:
            trace = raw.read()
    finally:
        os.unlink(path)
    return ProfileCapture(gzip.compress(trace, compresslevel=6), len(trace), summary)


def summarize(events: Any, clock: StageTimes, activity: Activity, steps: list[int]) -> KernelSummary:
    """Kernels per stage from torch.profiler's event list (see the module docstring)."""
    ranges: dict[str, list[Any]] = defaultdict(list)
    for event in events:
        if event.device_type == DeviceType.CPU and event.name.startswith(RANGE_PREFIX):
            name = event.name.removeprefix(RANGE_PREFIX)
            # The decode's row is its sampled steps' (the decode's own range spans the unsampled ones too).
            if name.startswith(STEP_RANGE):
                if (
                    int(name.removeprefix(STEP_RANGE)) in steps
                ):  # not the range opened for a step that never ran
                    ranges[DECODE].append(event)
            elif name != DECODE:
                ranges[name].append(event)
    launches = _device_work_by_launch(events) if activity == "cuda" else []
    step_ms = clock.step_ms() if clock.timing_enabled else []
    stages = []
    for name, entries in ranges.items():
        if name == DECODE:
            event_ms = sum(step_ms[i] for i in steps if i < len(step_ms))
        else:
            event_ms = clock.ms(name) if clock.timing_enabled else 0.0
        work: list[tuple[str, float]] = []
        busy_us = span_us = 0.0
        for entry in entries:  # one range each (the decode: one per sampled step): busy and span add up
            if activity == "cuda":
                # The device work launched while the range was open on the host (a replayed CUDA graph's
                # kernels included: they are linked to the graph's launch, not to an operator).
                start, end = entry.time_range.start, entry.time_range.end
                device = [kernel for launched_at, kernel in launches if start <= launched_at <= end]
                work += [(d.name, d.time_range.end - d.time_range.start) for d in device]
                busy, span = _busy_and_span([(d.time_range.start, d.time_range.end) for d in device])
            else:  # one thread: the operators' self times never overlap, and they are its busy time
                ops = [op for op in _tree(entry) if not op.name.startswith(RANGE_PREFIX)]
                work += [(op.name, op.self_cpu_time_total) for op in ops]
                busy = sum(op.self_cpu_time_total for op in ops)
                span = _busy_and_span([(op.time_range.start, op.time_range.end) for op in ops])[1]
            busy_us += busy
            span_us += span
        stages.append(_stage(name, event_ms, work, busy_us, span_us))
    return KernelSummary(activity, stages, list(steps))


def _device_work_by_launch(events: Any) -> list[tuple[float, Any]]:
    """Every device activity (kernel, copy, set) with the host time of the runtime call that launched it.

    The profiler gives a device activity the correlation id of its launch (`cudaLaunchKernel`,
    `cuLaunchKernel` for Triton, `cudaGraphLaunch` for every kernel of a replayed graph, `cudaMemcpyAsync`)
    as its `id`, and that runtime call is a host event with the same id. Attributing by the launch's host
    time puts a graph's kernels in the range that replayed it, which the operator tree cannot: a replay is
    no operator. The ranges' own device-side copies (`gpu_user_annotation`) are left out."""
    launched_at = {
        e.id: e.time_range.start
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("cu") and "::" not in e.name
    }
    return [
        (launched_at[e.id], e)
        for e in events
        if e.device_type == DeviceType.CUDA and not e.name.startswith(RANGE_PREFIX) and e.id in launched_at
    ]


def _tree(event: Any) -> Iterator[Any]:
    yield event
    for child in event.cpu_children:
        yield from _tree(child)


def _stage(
    name: str, event_ms: float, work: list[tuple[str, float]], busy_us: float, span_us: float
) -> StageKernels:
    """One stage's row from its (kernel, duration us) list, its busy time and its span."""
    calls: dict[str, int] = defaultdict(int)
    totals: dict[str, float] = defaultdict(float)
    for kernel, duration in work:
        calls[kernel[:MAX_NAME]] += 1
        totals[kernel[:MAX_NAME]] += duration
    ranked = sorted(totals, key=lambda k: -totals[k])
    kernels = [KernelTime(k, calls[k], totals[k]) for k in ranked[:TOP_KERNELS]]
    if len(ranked) > TOP_KERNELS:
        rest = ranked[TOP_KERNELS:]
        kernels.append(KernelTime(OTHER, sum(calls[k] for k in rest), sum(totals[k] for k in rest)))
    return StageKernels(name, event_ms, sum(totals.values()) / 1e3, busy_us / 1e3, span_us / 1e3, kernels)


def _busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """The time covered by at least one interval (kernels on two streams at once count once), and from
    the first start to the last end; (0, 0) for none."""
    if not intervals:
        return 0.0, 0.0
    covered, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered, reached - min(start for start, _ in intervals)
