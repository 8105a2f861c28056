"""DeepSeek-OCR-2 against DeepSeek-OCR on one GPU, in one process, side by side: one command, one table.

    python benchmarks/bench_families.py --out $OUT                       # one H200: full vs ocr2-full
    python benchmarks/bench_families.py --models tiny,ocr2-tiny --device cpu --tokens 4 --repeats 1 \\
        --pages datasets/samples/samples.txt --concurrency 2 --out /tmp/families   # CPU smoke

Both models are loaded at once (presets: seeded RANDOM WEIGHTS, labelled so in every output; a checkpoint
directory works as well), each with the fast engine on CUDA (eager on the CPU), each page prepared in its
family's default mode and crop limit. Then:
  1. warm-up: every page once through each model's batch-1 path (graphs per page shape and prompt length);
  2. batch-1, interleaved: per round and page, one job of each model (which goes first alternates),
     `--tokens` decode tokens forced (EOS ignored). Per job, the engine's own timings (CUDA events): SAM,
     the view encoder (CLIP for DeepSeek-OCR, the Qwen2 encoder for DeepSeek-OCR-2), projector, LM
     prefill, prefill, decode ms/token (the job's median step), TTFT, e2e; the visual tokens per page.
     Medians over jobs with 95% bootstrap intervals (dsocr_workers/report/stats.py), and the paired
     OCR-2 / OCR-1 ratio per (page, round) with its interval;
  3. batched, per concurrency level, one model after the other (the order alternates by level): the
     batched engine of bench_serving.py (`engine_level`, the same closed loop), output tokens/s and
     pages/day; the best level per model.
Pages/day per GPU: batch-1 from the mean e2e (one page at a time), batched at the best level; both at
`--tokens` output tokens a page, since random weights say nothing of a real page's length.
No new section starts past `--budget-s`; every section is written into families.json / families.md as
it ends, so a run cut short still reports what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, fmt  # noqa: E402
from benchmarks.bench_serving import (  # noqa: E402
    PEAK_TBPS,
    SECONDS_PER_DAY,
    engine_level,
    load_pages,
    warm_batch1,
    weight_bytes,
)
from dsocr_workers.engine.batched.slots import SlotAttention  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions, InferenceResult  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.model.config import dtype_name  # noqa: E402
from dsocr_workers.report.stats import Estimate, Summary, paired_ratios  # noqa: E402
from dsocr_workers.stages import TIMINGS  # noqa: E402

DEFAULT_PAGES = "datasets/omnidocbench/subsets/demo-18.txt"
# Per job, the figures compared; "encoder_ms" is the family's view-encoder stage (CLIP or Qwen2).
FIGURES = ("sam_ms", "encoder_ms", "projector_ms", "lm_prefill_ms", "prefill_ms", "decode_ms_per_token",
           "ttft_ms", "e2e_ms")  # fmt: skip
LABELS = {"sam_ms": "SAM ms", "encoder_ms": "view encoder ms (CLIP / Qwen2)", "projector_ms": "projector ms",
          "lm_prefill_ms": "LM prefill ms", "prefill_ms": "prefill ms (vision + LM)",
          "decode_ms_per_token": "decode ms/token", "ttft_ms": "TTFT ms", "e2e_ms": "batch-1 e2e ms"}  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def encoder_column(session: DeepSeekOCRSession) -> str:
    """The StageTimings field its family's view encoder is timed in (`clip_ms`, `qwen2_ms`)."""
    return next(t.column for t in TIMINGS if t.stage == session.family.encoder_stage)


def job_row(model: str, page: str, round_: int, result: InferenceResult, encoder: str) -> dict[str, Any]:
    t = result.timings
    steps = t.decode_step_ms
    return {
        "model": model, "page": page, "round": round_, "image_tokens": result.image_tokens,
        "prompt_tokens": result.prompt_tokens, "output_tokens": len(result.token_ids), "sam_ms": t.sam_ms,
        "encoder_ms": getattr(t, encoder), "projector_ms": t.projector_ms, "lm_prefill_ms": t.lm_prefill_ms,
        "prefill_ms": t.prefill_ms, "decode_ms_per_token": statistics.median(steps) if steps else None,
        "ttft_ms": t.ttft_ms, "e2e_ms": t.e2e_ms, "clock": t.clock,
    }  # fmt: skip


def estimate(e: Estimate) -> dict[str, Any]:
    return {"value": e.value, "low": e.low, "high": e.high, "n": e.n}


def interleaved_batch1(sessions: dict[str, DeepSeekOCRSession], pages: dict[str, list], args: argparse.Namespace,
                       options: DecodeOptions) -> list[dict[str, Any]]:  # fmt: skip
    """Per round and page, one job of each model, the first model alternating."""
    names = list(sessions)
    rows = []
    for round_ in range(args.repeats):
        for k in range(min(len(p) for p in pages.values())):
            for model in names if (round_ + k) % 2 == 0 else names[::-1]:
                session = sessions[model]
                name, page = pages[model][k]
                result = session.run_on_device(page, args.tokens, options).finish()
                rows.append(job_row(model, name, round_, result, encoder_column(session)))
    return rows


def summarize_batch1(rows: list[dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """Per model: each figure's median with its interval, the visual tokens per page, batch-1 pages/day;
    and the last model over the first, paired by (page, round)."""
    out: dict[str, Any] = {}
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        figures = {f: estimate(Summary.from_values([r[f] for r in mine]).p50) for f in FIGURES}
        tokens = sorted({r["page"]: r["image_tokens"] for r in mine}.values())
        mean_e2e_s = statistics.mean(r["e2e_ms"] for r in mine) / 1e3
        out[model] = {
            "jobs": len(mine), "figures": figures,
            "visual_tokens": {"min": tokens[0], "median": statistics.median(tokens), "max": tokens[-1],
                              "mean": statistics.mean(tokens)},
            "batch1_pages_per_day": SECONDS_PER_DAY / mean_e2e_s,
        }  # fmt: skip
    if len(models) == 2:
        a, b = ({(r["page"], r["round"]): r for r in rows if r["model"] == m} for m in models)
        keys = sorted(a.keys() & b.keys())
        out["ratio"] = {
            f: estimate(paired_ratios([[b[k][f]] if b[k][f] else [] for k in keys],
                                      [[a[k][f]] if a[k][f] else [] for k in keys]).p50)
            for f in (*FIGURES, "image_tokens")
        }  # fmt: skip
    return out


def batched(sessions: dict[str, DeepSeekOCRSession], pages: dict[str, list], args: argparse.Namespace,
            options: DecodeOptions, report: dict[str, Any], save: Any) -> None:  # fmt: skip
    """Each level on each model's batched engine (bench_serving's), the first model alternating."""
    env = report["environment"]
    peak_tbps = next((v for k, v in PEAK_TBPS.items() if k in env.get("gpu", "")), None)
    # bench_serving's closed loop as it runs by default: every page decodes `--tokens`, whole prompts.
    serving = argparse.Namespace(tokens=args.tokens, reserve_gib=args.reserve_gib, eager_step=False,
                                 no_graphs=False, min_requests=args.min_requests, tokens_range_ratio=0.0,
                                 profile=0)  # fmt: skip
    attention: SlotAttention = "filled" if args.device.startswith("cuda") else "masked"
    weights = {model: weight_bytes(s) for model, s in sessions.items()}
    names = list(sessions)
    for k, concurrency in enumerate(sorted({int(c) for c in args.concurrency.split(",")})):
        for model in names if k % 2 == 0 else names[::-1]:
            row: dict[str, Any] = {"model": model, "concurrency": concurrency}
            if time.perf_counter() - args.began > args.budget_s:
                row["skipped"] = f"past --budget-s {args.budget_s:.0f}"
            else:
                try:
                    _, level, _ = engine_level(sessions[model], concurrency, pages[model], serving, options,
                                               attention, None, "window", weights[model],
                                               peak_tbps and peak_tbps * 1e12)  # fmt: skip
                    level.pop("per_page", None)
                    row.update(level)
                except Exception:  # a level that fails is recorded; the others still run
                    row["error"] = traceback.format_exc(limit=4)
            report["batched"].append(row)
            gc.collect()  # the level's engine and KV cache leave before the next one's are allocated
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            save()
    for model in names:
        ran = [r for r in report["batched"] if r["model"] == model and "output_tokens_per_s" in r]
        if ran:
            best = max(ran, key=lambda r: r["output_tokens_per_s"])
            report["best_batched"][model] = {key: best[key] for key in
                                             ("concurrency", "output_tokens_per_s", "request_throughput", "pages_per_day")}  # fmt: skip


def cell(e: dict[str, Any] | None, digits: int = 2) -> str:
    if not e or e.get("value") is None:
        return "-"
    if e.get("low") is None:
        return fmt(float(e["value"]), digits)
    return (
        f"{fmt(float(e['value']), digits)} [{fmt(float(e['low']), digits)}, {fmt(float(e['high']), digits)}]"
    )


def markdown(report: dict[str, Any]) -> str:
    env, models, summary = report["environment"], report["models"], report.get("batch1", {})
    title = {m: report["labels"][m] for m in models}
    lines = [
        f"### DeepSeek-OCR-2 vs DeepSeek-OCR, {env.get('gpu', 'CPU')} ({env['date']})",
        "",
        "Models: " + "; ".join(f"`{m}` = {title[m]}" for m in models) + f"; {report['dtype']}, engine "
        f"{report['engine']}. torch {env['torch']}, transformers {env['transformers']}, git {env.get('git_sha')}. "
        f"Pages: {report['pages']} ({report['modes']}), {report['tokens']} output tokens each (EOS ignored), "
        f"{report['repeats']} interleaved rounds. Medians over jobs [95% bootstrap interval]; "
        + ("CUDA events." if env.get("gpu") else "CPU smoke run: host clock, numbers meaningless."),
        f"Command: `{report['command']}`",
        "",
        "| figure | "
        + " | ".join(f"`{m}`" for m in models)
        + (" | ratio (paired) |" if "ratio" in summary else " |"),
        "|---|" + "---|" * (len(models) + ("ratio" in summary)),
    ]
    for f in (*FIGURES, "visual tokens per page (min / median / max)", "batch-1 pages/day", "best batched output tok/s",
              "batched pages/day (at that concurrency)"):  # fmt: skip
        if f in FIGURES:
            cells = [
                cell(summary.get(m, {}).get("figures", {}).get(f), 3 if "token" in f else 2) for m in models
            ]
            ratio = summary.get("ratio", {}).get(f)
            label = LABELS[f]
        elif f.startswith("visual"):
            cells = [
                ("{min} / {median} / {max}".format(**summary[m]["visual_tokens"]) if m in summary else "-")
                for m in models
            ]
            ratio, label = summary.get("ratio", {}).get("image_tokens"), f
        elif f == "batch-1 pages/day":
            cells = [fmt(summary.get(m, {}).get("batch1_pages_per_day"), 0) for m in models]
            ratio, label = None, f
        else:
            best = report.get("best_batched", {})
            key = "output_tokens_per_s" if f.startswith("best") else "pages_per_day"
            cells = [
                f"{fmt(best[m][key], 0)} (c={best[m]['concurrency']})" if m in best else "-" for m in models
            ]
            ratio, label = None, f
        lines.append(
            f"| {label} | " + " | ".join(cells) + (f" | {cell(ratio, 3)} |" if "ratio" in summary else " |")
        )
    errors = [f"- {k}: {v}" for k, v in report.get("errors", {}).items()]
    errors += [f"- batched {r['model']} c={r['concurrency']}: {r.get('error') or r.get('skipped')}"
               for r in report.get("batched", []) if "error" in r or "skipped" in r]  # fmt: skip
    if errors:
        lines += ["", "Not measured:", *errors]
    if report.get("left_out"):
        lines += ["", "Pages left out:", "```", *report["left_out"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="full,ocr2-full", help="two presets or checkpoints: A,B (ratios are B/A)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--pages", default=DEFAULT_PAGES, help="a file list")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per page (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved batch-1 rounds over the pages")
    parser.add_argument("--concurrency", default="16,64", help="batched levels ('' for none)")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--reserve-gib", type=float, default=4.0)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=20)
    parser.add_argument(
        "--budget-s", type=float, default=480, help="start no batched level past this many seconds"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    )
    args = parser.parse_args()
    args.began = time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    if not models or len(models) > 2 or len(set(models)) != len(models):
        parser.error(f"--models takes one or two distinct models, not {args.models!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--device cpu for a smoke run)")
    options = DecodeOptions(no_repeat_ngram_size=args.no_repeat_ngram_size, ignore_eos=True)
    engine = "fast" if args.device.startswith("cuda") else "eager"
    sessions = {m: DeepSeekOCRSession.from_local(m, device=args.device, dtype=args.dtype, engine=engine, seed=0)
                for m in models}  # fmt: skip
    first = next(iter(sessions.values()))
    report: dict[str, Any] = {
        "environment": environment(), "command": shlex.join(["python", "benchmarks/bench_families.py", *sys.argv[1:]]),
        "models": models, "labels": {m: f"{s.family.title}, {s.source.label}" for m, s in sessions.items()},
        "engine": first.engine_name, "dtype": dtype_name(first.dtype), "tokens": args.tokens,
        "repeats": args.repeats, "options": options.__dict__, "errors": {}, "batched": [], "best_batched": {},
    }  # fmt: skip

    def save() -> None:
        report["wall_s"] = time.perf_counter() - args.began
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "families.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
            (args.out / "families.md").write_text(markdown(report))

    pages, left_out = {}, []
    for model, session in sessions.items():
        mode = session.family.default_mode
        pages[model], missing = load_pages(session, [args.pages], mode, session.max_crops())
        left_out += [line for line in missing if line not in left_out]
    report.update(pages=min(len(p) for p in pages.values()), left_out=left_out,
                  modes=", ".join(f"{m}: {s.family.default_mode}" for m, s in sessions.items()))  # fmt: skip
    report["warmup_s"] = {m: warm_batch1(s, pages[m], args.tokens, options) for m, s in sessions.items()}
    save()
    try:
        report["jobs"] = interleaved_batch1(sessions, pages, args, options)
        report["batch1"] = summarize_batch1(report["jobs"], models)
    except Exception:  # the batched section still runs
        report["errors"]["batch1"] = traceback.format_exc(limit=4)
    save()
    if args.concurrency:
        batched(sessions, pages, args, options, report, save)
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
