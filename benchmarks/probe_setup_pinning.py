"""Setup's clock for a page by where it was prepared and pinned, and what ran beside it: where the farm's
batch-1 setup can lose time to the host (docs/benchmarks.md, "Setup through the farm, mended").

Interleaved, `--jobs` times each, on the same pages (OmniDocBench's demo pages, gundam):
  thread      `prepare_job` on this thread (its page pinned by `PreparedPage.pinned`), as a prefetch thread;
  elsewhere   prepared on this thread, pinned on another (`PreparedPage.pinned` on a thread of its own);
  process     a page from `PageProcesses` (pinned on the pool's receiving thread), the device idle;
  repinned    the same process page pinned again on this thread before its job;
  overlapped  a process page asked for once a 256-token job's prefill is queued (`before_decode`, as the
              farm's prefetch), that job finished here (its row's host part), then this page's job;
  beside      prepared as `thread`, set up while another thread finishes a 256-token job
              (`DeviceRun.finish`: its CUDA events resolved, its output parsed).
Per variant: setup ms (CUDA events) p50 / p90 and the pixel tensor's layout (contiguous, pinned, strides);
with `--first-copy`, the first pixel copy's host time too (perf_counter around `Tensor.to(non_blocking=True)`,
a host call), measured before the job, whose setup then copies that page a second time.

    python3 benchmarks/probe_setup_pinning.py --out $OUT/setup-pinning.json [--jobs 12] [--first-copy]
    python3 benchmarks/probe_setup_pinning.py --out /tmp/p.json --device cpu --model tiny --mode tiny --jobs 2
        # CPU smoke: no pinning there, so no "elsewhere" or "repinned"; figures meaningless
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.farm.filelist import read_filelist  # noqa: E402
from dsocr_workers.farm.job.page_processes import PageProcesses  # noqa: E402

PAGES = REPO / "datasets/omnidocbench/subsets/demo-18.txt"


def layout(page) -> dict:
    pixels = page.global_pixels
    pinned = pixels.is_pinned() if torch.cuda.is_available() else False
    return {"contiguous": pixels.is_contiguous(), "pinned": pinned, "strides": list(pixels.stride()),
            "data_ptr_mod_4096": pixels.data_ptr() % 4096}


def first_copy_us(session: DeepSeekOCRSession, page) -> float:
    """Host time of the first pixel copy alone (what setup's first launch is), the device idle before."""
    cuda = session.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    page.global_pixels.to(session.device, non_blocking=True)
    took = (time.perf_counter() - began) * 1e6
    if cuda:
        torch.cuda.synchronize()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="full")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--first-copy", action="store_true", help="time the first pixel copy before each job")
    args = parser.parse_args()
    session = DeepSeekOCRSession.from_local(args.model, device=args.device)
    cuda = session.device.type == "cuda"
    variants = ("thread", "elsewhere", "process", "repinned", "overlapped", "beside") if cuda else (
        "thread", "process", "overlapped", "beside")  # fmt: skip
    other = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-pin")
    images = [entry.path for entry in read_filelist(PAGES).images][: args.jobs]
    for image in images[:2]:  # warm: the eager path's kernels, the pixel table
        session.run_inference(image, mode=args.mode, max_new_tokens=4)
    pool = PageProcesses(session, 2)
    pool.wait_ready()
    figures: dict[str, dict[str, list]] = {v: {"setup_ms": [], "first_copy_us": [], "layout": []}
                                          for v in variants}

    def from_pool(image: Path):
        return pool.submit(str(image), None, args.mode, session.new_clock())

    def ask(asked: list, image: Path) -> None:
        asked.append(from_pool(image))

    for image in images:
        for variant in figures:
            finishing = None
            if variant in ("overlapped", "beside"):  # a 256-token job first, its host part left to do
                earlier = session.prepare_job(image, mode=args.mode)
                asked: list = []
                unfinished = session.run_on_device(
                    earlier.page, 256, clock=earlier.clock,
                    before_decode=partial(ask, asked, image) if variant == "overlapped" else None,
                )
            if variant in ("thread", "beside"):
                prepared = session.prepare_job(image, mode=args.mode)
                page, clock = prepared.page, prepared.clock
            elif variant == "elsewhere":
                page = other.submit(session.prepare(image, None, args.mode).pinned).result()
                clock = session.new_clock()
            elif variant == "overlapped":
                unfinished.finish()
                prepared = asked[0].result()
                page, clock = prepared.page, prepared.clock
            else:
                prepared = from_pool(image).result()
                page, clock = prepared.page, prepared.clock
                if variant == "repinned":
                    page = page.pinned()
            figures[variant]["layout"].append(layout(page))
            if args.first_copy:
                figures[variant]["first_copy_us"].append(first_copy_us(session, page))
            if variant == "beside":
                finishing = other.submit(unfinished.finish)
            run = session.run_on_device(page, 4, clock=clock)
            if finishing is not None:
                finishing.result()
            figures[variant]["setup_ms"].append(run.finish().timings.setup_ms)
    pool.close()
    other.shutdown()
    summary = {}
    for variant, values in figures.items():
        setup, copy = sorted(values["setup_ms"]), sorted(values["first_copy_us"])
        summary[variant] = {"setup_ms_p50": statistics.median(setup), "setup_ms_p90": percentile(setup, 0.9),
                            "layout": values["layout"][0]}  # fmt: skip
        if copy:
            summary[variant] |= {"first_copy_us_p50": statistics.median(copy), "first_copy_us_p90": percentile(copy, 0.9)}
        copies = (f"  first copy µs p50 {summary[variant]['first_copy_us_p50']:.0f} p90 "
                  f"{summary[variant]['first_copy_us_p90']:.0f}") if copy else ""  # fmt: skip
        print(f"{variant:10s} setup ms p50 {summary[variant]['setup_ms_p50']:.3f} p90 "
              f"{summary[variant]['setup_ms_p90']:.3f}{copies}  {summary[variant]['layout']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                                    "summary": summary, "runs": figures}, indent=2))


def percentile(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


if __name__ == "__main__":
    main()
