"""GPU benchmark of the inference core (issue 2 item 9) on the page of ../shared/anchors.md.

One process, one GPU, one call of at most 10 minutes including torch.compile warm-up:
  1. per engine (eager, fast; `full` preset, random weights, bf16): load, warm-up runs (the first
     one's wall time holds compilation, reported apart), then >= 5 measured runs of 256 decode
     tokens forced with ignore_eos. Times are the CUDA-event stage timings of InferenceResult;
     medians over the runs (decode ms/token: the median of each run's per-step p50).
  2. instrumentation on vs off (NVTX + CUDA events: `session.instrumented`, which DSOCR_INSTRUMENTATION=0
     turns off where a session is built), same engine, interleaved repeats, host wall time around
     synchronized jobs; median ratio.
  3. fast-vs-eager teacher-forced top-1 agreement over 256 steps.
  4. if time is left: the fast engine with the vendor's no_repeat_ngram_size=20 ban.
Every section writes its numbers (or its error) into bench.json as soon as it ends, so a run cut
short still reports what it measured. Output: $OUT/bench.json and $OUT/bench.md when OUT is set,
else stdout; the markdown table is printed last either way.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsocr_workers.engine.result import DecodeOptions, InferenceResult  # noqa: E402
from dsocr_workers.farm.job.fingerprint import git_sha, nvidia_driver  # noqa: E402

# The fast engine's first job compiles (vision for two shapes, then dynamic) and its decode step is
# captured as a CUDA graph after a warm-up; eager needs one job to settle allocator and kernels.
WARMUP = {"eager": 1, "fast": 2}
PAGE_SIZE = (1600, 2000)  # gundam: 2x3 tiles, 903 image tokens, 916 prompt tokens (anchors.md)
EXPECTED_GRID = (2, 3)
EXPECTED_IMAGE_TOKENS = 903
# anchors.md targets (H200, this page, batch 1)
VENDOR_DECODE_MS = 23.0
TARGETS = {
    "fast_decode_ms_per_token_max": 1.0,
    "fast_prefill_ms_max": 15.0,
    "eager_decode_vs_vendor_tolerance": 0.05,
    "instrumentation_overhead_max": 0.02,
    "agreement_min": 0.99,
}


def synthetic_page(seed: int = 0) -> Image.Image:
    """A deterministic 1600x2000 document-like page: title, paragraphs, a table and a figure."""
    rng = np.random.default_rng(seed)
    width, height = PAGE_SIZE
    page = Image.new("RGB", PAGE_SIZE, "white")
    draw = ImageDraw.Draw(page)
    draw.text((120, 80), "Synthetic benchmark page (dsocr-workers)", fill="black")
    words = ["profiling", "decode", "prefill", "vision", "token", "latency", "tile", "cache", "expert", "page"]
    y = 150
    for _ in range(3):  # paragraphs
        for _ in range(14):
            line = " ".join(rng.choice(words, size=12))
            draw.text((120, y), line, fill="black")
            y += 24
        y += 30
    for r in range(8):  # a table
        for c in range(5):
            x0, y0 = 120 + 270 * c, y + 40 * r
            draw.rectangle((x0, y0, x0 + 270, y0 + 40), outline="black")
            draw.text((x0 + 10, y0 + 12), f"{rng.integers(0, 10_000)}", fill="black")
    y += 8 * 40 + 60
    draw.rectangle((120, y, width - 120, min(height - 80, y + 420)), outline="black")
    for k in range(40):  # a figure: a noisy curve
        x, dy = 140 + k * 32, int(rng.normal(0, 60))
        draw.ellipse((x, y + 200 + dy, x + 10, y + 210 + dy), fill="navy")
    return page


# ---------------------------------------------------------------------------------------------------
# environment


def environment() -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    # The worker fingerprint's probes (DSOCR_GIT_SHA first: the GPU machine's tree has no .git).
    env["driver"] = nvidia_driver()
    sha = git_sha()
    env["git_sha"] = sha[:7] if sha else None
    return env


# ---------------------------------------------------------------------------------------------------
# measuring


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_job(session: Any, page: Path, tokens: int, options: DecodeOptions) -> tuple[InferenceResult, float]:
    """One job, and its host wall time in ms between two synchronizations."""
    sync()
    start = time.perf_counter()
    result = session.run_inference(page, mode="gundam", max_new_tokens=tokens, infer=options)
    sync()
    return result, (time.perf_counter() - start) * 1e3


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(results: list[InferenceResult], walls: list[float], baseline_bytes: int = 0) -> dict[str, Any]:
    """Medians over runs of the CUDA-event stage timings; peak memory above `baseline_bytes`."""
    t = [r.timings for r in results]
    step_p50 = [float(np.percentile(x.decode_step_ms, 50)) for x in t if x.decode_step_ms]
    step_p90 = [float(np.percentile(x.decode_step_ms, 90)) for x in t if x.decode_step_ms]
    step_p99 = [float(np.percentile(x.decode_step_ms, 99)) for x in t if x.decode_step_ms]
    tokens_per_s = [1e3 * len(x.decode_step_ms) / sum(x.decode_step_ms) for x in t if x.decode_step_ms]
    first = results[0]
    return {
        "runs": len(results),
        "clock": first.timings.clock,
        "preprocess_ms": median([x.preprocess_ms for x in t]),
        "prefill_ms": median([x.prefill_ms for x in t]),
        "vision_ms": median([x.vision_ms for x in t]),
        "sam_ms": median([x.sam_ms for x in t]),
        "clip_ms": median([x.clip_ms for x in t if x.clip_ms is not None]),  # None: a model without CLIP
        "projector_ms": median([x.projector_ms for x in t]),
        "lm_prefill_ms": median([x.lm_prefill_ms for x in t]),
        "decode_ms": median([x.decode_ms for x in t]),
        "decode_ms_per_token_p50": median(step_p50),
        "decode_ms_per_token_p90": median(step_p90),
        "decode_ms_per_token_p99": median(step_p99),
        "decode_ms_per_token_p50_spread": [min(step_p50), max(step_p50)] if step_p50 else None,
        "tokens_per_s": median(tokens_per_s),
        "ttft_ms": median([x.ttft_ms for x in t]),
        "e2e_ms": median([x.e2e_ms for x in t]),
        "host_wall_ms": median(walls),
        "peak_memory_gib": (max((r.memory.peak_bytes if r.memory else 0) for r in results) - baseline_bytes) / 2**30,
        "baseline_allocated_gib": baseline_bytes / 2**30,
        "decode_tokens": first.decode_tokens,
        "stop_reason": first.stop_reason,
        "prompt_tokens": first.prompt_tokens,
        "image_tokens": first.image_tokens,
        "crop_grid": list(first.crop_grid),
        "engine_ran": first.engine,
        "dtype": first.dtype,
        "model": first.model.label,
        "kv_length": first.kv_length,
        "vision_calls": first.vision_calls,
    }


def bench_engine(
    name: str, page: Path, args: argparse.Namespace, options: DecodeOptions, session: Any = None
) -> tuple[Any, dict[str, Any]]:
    from dsocr_workers.engine.session import DeepSeekOCRSession

    report: dict[str, Any] = {"engine_requested": name, "options": options.__dict__}
    # Another session's weights may already sit on the GPU: peaks are reported above this baseline.
    baseline = torch.cuda.memory_allocated() if torch.cuda.is_available() and session is None else 0
    if session is None:
        sync()
        start = time.perf_counter()
        session = DeepSeekOCRSession.from_local(
            args.model, device=args.device, dtype=torch.bfloat16 if args.device.startswith("cuda") else None,
            engine=name, seed=0,
        )
        sync()
        report["load_s"] = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    warmups = []
    for _ in range(args.warmup if args.warmup is not None else WARMUP[name]):
        _, wall = timed_job(session, page, args.tokens, options)
        warmups.append(wall / 1e3)
    report["warmup_wall_s"] = warmups  # the first holds compilation / graph capture (fast engine)
    results, walls = [], []
    for _ in range(args.repeats):
        result, wall = timed_job(session, page, args.tokens, options)
        results.append(result)
        walls.append(wall)
    report.update(summarize(results, walls, baseline))
    report["compile_and_warmup_overhead_s"] = warmups[0] - report["host_wall_ms"] / 1e3 if warmups else None
    if torch.cuda.is_available():
        report["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    checks = {
        "crop_grid_2x3": tuple(results[0].crop_grid) == EXPECTED_GRID,
        "image_tokens_903": results[0].image_tokens == EXPECTED_IMAGE_TOKENS,
        "tokens_forced": all(r.decode_tokens == args.tokens for r in results),
        "same_tokens_every_run": all(r.token_ids == results[0].token_ids for r in results),
    }
    report["checks"] = checks
    return session, report


def bench_instrumentation(session: Any, page: Path, args: argparse.Namespace, options: DecodeOptions) -> dict[str, Any]:
    """Interleaved on/off jobs (alternating which goes first), host wall time between syncs."""
    walls: dict[str, list[float]] = {"on": [], "off": []}
    off_timings_zero = True
    for k in range(args.instrumentation_pairs):
        order = ("on", "off") if k % 2 == 0 else ("off", "on")
        for state in order:
            session.instrumented = state == "on"
            try:
                result, wall = timed_job(session, page, args.tokens, options)
            finally:
                session.instrumented = True
            walls[state].append(wall)
            if state == "off":
                off_timings_zero &= result.timings.prefill_ms == 0.0
    ratios = [a / b for a, b in zip(walls["on"], walls["off"], strict=True)]
    ratio = statistics.median(ratios)
    return {
        "engine": session.engine_name,
        "pairs": args.instrumentation_pairs,
        "wall_ms_on": walls["on"],
        "wall_ms_off": walls["off"],
        "median_on_ms": statistics.median(walls["on"]),
        "median_off_ms": statistics.median(walls["off"]),
        "median_pair_ratio": ratio,
        "overhead": ratio - 1,
        # the spread of the off runs alone: an overhead below it is noise
        "off_spread": (max(walls["off"]) - min(walls["off"])) / statistics.median(walls["off"]),
        "switch_took_effect": off_timings_zero,
    }


# ---------------------------------------------------------------------------------------------------
# report


def verdicts(report: dict[str, Any]) -> dict[str, Any]:
    engines = report.get("engines", {})
    eager, fast = engines.get("eager", {}), engines.get("fast", {})
    out: dict[str, Any] = {}
    if fast.get("decode_ms_per_token_p50") is not None:
        out["fast_decode_le_1ms"] = fast["decode_ms_per_token_p50"] <= TARGETS["fast_decode_ms_per_token_max"]
    if fast.get("prefill_ms") is not None:
        out["fast_prefill_le_15ms"] = fast["prefill_ms"] <= TARGETS["fast_prefill_ms_max"]
    if eager.get("decode_ms_per_token_p50") is not None:
        rel = eager["decode_ms_per_token_p50"] / VENDOR_DECODE_MS - 1
        out["eager_decode_vs_vendor_23ms"] = {"relative": rel, "met": abs(rel) <= TARGETS["eager_decode_vs_vendor_tolerance"]}
    inst = report.get("instrumentation", {})
    if "overhead" in inst:
        out["instrumentation_le_2pct"] = inst["overhead"] <= TARGETS["instrumentation_overhead_max"]
    if isinstance(report.get("agreement"), dict) and "top1" in report["agreement"]:
        out["agreement_ge_99pct"] = report["agreement"]["top1"] >= TARGETS["agreement_min"]
    return out


def environment_line(env: dict[str, Any]) -> str:
    """The machine and versions a table was measured on, as every write-up's header states them."""
    return (f"GPU {env.get('gpu')} (driver {env.get('driver')}), CUDA {env.get('cuda_runtime')}, torch {env['torch']}, "
            f"transformers {env['transformers']}, Python {env['python']}, git {env.get('git_sha')}.")  # fmt: skip


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def dtype_and_label(report: dict[str, Any]) -> str:
    ran = [e for e in report.get("engines", {}).values() if "model" in e]
    return f"{ran[0]['model']}, {ran[0]['dtype']}" if ran else "not loaded"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"### Engine benchmark, {env['date']}",
        "",
        f"{environment_line(env)} "
        f"Model: `{report['model']}` ({dtype_and_label(report)}). Page: synthetic {PAGE_SIZE[0]}x{PAGE_SIZE[1]}, "
        f"gundam; {report['tokens']} decode tokens forced (ignore_eos), no n-gram ban. Medians of {report['repeats']} "
        f"runs after warm-up ({report['warmup']}); stage times from CUDA events.",
        "",
        "| metric | eager | fast | target |",
        "|---|---|---|---|",
    ]
    engines = report.get("engines", {})
    eager, fast = engines.get("eager", {}), engines.get("fast", {})
    rows = [
        ("crop grid / image tokens / prompt tokens",
         lambda e: f"{e.get('crop_grid')} / {e.get('image_tokens')} / {e.get('prompt_tokens')}" if e.get("crop_grid") else "-", ""),
        ("prefill ms (vision + LM)", lambda e: fmt(e.get("prefill_ms")), "fast ≤ 15"),
        ("vision ms (sam / clip / projector)",
         lambda e: f"{fmt(e.get('vision_ms'))} ({fmt(e.get('sam_ms'))} / {fmt(e.get('clip_ms'))} / {fmt(e.get('projector_ms'))})", ""),
        ("lm_prefill ms", lambda e: fmt(e.get("lm_prefill_ms")), ""),
        ("decode ms/token p50 (p90 / p99)",
         lambda e: f"{fmt(e.get('decode_ms_per_token_p50'), 3)} ({fmt(e.get('decode_ms_per_token_p90'), 3)} / {fmt(e.get('decode_ms_per_token_p99'), 3)})",
         "fast ≤ 1.0; eager 23.0 ± 5%"),
        ("tokens/s", lambda e: fmt(e.get("tokens_per_s"), 1), ""),
        ("TTFT ms", lambda e: fmt(e.get("ttft_ms")), ""),
        ("preprocess ms (CPU)", lambda e: fmt(e.get("preprocess_ms")), ""),
        ("peak memory GiB (this session's)", lambda e: fmt(e.get("peak_memory_gib")), ""),
        ("load s / first run s (compile) / steady run s",
         lambda e: f"{fmt(e.get('load_s'))} / {fmt((e.get('warmup_wall_s') or [None])[0])} / "
                   f"{fmt((e.get('host_wall_ms') or 0) / 1e3 if e.get('host_wall_ms') else None)}", ""),
        ("engine that ran", lambda e: fmt(e.get("engine_ran")), ""),
    ]
    for label, cell, target in rows:
        lines.append(f"| {label} | {cell(eager)} | {cell(fast)} | {target} |")
    for name, e in engines.items():
        if "error" in e:
            lines.append(f"\n{name}: ERROR {e['error']}")
    inst = report.get("instrumentation", {})
    if "overhead" in inst:
        lines.append(
            f"\nInstrumentation ({inst['engine']} engine, {inst['pairs']} interleaved pairs, host wall per job): "
            f"on {inst['median_on_ms']:.2f} ms, off {inst['median_off_ms']:.2f} ms, median pair ratio "
            f"{inst['median_pair_ratio']:.4f} → overhead {100 * inst['overhead']:+.2f}% (target ≤ 2%; off-run spread "
            f"{100 * inst['off_spread']:.2f}%; switch took effect: {inst['switch_took_effect']})."
        )
    elif "error" in inst:
        lines.append(f"\nInstrumentation: ERROR {inst['error']}")
    agreement = report.get("agreement", {})
    if "top1" in agreement:
        lines.append(f"\nTeacher-forced top-1 agreement fast vs eager over {agreement['steps']} steps: "
                     f"{100 * agreement['top1']:.2f}% (target ≥ 99%).")
    elif "error" in agreement:
        lines.append(f"\nAgreement: ERROR {agreement['error']}")
    ngram = report.get("fast_ngram20", {})
    if "decode_ms_per_token_p50" in ngram:
        lines.append(f"\nFast engine with no_repeat_ngram_size=20 (vendor default): decode "
                     f"{ngram['decode_ms_per_token_p50']:.3f} ms/token p50, prefill {ngram['prefill_ms']:.2f} ms.")
    lines.append(f"\nVerdicts: {json.dumps(report.get('verdicts', {}))}")
    lines.append(f"Benchmark wall time: {report.get('bench_wall_s', 0):.0f} s.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="full", help="preset name or checkpoint directory")
    parser.add_argument("--engines", default="fast,eager", help="fast first: its numbers are the headline")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up jobs per engine (default: eager 1, fast 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--instrumentation-pairs", type=int, default=7)
    parser.add_argument("--agreement-steps", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=500, help="skip optional sections past this")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny preset)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_engine needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2

    began = time.perf_counter()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report: dict[str, Any] = {
        "environment": environment(),
        "model": args.model,
        "tokens": args.tokens,
        "warmup": args.warmup if args.warmup is not None else WARMUP,
        "repeats": args.repeats,
        "targets": TARGETS,
        "vendor_decode_ms_per_token": VENDOR_DECODE_MS,
        "engines": {},
    }

    def save() -> None:
        report["bench_wall_s"] = time.perf_counter() - began
        report["verdicts"] = verdicts(report)
        if out_dir is not None:
            (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
            (out_dir / "bench.md").write_text(markdown(report))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - began)

    # Same-length timing runs: no n-gram ban, as the vendor's 23.0 ms/token anchor.
    plain = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.png"
        synthetic_page().save(page)
        sessions: dict[str, Any] = {}
        for name in args.engines.split(","):
            print(f"[{time.perf_counter() - began:6.1f}s] engine {name}", flush=True)
            try:
                sessions[name], report["engines"][name] = bench_engine(name, page, args, plain)
            except Exception as exc:  # keep the other sections' numbers
                traceback.print_exc()
                report["engines"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            save()

        target = sessions.get("fast") or sessions.get("eager")
        if target is not None and left() > 30:
            print(f"[{time.perf_counter() - began:6.1f}s] instrumentation on/off ({target.engine_name})", flush=True)
            try:
                report["instrumentation"] = bench_instrumentation(target, page, args, plain)
            except Exception as exc:
                traceback.print_exc()
                report["instrumentation"] = {"error": f"{type(exc).__name__}: {exc}"}
            save()

        if "eager" in sessions and "fast" in sessions and left() > 30:
            print(f"[{time.perf_counter() - began:6.1f}s] teacher-forced agreement", flush=True)
            try:
                from dsocr_workers.engine.verify import teacher_forced_agreement

                top1 = teacher_forced_agreement(sessions["eager"], sessions["fast"], page, steps=args.agreement_steps)
                report["agreement"] = {"top1": float(top1), "steps": args.agreement_steps}
            except Exception as exc:
                traceback.print_exc()
                report["agreement"] = {"error": f"{type(exc).__name__}: {exc}"}
            save()

        if "fast" in sessions and left() > 120:
            print(f"[{time.perf_counter() - began:6.1f}s] fast engine with the 20-gram ban", flush=True)
            try:
                vendor = DecodeOptions(no_repeat_ngram_size=20, ignore_eos=True)
                _, report["fast_ngram20"] = bench_engine("fast", page, args, vendor, session=sessions["fast"])
            except Exception as exc:
                traceback.print_exc()
                report["fast_ngram20"] = {"error": f"{type(exc).__name__}: {exc}"}
            save()

    save()
    text = markdown(report)
    if out_dir is None:
        print(json.dumps(report, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
