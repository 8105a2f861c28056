"""Batched serving (issue 34): several pages decoding together on one session's model, joining and
leaving between decode steps, with the serving measurements (TTFT, TPOT, ITL, occupancy per step).

- `engine.py`: `BatchedEngine` (add / submit a page, step, run a list at a concurrency) and its typed
  events and outputs;
- `slots.py`: the slotted KV cache, the per-slot token state and the batched decode step;
- `runner.py`: the step per batch bucket: eager, or compiled and replayed as a CUDA graph per bucket;
- `memory.py`: the KV cache sized from the token budget and the free memory, and the refusal of a page
  that cannot fit;
- `metrics.py`: per-page and per-step records and their summary.

The batch-1 path (`DeepSeekOCRSession.run_inference`) is not changed by any of it and stays the default.
"""

from dsocr_workers.engine.batched.engine import (
    BatchedEngine,
    BatchedOutput,
    NoFreeSlot,
    PageRequest,
    StepEvents,
    TokenEvent,
)
from dsocr_workers.engine.batched.memory import KVPlan, PageRefused, plan_kv
from dsocr_workers.engine.batched.metrics import SequenceMetrics, ServingSummary, StepRecord

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
