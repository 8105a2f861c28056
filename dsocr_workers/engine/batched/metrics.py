"""What the batched engine measures, per sequence and per step, named as serving benchmarks name it
(`vllm bench serve`, AIPerf): TTFT, TPOT, ITL, e2e, request throughput, output tokens/s.

Times are seconds on this process's `time.perf_counter` clock. On CUDA a step's start and end come from
its CUDA events, placed on the host clock through one anchor event (recorded and waited for when the
engine started); a token counts as produced when the step that chose it ended on the device. On a CPU
they are host readings around the synchronous step. A page's arrival is when it was handed to the engine
(`BatchedEngine.add`, or the time its request carries): its TTFT and e2e hold its wait for a slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# prefill: a page's whole prefill in one launch; sam, join: its two parts when split (scheduler.py); decode.
StepKind = Literal["prefill", "sam", "join", "decode"]
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class StepRecord:
    """One step of the device: a page's prefill into its slot (whole, or one of its two parts), or a
    decode step over a bucket."""

    index: int
    kind: StepKind
    # Pages given a token: decode, the pages decoding in it; prefill and join, 1 (the joining page);
    # sam, 0.
    occupancy: int
    bucket: int  # rows computed (decode: the CUDA-graph bucket; a prefill or its parts: 1)
    started_s: float
    ended_s: float
    prompt_tokens: int = 0  # prefill, join: the joining page's prompt (its LM prefill); sam: 0
    vision_ms: float = 0.0  # prefill, sam, join: the vision stages in it (SAM; the view encoder, projector)
    request_id: str | None = None  # prefill, sam, join: the page's
    # decode: the KV positions its pages' attention reads (each page's prompt and tokens so far, the one
    # it feeds included), summed, and the longest page's
    kv_positions: int = 0
    kv_longest: int = 0

    @property
    def ms(self) -> float:
        return (self.ended_s - self.started_s) * 1e3


@dataclass
class SequenceMetrics:
    """One page's timeline through the batched engine."""

    arrival_s: float
    admitted_s: float = 0.0  # its prefill step was launched (host)
    prefill_started_s: float = 0.0  # on the device
    token_s: list[float] = field(default_factory=list)  # when each output token was produced
    finished_s: float = 0.0  # its last token was read back (host)
    occupancy_sum: int = 0  # over the decode steps it took part in
    decode_steps: int = 0
    # Device time of its own prefill launches (its prefill step, or its two parts summed), and of the
    # vision in them: the page's stages the batch times apart from other pages'.
    prefill_ms: float = 0.0
    vision_ms: float = 0.0

    @property
    def queue_wait_ms(self) -> float:
        return (self.admitted_s - self.arrival_s) * 1e3

    @property
    def ttft_ms(self) -> float:
        return (self.token_s[0] - self.arrival_s) * 1e3

    @property
    def prefill_to_first_token_ms(self) -> float:
        """From its prefill's start on the device to its first token: split, the decode step between its
        parts too."""
        return (self.token_s[0] - self.prefill_started_s) * 1e3

    @property
    def itl_ms(self) -> list[float]:
        """Inter-token latencies: between consecutive output tokens."""
        return [(b - a) * 1e3 for a, b in zip(self.token_s, self.token_s[1:], strict=False)]

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (None for a one-token output)."""
        if len(self.token_s) < 2:
            return None
        return (self.token_s[-1] - self.token_s[0]) * 1e3 / (len(self.token_s) - 1)

    @property
    def e2e_ms(self) -> float:
        """Arrival to the last token produced."""
        return (self.token_s[-1] - self.arrival_s) * 1e3

    @property
    def mean_occupancy(self) -> float | None:
        """The batch it decoded in: pages per decode step, averaged over its steps."""
        return self.occupancy_sum / self.decode_steps if self.decode_steps else None


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `values` (None when empty)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}}


@dataclass(frozen=True)
class ServingSummary:
    """A batch of finished pages and the steps that served them, summed up as `vllm bench serve` does."""

    pages: int
    output_tokens: int
    duration_s: float  # first arrival to last token
    request_throughput: float  # pages/s
    output_tokens_per_s: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    queue_wait_ms: dict[str, float | None]
    occupancy: dict[str, float | None]  # per decode step
    decode_step_ms: dict[str, float | None]
    prefill_step_ms: dict[str, float | None]  # a launch of prefill work: a whole prefill, or a part
    decode_steps: int
    prefill_steps: int  # launches of prefill work, parts included
    split_prefills: int  # pages prefilled in two parts ("sam", then "join")
    decode_share: float  # of the device time in steps: decode steps' part (the rest: prefills)

    @classmethod
    def of(cls, sequences: Sequence[SequenceMetrics], steps: Sequence[StepRecord]) -> ServingSummary:
        done = [s for s in sequences if s.token_s]
        if not done:
            raise ValueError("no finished page to summarise")
        start = min(s.arrival_s for s in done)
        end = max(s.token_s[-1] for s in done)
        duration = max(end - start, 1e-9)
        tokens = sum(len(s.token_s) for s in done)
        decode = [s for s in steps if s.kind == "decode"]
        prefill = [s for s in steps if s.kind != "decode"]
        decode_ms, prefill_ms = sum(s.ms for s in decode), sum(s.ms for s in prefill)
        tpots = [t for s in done if (t := s.tpot_ms) is not None]
        return cls(
            pages=len(done),
            output_tokens=tokens,
            duration_s=duration,
            request_throughput=len(done) / duration,
            output_tokens_per_s=tokens / duration,
            ttft_ms=percentiles([s.ttft_ms for s in done]),
            tpot_ms=percentiles(tpots),
            itl_ms=percentiles([gap for s in done for gap in s.itl_ms]),
            e2e_ms=percentiles([s.e2e_ms for s in done]),
            queue_wait_ms=percentiles([s.queue_wait_ms for s in done]),
            occupancy=percentiles([s.occupancy for s in decode]),
            decode_step_ms=percentiles([s.ms for s in decode]),
            prefill_step_ms=percentiles([s.ms for s in prefill]),
            decode_steps=len(decode),
            prefill_steps=len(prefill),
            split_prefills=sum(s.kind == "join" for s in steps),
            decode_share=decode_ms / (decode_ms + prefill_ms) if decode_ms + prefill_ms > 0 else 0.0,
        )
