"""Batched serving: several pages decoding together on one session's model, joining and leaving
between decode steps, with the serving measurements (TTFT, TPOT, ITL, occupancy per step).

- `scheduler.py`: admission, slots, budgets, split prefills and stop decisions, a plain plan per launch
  (no torch);
- `runner.py`: the device side: the slots' state, prefill (whole or in two parts) and decode launches,
  readback, CUDA graphs;
- `engine.py`: `BatchedEngine`, the two together (add / submit a page, step, run a list);
- `slots.py`: the slotted KV cache, the per-slot token state and the batched decode step;
- `memory.py`: the KV cache sized from the token budget and the free memory, and refused pages;
- `metrics.py`: per-page and per-step records and their summary.

`BatchedEngine` loads torch when first used; the rest of this package's names do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsocr_workers.engine.batched.memory import KVPlan, PageRefused, plan_kv
from dsocr_workers.engine.batched.metrics import SequenceMetrics, ServingSummary, StepRecord
from dsocr_workers.engine.batched.scheduler import (
    BatchedOutput,
    NoFreeSlot,
    PageRequest,
    StepEvents,
    TokenEvent,
)

if TYPE_CHECKING:
    from dsocr_workers.engine.batched.engine import BatchedEngine

__all__ = [
    "BatchedEngine",
    "BatchedOutput",
    "KVPlan",
    "NoFreeSlot",
    "PageRefused",
    "PageRequest",
    "SequenceMetrics",
    "ServingSummary",
    "StepEvents",
    "StepRecord",
    "TokenEvent",
    "plan_kv",
]


def __getattr__(name: str) -> Any:
    if name == "BatchedEngine":
        from dsocr_workers.engine.batched.engine import BatchedEngine

        return BatchedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
