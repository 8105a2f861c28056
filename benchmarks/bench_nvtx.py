"""Micro benchmark: the host cost of StageClock's marks (NVTX push/pop, CUDA event records,
perf_counter reads), with instrumentation on and off. No GPU work is timed: this is the price the
Python decode loop pays per stage entry and per step boundary.

    python benchmarks/bench_nvtx.py            # CPU, plus CUDA when available
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nvtx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsocr_workers.engine.clock import NVTX_DOMAIN, StageClock  # noqa: E402

N = 20_000


def per_call_us(fn, n: int = N) -> float:
    fn()  # first call builds cached attributes
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    domain = nvtx.get_domain(NVTX_DOMAIN)
    print(f"nvtx {getattr(nvtx, '__version__', '?')}: domain {type(domain).__name__} "
          "(DummyDomain = no profiler attached, push/pop are no-ops)")
    attributes = domain.get_event_attributes(message="decode [job 1]")

    def push_pop() -> None:
        domain.push_range(attributes)
        domain.pop_range()

    print(f"raw nvtx push+pop: {per_call_us(push_pop):.3f} us")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for enabled in (True, False):
            clock = StageClock(device, job_id="1", nvtx_enabled=enabled, timing_enabled=enabled, step_capacity=N + 8)

            def stage(clock: StageClock = clock) -> None:
                with clock.stage("decode"):
                    pass

            stage_us = per_call_us(stage, 2_000)
            step_us = per_call_us(clock.mark_step)
            state = "on " if enabled else "off"
            print(f"{device:4s} instrumentation {state}: stage enter+exit {stage_us:7.3f} us, mark_step {step_us:6.3f} us")


if __name__ == "__main__":
    main()
