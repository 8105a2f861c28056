"""Vendor side by side: the vendor's HF remote code against our eager and fast engines, on one GPU, one
command, the same random weights and the same page; DeepSeek-OCR (`--model full`) or DeepSeek-OCR-2
(`--model ocr2-full`).

    python benchmarks/bench_vendor.py --vendor-code DIR --vendor-site DIR [--model ocr2-full] [--dtype bfloat16] [--out DIR]

  --vendor-code  the five .py files of the model's HF repository (DeepSeek-OCR: modeling_deepseekocr.py,
                 deepencoder.py; DeepSeek-OCR-2: modeling_deepseekocr2.py, deepencoderv2.py; both:
                 modeling_deepseekv2.py, configuration_deepseek_v2.py, conversation.py); read from there,
                 never copied into this repository.
  --vendor-site  a directory holding transformers 4.46.3 and what it needs that the host lacks
                 (`pip install --no-deps --target DIR transformers==4.46.3 tokenizers==0.20.3
                 huggingface-hub==0.26.3 einops easydict addict`): the vendor code fails to import from
                 transformers 4.48 on (spec §6.7), so its side runs in a child process with that directory
                 first on its path (benchmarks/vendor_path.py says what runs there and how it is timed).

Steps: (1) the `--model` preset (seeded random weights, labelled as such) is written once as a checkpoint
in the vendor's layout and key names; (2) the page of anchors.md (synthetic 1600x2000, gundam; DeepSeek-OCR: 2x3 tiles,
916 prompt tokens) is preprocessed once by our family's code and handed to both sides; (3) the vendor path loads the
checkpoint with its own `from_pretrained` and runs warm-up + timed jobs on the split path; (4) each of our
engines loads the same checkpoint through our vendor-layout loader, alone on the GPU (peak memory is each
path's own, weights included), runs the same jobs, then is teacher-forced on the vendor's greedy tokens
(the fraction of steps where its top-1 equals the vendor's token) and run free (the first step where its
greedy tokens leave the vendor's). Every job forces `--tokens` decode tokens (EOS ignored, no n-gram ban).
Stage times are CUDA events; decode ms/token is the median step of each run, median over runs.

Output: $OUT (or --out) vendor.json and vendor.md; the table is printed last. `--device cpu` is a smoke
run of the script itself (a small mode, a few tokens: the full model is large for a CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, fmt, synthetic_page  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.engine.verify import teacher_forced_top1  # noqa: E402
from dsocr_workers.model.checkpoint import save_preset  # noqa: E402
from dsocr_workers.model.families import family_of_preset  # noqa: E402
from dsocr_workers.model.tokenizer import OCRTokenizer  # noqa: E402
from dsocr_workers.stages import TIMINGS  # noqa: E402

# The vendor code hard-codes every vision size and the 1280-wide projector: only the full presets load.
PRESETS = ("full", "ocr2-full")
EAGER_TOLERANCE = 0.05  # issue 10 item 5: eager within ±5% of the vendor path, or explained
WARMUP = {"eager": 1, "fast": 2}  # fast: the first job compiles, the second captures the decode graph
# encoder_ms: the family's view encoder (CLIP, or OCR-2's Qwen2 encoder).
TIMED = ("prefill_ms", "vision_ms", "sam_ms", "encoder_ms", "projector_ms", "lm_prefill_ms")
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs; decode ms/token = median over runs of each run's median step."""
    steps = [statistics.median(r["decode_step_ms"]) for r in runs if r["decode_step_ms"]]
    out: dict[str, Any] = {key: median([r[key] for r in runs]) for key in TIMED}
    out["decode_ms_per_token"] = median(steps)
    out["decode_ms_per_token_spread"] = [min(steps), max(steps)] if steps else None
    out["tokens_per_s"] = 1e3 / out["decode_ms_per_token"] if out["decode_ms_per_token"] else None
    out["timed_runs"] = len(runs)
    return out


def save_page(page: Any, path: Path) -> None:
    """The page as the vendor forward takes it: normalised float32 pixels, an all-zero crop tensor when
    there are no tiles (the vendor's "no crops" signal, spec §12), (cols, rows)."""
    tiles = page.tiles if page.tiles is not None else torch.zeros(1, 3, page.mode.base_size, page.mode.base_size)
    torch.save({
        "input_ids": page.input_ids, "images_seq_mask": page.images_seq_mask, "global_view": page.global_view,
        "tiles": tiles, "crop_grid": list(page.crop_grid),
    }, path)  # fmt: skip


def run_vendor(args: argparse.Namespace, checkpoint: Path, inputs: Path, out: Path, timeout: float) -> dict[str, Any]:
    command = [
        sys.executable, str(REPO / "benchmarks" / "vendor_path.py"), "--vendor-code", str(args.vendor_code),
        "--family", family_of_preset(args.model).name, "--checkpoint", str(checkpoint), "--inputs", str(inputs), "--tokens", str(args.tokens),
        "--repeats", str(args.repeats), "--dtype", args.dtype, "--device", args.device, "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.vendor_site.resolve()), os.environ.get("PYTHONPATH", "")])}
    log("vendor: " + shlex.join(command))
    done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vendor path exited {done.returncode}: {done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    report.update(summarize(report["runs"]))
    return report


def bench_ours(engine: str, args: argparse.Namespace, checkpoint: Path, image: Path, vendor_tokens: list[int] | None) -> dict[str, Any]:
    """One engine alone on the device: load, warm-up, timed jobs, then agreement with the vendor's tokens."""
    cuda = args.device.startswith("cuda")
    began = time.perf_counter()
    session = DeepSeekOCRSession.from_local(checkpoint, device=args.device, dtype=args.dtype, engine=engine)
    if cuda:
        torch.cuda.synchronize()
    report: dict[str, Any] = {"load_s": time.perf_counter() - began, "engine_ran": session.engine_name,
                              "model": session.source.label}  # fmt: skip
    options = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)

    def job() -> Any:
        return session.run_inference(image, mode=args.mode, max_new_tokens=args.tokens, infer=options)

    warm_walls = []
    for _ in range(WARMUP[engine] if args.warmup is None else args.warmup):
        start = time.perf_counter()
        job()
        warm_walls.append(time.perf_counter() - start)
    report["warmup_wall_s"] = warm_walls  # the first holds the fast engine's compilation
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    results = [job() for _ in range(args.repeats)]
    if cuda:
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    encoder = next(t.column for t in TIMINGS if t.stage == session.family.encoder_stage)
    ours = {key: encoder if key == "encoder_ms" else key for key in TIMED}
    runs = [{**{key: getattr(r.timings, column) for key, column in ours.items()},
             "decode_step_ms": list(r.timings.decode_step_ms)} for r in results]  # fmt: skip
    report.update(summarize(runs))
    report["token_ids"] = results[0].token_ids
    if vendor_tokens:
        picks = teacher_forced_top1(session, image, vendor_tokens, options, args.mode)
        report["teacher_forced_top1_vs_vendor"] = sum(a == b for a, b in zip(picks, vendor_tokens, strict=True)) / len(picks)
        free = results[0].token_ids
        report["free_running_same_steps"] = next(
            (k for k, (a, b) in enumerate(zip(free, vendor_tokens, strict=False)) if a != b), min(len(free), len(vendor_tokens))
        )
    return report


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    paths = report["paths"]
    vendor, eager, fast = (paths.get(name, {}) for name in ("vendor", "eager", "fast"))
    lines = [
        f"### Vendor side by side, {env['date']}",
        "",
        f"GPU {env.get('gpu')} (driver {env.get('driver')}), CUDA {env.get('cuda_runtime')}, torch {env['torch']}; "
        f"ours on transformers {env['transformers']}, the vendor's HF code on transformers {vendor.get('transformers')}. "
        f"Python {env['python']}, git {env.get('git_sha')}. Weights: the `{report['preset']}` preset ({report['family']}), RANDOM WEIGHTS (seed 0), "
        f"one checkpoint in the vendor layout loaded by both; {report['dtype']}. Page: synthetic 1600x2000, "
        f"{report['mode']}; {report['tokens']} decode tokens forced, no n-gram ban. Medians of {report['repeats']} "
        f"runs after warm-up; " + ("CUDA events." if env.get("gpu") else "CPU smoke run: host clock, numbers meaningless."),
        f"Command: `{report['command']}`",
        "",
        "| metric | vendor | eager | eager / vendor | fast | fast / vendor |",
        "|---|---|---|---|---|---|",
    ]

    def ratio(ours: dict[str, Any], key: str) -> str:
        a, b = ours.get(key), vendor.get(key)
        return f"{a / b:.3f}" if a and b else "-"

    rows = [("prefill ms (vision + LM)", "prefill_ms", 2), ("vision ms", "vision_ms", 2), ("SAM ms", "sam_ms", 2),
            ("view encoder ms (CLIP / Qwen2)", "encoder_ms", 2), ("projector ms", "projector_ms", 3), ("LM prefill ms", "lm_prefill_ms", 2),
            ("decode ms/token", "decode_ms_per_token", 3), ("tokens/s", "tokens_per_s", 1),
            ("peak memory GiB (weights included)", "peak_memory_gib", 2), ("load s", "load_s", 1)]  # fmt: skip
    for label, key, digits in rows:
        lines.append(f"| {label} | {fmt(vendor.get(key), digits)} | {fmt(eager.get(key), digits)} | {ratio(eager, key)} "
                     f"| {fmt(fast.get(key), digits)} | {ratio(fast, key)} |")  # fmt: skip
    lines.append(
        f"| teacher-forced top-1 = vendor's greedy token | 1 | {fmt(eager.get('teacher_forced_top1_vs_vendor'), 4)} | "
        f"| {fmt(fast.get('teacher_forced_top1_vs_vendor'), 4)} | |"
    )
    lines.append(
        f"| free-running greedy: steps equal to the vendor's | {report['tokens']} | {fmt(eager.get('free_running_same_steps'))} "
        f"| | {fmt(fast.get('free_running_same_steps'))} | |"
    )
    for name, path in paths.items():
        if "error" in path:
            lines.append(f"\n{name}: ERROR {path['error']}")
    if eager.get("decode_ms_per_token") and vendor.get("decode_ms_per_token"):
        rel = eager["decode_ms_per_token"] / vendor["decode_ms_per_token"] - 1
        lines.append(f"\nEager decode vs the vendor's: {rel:+.1%} (target ±{EAGER_TOLERANCE:.0%}).")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vendor-code", type=Path, required=True)
    parser.add_argument("--vendor-site", type=Path, required=True)
    parser.add_argument("--model", choices=PRESETS, default="full", help="full: DeepSeek-OCR; ocr2-full: DeepSeek-OCR-2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up jobs per engine (default: eager 1, fast 2)")
    parser.add_argument("--engines", default="eager,fast")
    parser.add_argument("--budget-s", type=float, default=560, help="the vendor child's time limit comes out of it")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_vendor needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2

    report: dict[str, Any] = {
        "environment": environment(), "command": shlex.join(["python", "benchmarks/bench_vendor.py", *sys.argv[1:]]),
        "preset": args.model, "family": family_of_preset(args.model).title, "dtype": args.dtype, "mode": args.mode, "tokens": args.tokens, "repeats": args.repeats,
        "paths": {},
    }  # fmt: skip

    def save() -> None:
        report["bench_wall_s"] = time.perf_counter() - _T0
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "vendor.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.out / "vendor.md").write_text(markdown(report))

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        log(f"writing the {args.model} preset as a vendor-layout checkpoint")
        checkpoint = save_preset(args.model, scratch / "checkpoint", seed=0)
        image = scratch / "page.png"
        synthetic_page().save(image)
        family = family_of_preset(args.model)
        page = family.prepare_page(image, OCRTokenizer.build_preset().encode, mode=args.mode)
        report["page"] = {"crop_grid": list(page.crop_grid), "image_tokens": page.image_tokens,
                          "prompt_tokens": page.prompt_tokens}  # fmt: skip
        save_page(page, scratch / "page.pt")
        del page

        vendor_tokens = None
        try:
            log("vendor path")
            budget = args.budget_s - (time.perf_counter() - _T0)
            vendor = run_vendor(args, checkpoint, scratch / "page.pt", scratch / "vendor.json", timeout=budget)
            vendor_tokens = vendor["runs"][0]["token_ids"]
            report["paths"]["vendor"] = {k: v for k, v in vendor.items() if k != "runs"}
            report["paths"]["vendor"]["same_tokens_every_run"] = all(r["token_ids"] == vendor_tokens for r in vendor["runs"])
        except Exception as exc:  # keep our engines' numbers
            traceback.print_exc()
            report["paths"]["vendor"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
        for engine in args.engines.split(","):
            log(f"engine {engine}")
            try:
                report["paths"][engine] = bench_ours(engine, args, checkpoint, image, vendor_tokens)
            except Exception as exc:
                traceback.print_exc()
                report["paths"][engine] = {"error": f"{type(exc).__name__}: {exc}"}
            save()
            gc.collect()  # the engine's weights leave the device before the next one loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    text = markdown(report)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
