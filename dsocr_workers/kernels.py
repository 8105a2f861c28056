"""A profiled job's (or batch step's) kernels per stage: the summary a worker stores beside its trace.

The engine builds it (engine/profiling.py), the store keeps it as JSON (`profiles.summary`), the
report aggregates and compares it (report/kernel_tables.py); like the stage registry, this module
imports nothing heavy. A "kernel" is, on a GPU (`cuda`), an activity (kernel, memcpy, memset) launched
inside the stage's range, timed on the GPU's clock; on the CPU (`cpu`), an aten operator's self time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Activity = Literal["cuda", "cpu"]
SUMMARY_FORMAT = 1  # bumped when the JSON layout changes; the report refuses what it does not know
DECODE = "decode"  # the decode stage's row holds the sampled steps only
# The cross-check's tolerance (as bench_trust's) and the shortest stage it judges: below a millisecond,
# launch latency and the clock's granularity dominate.
TOLERANCE = 0.05
MIN_JUDGED_MS = 1.0
# The share of a stage's clock its kernels must fill for idle outside their span to count as waiting.
HOST_WAIT_FLOOR = 0.5
OTHER = "(other kernels)"  # the kernels of a stage past its top ones, summed


@dataclass(frozen=True)
class KernelTime:
    """One kernel (or CPU op) name within a stage: how often it ran and for how long in all."""

    name: str
    calls: int
    total_us: float


@dataclass(frozen=True)
class StageKernels:
    """One stage of one profiled job: its clock's time, its kernels and how busy the device was."""

    stage: str
    event_ms: float  # the stage clock's time of the profiled part (for the decode, the sampled steps)
    kernel_ms: float  # the kernels' durations summed
    busy_ms: float  # the union of their intervals: kernels on two streams at once count once
    span_ms: float  # from the first kernel's start to the last one's end
    kernels: list[KernelTime] = field(default_factory=list)  # by total, longest first; the tail as OTHER

    @classmethod
    def mean(cls, rows: list[StageKernels]) -> StageKernels:
        """One stage's figures averaged over jobs (what the cross-check judges over several), no kernels."""
        n = max(len(rows), 1)
        return cls(
            rows[0].stage if rows else "",
            *(sum(getattr(r, f) for r in rows) / n for f in ("event_ms", "kernel_ms", "busy_ms", "span_ms")),
        )

    @property
    def idle_ms(self) -> float:
        """The stage's time the device spent on no kernel (never negative: clocks differ by microseconds)."""
        return max(self.event_ms - self.busy_ms, 0.0)

    def crosscheck(self, activity: Activity) -> str:
        """The summed kernel time against the stage's clock: PASS within TOLERANCE; on a GPU, explained when
        the kernels' span matches the clock (the difference is idle time between kernels, measured) or when
        the kernels end inside the clock and fill at least HOST_WAIT_FLOOR of it (the stream also waited on
        the host); on the CPU, explained when the operators take less than the clock (the rest is Python on
        the one thread); FAIL otherwise; not judged below MIN_JUDGED_MS."""
        if self.event_ms < MIN_JUDGED_MS:
            return f"not judged (< {MIN_JUDGED_MS:g} ms)"
        if self.kernel_ms <= 0:
            return "FAIL (no kernel attributed)"
        if abs(self.kernel_ms / self.event_ms - 1) <= TOLERANCE:
            return "PASS"
        gap = self.event_ms - self.kernel_ms
        if activity == "cpu":  # one host thread: whatever the operators leave of the stage is Python
            return f"explained: Python between ops {gap:.3g} ms" if gap > 0 else "FAIL"
        if abs(self.span_ms / self.event_ms - 1) <= TOLERANCE and gap > 0:
            return f"explained: GPU idle between kernels {gap:.3g} ms"
        # The kernels end inside the clock but start late or stop early: the stream waited on the host (a
        # profiled decode step's range and collection switch). Explained only while the kernels fill most of
        # the stage: kernels missing from a stage (attributed elsewhere) look the same and must fail.
        if (
            gap > 0
            and self.span_ms <= self.event_ms * (1 + TOLERANCE)
            and self.kernel_ms >= HOST_WAIT_FLOOR * self.event_ms
        ):
            return (
                f"explained: GPU idle {gap:.3g} ms ({max(self.span_ms - self.busy_ms, 0):.3g} between kernels, "
                f"{self.event_ms - self.span_ms:.3g} waiting on the host)"
            )
        return "FAIL"


@dataclass(frozen=True)
class KernelSummary:
    """A profiled job's stages in the order they ran, what a kernel is on its device, and the decode
    steps that were sampled (the trace holds those only)."""

    activity: Activity
    stages: list[StageKernels]
    decode_steps: list[int] = field(default_factory=list)
    format: int = SUMMARY_FORMAT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> KernelSummary:
        if document.get("format") != SUMMARY_FORMAT:
            raise ValueError(
                f"kernel summary format {document.get('format')!r}; this version reads {SUMMARY_FORMAT}"
            )
        stages = [
            StageKernels(**{**s, "kernels": [KernelTime(**k) for k in s["kernels"]]})
            for s in document["stages"]
        ]
        return cls(document["activity"], stages, list(document["decode_steps"]), document["format"])

    def stage(self, name: str) -> StageKernels | None:
        return next((s for s in self.stages if s.stage == name), None)
