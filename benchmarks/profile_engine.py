"""Where the fast engine's GPU time goes, and whether its numerics follow the eager reference.

1. `--profile`: after warm-up, the prefill's stage split (CUDA events, median of 5 jobs), then
   torch.profiler over each prefill stage (SAM, CLIP, LM prefill) and over 32 decode steps of the fast
   engine (bf16, the anchors' page): the top CUDA kernels of each, and kernels launched per decode step.
2. `--agreement-dtypes float32,...`: teacher-forced top-1 agreement of fast vs eager in that dtype. In
   bf16 random weights give near-tied logits (spec §12), so a kernel-order rounding difference flips
   some top-1 picks; in float32 the same comparison isolates real divergence from rounding.

    python benchmarks/profile_engine.py --profile --agreement-dtypes float32 --agreement-steps 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import synthetic_page  # noqa: E402
from dsocr_workers.engine.clock import StageClock  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.engine.verify import teacher_forced_agreement  # noqa: E402

T = TypeVar("T")
PLAIN = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)


def top_kernels(prof: profile, rows: int) -> str:
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=90)


def kernel_launches(prof: profile) -> int:
    return sum(event.count for event in prof.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA)


def profile_stage(name: str, run: Callable[[], T], rows: int) -> T:
    """Run one stage under torch.profiler; print its kernel time, launches and top kernels."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_ms = sum(e.self_device_time_total for e in kernels) / 1000
    print(f"== fast {name}: {total_ms:.2f} ms of kernels, {kernel_launches(prof)} launches\n"
          + top_kernels(prof, rows), flush=True)
    return out


def quiet_clock(session: DeepSeekOCRSession) -> StageClock:
    """A clock that neither times nor annotates: the profiler is the instrument here."""
    return StageClock(session.device, nvtx_enabled=False, timing_enabled=False)


def profile_fast(page: Path, model: str, rows: int, steps: int = 32) -> None:
    session = DeepSeekOCRSession.from_local(model, device="cuda", engine="fast")
    for _ in range(2):  # the same budget as below: the same cache bucket, warm
        session.run_inference(page, max_new_tokens=steps + 1, infer=PLAIN)
    # The prefill's stage split (CUDA events, the median of 5 warm jobs) beside the kernels it runs.
    split = [session.run_inference(page, max_new_tokens=steps + 1, infer=PLAIN).timings for _ in range(5)]
    print("== fast prefill stages, median of 5 warm jobs (ms): " + ", ".join(
        f"{name} {statistics.median(getattr(t, name + '_ms') for t in split):.2f}"
        for name in ("prefill", "sam", "clip", "projector", "lm_prefill")), flush=True)
    clock = quiet_clock(session)
    with torch.inference_mode():
        job = session.start_job(session.prepare(page, None, "gundam", 9), PLAIN, steps + 1, clock)
        # The prefill's stages one at a time, as `DeepSeekOCRSession.prefill` runs them (its vision
        # callables and compiled LM prefill: replayed CUDA graphs cannot be split by range afterwards).
        vision, lm_prefill, inputs, profiled = session.runners.vision, session.lm_prefill, job.inputs, job
        sam = profile_stage("SAM", lambda: vision.sam(inputs.pixels), rows)
        profile_stage(session.family.encoder_stage, lambda: vision.views(sam), rows)
        image = session.encode_image(inputs, clock)  # all of vision again, unprofiled: the LM's input
        profile_stage("LM prefill", lambda: lm_prefill(inputs, image, profiled.buffers.cache), rows)
        # The decode below starts from a whole prefill of its own.
        job = session.start_job(session.prepare(page, None, "gundam", 9), PLAIN, steps + 1, clock)
        session.prefill(job, clock)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as decode_prof:
            session.decode(job, clock)
            torch.cuda.synchronize()
        print(f"== fast decode ({job.steps} steps): top CUDA kernels\n" + top_kernels(decode_prof, rows), flush=True)
        print(f"kernels per decode step: {kernel_launches(decode_prof) / job.steps:.1f}", flush=True)
    del session
    torch.cuda.empty_cache()


def determinism(page: Path, model: str, tokens_per_run: int, runs: int = 3) -> None:
    """Repeat the same page: do vision embeddings, prefill logits and greedy tokens repeat exactly?"""
    session = DeepSeekOCRSession.from_local(model, device="cuda", engine="fast")
    for _ in range(2):
        session.run_inference(page, max_new_tokens=tokens_per_run, infer=PLAIN)
    prepared = session.prepare(page, None, "gundam", 9)
    embeds, logits, tokens = [], [], []
    with torch.inference_mode():
        for _ in range(runs):
            clock = quiet_clock(session)
            job = session.start_job(prepared, PLAIN, tokens_per_run, clock)
            with clock.stage("prefill"):
                embeds.append(session.encode_image(job.inputs, clock).float().cpu())
            logits.append(session.prefill(job, clock).cpu())
    for _ in range(runs):
        tokens.append(session.run_inference(page, max_new_tokens=tokens_per_run, infer=PLAIN).token_ids)
    for i in range(1, runs):
        diverge = next((k for k, (a, b) in enumerate(zip(tokens[0], tokens[i], strict=True)) if a != b), None)
        print(f"run {i} vs 0: vision max|diff| {(embeds[i] - embeds[0]).abs().max():.3g}, prefill logits "
              f"max|diff| {(logits[i] - logits[0]).abs().max():.3g}, first token divergence {diverge}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="full")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--determinism", type=int, default=0, metavar="TOKENS",
                        help="repeat a TOKENS-long greedy run 3 times and compare")
    parser.add_argument("--no-cudnn-sdp", action="store_true", help="disable cuDNN attention first")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(warn_only): names nondeterministic ops")
    parser.add_argument("--agreement-dtypes", default="")
    parser.add_argument("--agreement-steps", type=int, default=64)
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.png"
        synthetic_page().save(page)
        if args.profile:
            profile_fast(page, args.model, args.rows)
            print(f"[{time.perf_counter() - began:.0f}s] profile done", flush=True)
        if args.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if args.no_cudnn_sdp:
            torch.backends.cuda.enable_cudnn_sdp(False)
        if args.determinism:
            determinism(page, args.model, args.determinism)
        for dtype in filter(None, args.agreement_dtypes.split(",")):
            eager = DeepSeekOCRSession.from_local(args.model, device="cuda", dtype=dtype, engine="eager")
            fast = DeepSeekOCRSession.from_local(args.model, device="cuda", dtype=dtype, engine="fast")
            top1 = teacher_forced_agreement(eager, fast, page, steps=args.agreement_steps)
            print(f"teacher-forced top-1 agreement fast vs eager, {dtype}, {args.agreement_steps} steps: "
                  f"{100 * top1:.2f}%  [{time.perf_counter() - began:.0f}s]", flush=True)
            del eager, fast
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
