"""The setup stage's kernel cross-check on a GPU, batch-1: a page prepared as the farm prepares it (pinned
on CUDA) is set up with a few asynchronous copies and launches (no cache reset), so the stage's clock is
its device work's. Per profiled job: the stage's clock, its kernels' sum and span, the device activities
it launched and the report's verdict; then the setup clock of as many jobs run without the profiler.

    python3 benchmarks/check_setup_crosscheck.py [--model full] [--jobs 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import synthetic_page  # noqa: E402
from dsocr_workers.engine.profiling import JobProfiler  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="full")
    parser.add_argument("--jobs", type=int, default=3)
    args = parser.parse_args()
    session = DeepSeekOCRSession.from_local(args.model, device="cuda", engine="fast")
    page = synthetic_page()
    for _ in range(2):  # warm: the same budget, the same cache bucket and graphs
        session.run_inference(page, max_new_tokens=16)
    rows = []
    for _ in range(args.jobs):
        prepared = session.prepare_job(page)
        run = session.run_on_device(prepared.page, max_new_tokens=16, clock=prepared.clock,
                                    profiler=JobProfiler(session.device))
        summary = run.finish().profile.summary
        setup = next(stage for stage in summary.stages if stage.stage == "setup")
        rows.append({"pinned": prepared.page.input_ids.is_pinned(), "event_ms": setup.event_ms,
                     "kernel_ms": setup.kernel_ms, "span_ms": setup.span_ms,
                     "launches": sum(k.calls for k in setup.kernels),
                     "crosscheck": setup.crosscheck(summary.activity)})
    plain = [session.run_inference(page, max_new_tokens=16).timings.setup_ms for _ in range(args.jobs)]
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                      "setup": rows, "setup_ms_unprofiled": plain}, indent=2))


if __name__ == "__main__":
    main()
