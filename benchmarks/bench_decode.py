"""Decode at the hardware's pace (issue 10 item 1): the fast engine's decode step before and after each
change, side by side in one process on one GPU.

Variants of the fast engine, `full` preset (RANDOM weights) in bf16, the anchors' page (synthetic
1600x2000, gundam 2x3 tiles, 916 prompt tokens), 256 tokens with EOS ignored, NVTX and CUDA events on:
  grouped  transformers' grouped_mm experts, q/k/v and gate/up as separate GEMMs (the engine before)
  fused    + q/k/v and gate/up each read as one matrix (model/fused.py)
  fast     + Triton GEMVs over the selected experts (model/selected_experts.py): `engine="fast"` as shipped
  fast_math  an experiment: `fast` with its decode step compiled under SDPA's math backend (inductor
           then writes decode attention itself, instead of a cuDNN flash kernel that runs one block per
           head at one query)
Every variant picks tokens with the same two-stage argmax (engine/sampling.py `first_argmax`).

Sections, each written to --out as soon as it ends (decode-<UTC date>.json/.md):
  1. kernel sweep: the selected-experts kernels alone at batch 1 for a few block sizes (µs per call,
     CUDA events over 200 calls after 20 warm-up calls).
  2. rounds: after warm-up (compilation, graph capture; reported apart), rounds of one job per variant in
     shuffled order until the time budget. Per job the median of its decode steps (CUDA events); per
     variant the median over jobs with a 95% bootstrap interval (scipy.stats.bootstrap); the ratio of
     each variant to `grouped` from the per-round ratios, with its interval.
  3. profile: torch.profiler over a 96-token and a 64-token job of each variant; the difference over 32
     steps gives the kernels and GPU time per decode step; the top kernels of `fast` are kept.
  4. agreement: greedy tokens of each variant, teacher-forced on the eager engine's 256 tokens (same
     weights): the fraction of equal top-1 picks.

    python benchmarks/bench_decode.py --budget-s 540            # one H100/H200, one `run` call
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_engine  # noqa: E402
from benchmarks.bench_engine import environment, sync, synthetic_page  # noqa: E402
from dsocr_workers.engine.generate import decode_one_token  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions, ModelSource  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.engine.variants.fast import FastEngine  # noqa: E402
from dsocr_workers.engine.verify import teacher_forced_agreement  # noqa: E402
from dsocr_workers.model.checkpoint import build_preset  # noqa: E402
from dsocr_workers.model.fused import fuse_projections  # noqa: E402
from dsocr_workers.report.stats import Estimate, Summary  # noqa: E402

VARIANTS = ("grouped", "fused", "fast", "fast_math")
TARGET_MS_PER_TOKEN = 1.0
SEED = 20261123
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def math_attention_step(*args: Any) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return decode_one_token(*args)


class MathAttentionEngine(FastEngine):
    """fast_math: the fast engine compiling a decode step that forces the math attention backend."""

    def decode_function(self) -> Callable[..., torch.Tensor]:
        return math_attention_step


def build_variant(name: str, model: str, device: str) -> DeepSeekOCRSession:
    if name.startswith("fast"):
        engine = MathAttentionEngine() if name == "fast_math" else FastEngine()
        return DeepSeekOCRSession.from_local(model, device=device, dtype=torch.bfloat16, engine=engine)
    loaded = build_preset(model, seed=0, device=torch.device(device), dtype=torch.bfloat16,
                          attn_implementation="sdpa", experts_implementation="grouped_mm")  # fmt: skip
    if name == "fused":
        fuse_projections(loaded.model.language_model)
    source = ModelSource("preset", model, random_weights=True, seed=0, fingerprint=loaded.fingerprint)
    return DeepSeekOCRSession(loaded, source, torch.device(device), torch.bfloat16, FastEngine())


def decode_ms_per_token(result: Any) -> float:
    return float(statistics.median(result.timings.decode_step_ms))


def interval(estimate: Estimate) -> dict[str, Any]:
    """An Estimate (report/stats.py: percentile bootstrap over jobs) as the JSON entry."""
    return asdict(estimate)


# ---------------------------------------------------------------------------------------------------
# 1. the selected-experts kernels alone


def graph_us_per_call(call: Any, calls: int = 50, replays: int = 5) -> float:
    """GPU time of `call` per call: `calls` calls captured in one CUDA graph, replayed (no launch cost)."""
    for _ in range(3):
        call()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (calls * replays) * 1e3


def section_sweep(model: str, device: str) -> dict[str, Any]:
    """Block configurations of the two kernels, each swept with the other at its default, on one MoE
    layer of `model`'s shapes with random weights; the fastest of each is what the `fast` variant uses."""
    from dsocr_workers.model import selected_experts as se
    from dsocr_workers.model.deepseek_ocr.config import PRESETS

    text = PRESETS[model].text
    experts, inter, hidden_size = text.n_routed_experts, text.moe_intermediate_size, text.hidden_size
    generator = torch.Generator(device=device).manual_seed(SEED)
    gate_up = torch.randn(experts, 2 * inter, hidden_size, device=device, generator=generator).bfloat16() * 0.02
    down = torch.randn(experts, hidden_size, inter, device=device, generator=generator).bfloat16() * 0.02
    hidden = torch.randn(1, hidden_size, device=device, generator=generator).bfloat16()
    index = torch.randperm(experts, device=device, generator=generator)[: text.num_experts_per_tok].view(1, -1)
    weights = torch.rand(1, text.num_experts_per_tok, device=device, generator=generator)
    reference = se.launch_selected_experts(hidden, gate_up, down, index, weights)
    configs = [se.BlockConfig(rows, k, warps) for rows in (2, 4, 8, 16) for k in (256, 512, 1024, 2048)
               for warps in (4, 8)]  # fmt: skip
    out: dict[str, Any] = {"pairs": int(index.numel()), "default": {"gate_up": asdict(se.GATE_UP_BLOCKS),
                                                                    "down": asdict(se.DOWN_BLOCKS)}}  # fmt: skip
    best: dict[str, se.BlockConfig] = {}
    for kernel in ("gate_up", "down"):
        rows = []
        for config in [se.GATE_UP_BLOCKS if kernel == "gate_up" else se.DOWN_BLOCKS, *configs]:
            blocks = {f"{kernel}_blocks": config}

            def call(blocks: dict[str, Any] = blocks) -> torch.Tensor:
                return se.launch_selected_experts(hidden, gate_up, down, index, weights, **blocks)

            diff = float((call() - reference).abs().max())
            rows.append({**asdict(config), "us_per_call": graph_us_per_call(call), "max_abs_diff": diff})
        rows.sort(key=lambda row: row["us_per_call"])
        best[kernel] = se.BlockConfig(rows[0]["rows"], rows[0]["k"], rows[0]["warps"])
        out[kernel] = rows
    baseline = graph_us_per_call(lambda: se.launch_selected_experts(hidden, gate_up, down, index, weights))
    tuned = graph_us_per_call(lambda: se.launch_selected_experts(hidden, gate_up, down, index, weights,
                                                                 best["gate_up"], best["down"]))  # fmt: skip
    out["best"] = {kernel: asdict(config) for kernel, config in best.items()}
    out["us_per_call"] = {"default": baseline, "best": tuned}
    out["bytes_read"] = text.num_experts_per_tok * 3 * inter * hidden_size * 2
    se.GATE_UP_BLOCKS, se.DOWN_BLOCKS = best["gate_up"], best["down"]  # the `fast` variant runs these
    log(f"  sweep: default {baseline:.1f} µs, best {tuned:.1f} µs per call ({out['best']})")
    return out


# ---------------------------------------------------------------------------------------------------
# 2. rounds


def timed_job(session: DeepSeekOCRSession, page: Path, tokens: int) -> Any:
    return bench_engine.timed_job(session, page, tokens, DecodeOptions(ignore_eos=True))[0]


def section_rounds(sessions: dict[str, DeepSeekOCRSession], page: Path, tokens: int, budget_s: float,
                   min_rounds: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(SEED)
    began, rounds = time.perf_counter(), []
    while True:
        elapsed = time.perf_counter() - began
        if len(rounds) >= min_rounds and elapsed + (elapsed / max(len(rounds), 1)) > budget_s:
            break
        order = list(sessions)
        rng.shuffle(order)
        entry: dict[str, Any] = {"order": order}
        for name in order:
            result = timed_job(sessions[name], page, tokens)
            entry[name] = {"ms_per_token": decode_ms_per_token(result), "prefill_ms": result.timings.prefill_ms,
                           "cold": list(result.cold_reasons)}  # fmt: skip
        rounds.append(entry)
        if len(rounds) % 5 == 0:
            log(f"  rounds: {len(rounds)} in {time.perf_counter() - began:.0f} s")
    kept = [r for r in rounds if not any(r[name]["cold"] for name in sessions)]
    out: dict[str, Any] = {"rounds": len(rounds), "rounds_used": len(kept), "tokens": tokens, "variants": {}}
    for name in sessions:
        values = [r[name]["ms_per_token"] for r in kept]
        out["variants"][name] = {
            "ms_per_token": interval(Summary.from_values(values).p50),
            "prefill_ms": interval(Summary.from_values([r[name]["prefill_ms"] for r in kept]).p50),
            "values": values,
        }
        if name != "grouped" and "grouped" in sessions:
            ratios = [r[name]["ms_per_token"] / r["grouped"]["ms_per_token"] for r in kept]
            out["variants"][name]["ratio_to_grouped"] = interval(Summary.from_values(ratios).mean)
    return out


# ---------------------------------------------------------------------------------------------------
# 3. profile


def _kernels(prof: profile) -> tuple[int, float, dict[str, tuple[int, float]]]:
    count, total_us, by_name = 0, 0.0, {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        count += event.count
        total_us += us
        by_name[event.key] = (event.count, us)
    return count, total_us, by_name


def section_profile(sessions: dict[str, DeepSeekOCRSession], page: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, session in sessions.items():
        measured = {}
        for tokens in (96, 64):
            timed_job(session, page, tokens)  # the 64-token job's buckets and graphs are warm already
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                timed_job(session, page, tokens)
                sync()
            measured[tokens] = _kernels(prof)
        (k_long, us_long, names_long), (k_short, us_short, names_short) = measured[96], measured[64]
        per_step: dict[str, Any] = {"kernels": (k_long - k_short) / 32, "gpu_us": (us_long - us_short) / 32}
        top = sorted(((n, (c - names_short.get(n, (0, 0.0))[0]) / 32, (u - names_short.get(n, (0, 0.0))[1]) / 32)
                      for n, (c, u) in names_long.items()), key=lambda row: -row[2])[:25]  # fmt: skip
        per_step["top"] = [{"kernel": n[:110], "per_step": c, "us_per_step": u} for n, c, u in top if u > 0]
        out[name] = per_step
        log(f"  profile {name}: {per_step['kernels']:.0f} kernels, {per_step['gpu_us']:.0f} µs GPU per step")
    return out


# ---------------------------------------------------------------------------------------------------
# 4. agreement


def section_agreement(sessions: dict[str, DeepSeekOCRSession], page: Path, model: str, device: str,
                      steps: int) -> dict[str, Any]:  # fmt: skip
    eager = DeepSeekOCRSession.from_local(model, device=device, dtype=torch.bfloat16, engine="eager")
    out = {name: teacher_forced_agreement(eager, session, page, steps=steps) for name, session in sessions.items()}
    for name, value in out.items():
        log(f"  agreement {name} vs eager: {100 * value:.1f}% of {steps} steps")
    return {"steps": steps, "teacher_forced_top1_vs_eager": out}


# ---------------------------------------------------------------------------------------------------
# report


def fmt_interval(entry: dict[str, Any] | None, digits: int = 3) -> str:
    if not entry or entry.get("value") is None:
        return "–"
    text = f"{entry['value']:.{digits}f}"
    if entry.get("low") is not None:
        text += f" [{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]"
    return text


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Decode benchmark, {env['date']}",
        "",
        f"{bench_engine.environment_line(env)} `full` preset with RANDOM weights, bf16, the anchors' page (gundam 2x3), "
        f"EOS ignored, NVTX and CUDA events on.",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    rounds = report.get("rounds", {})
    if "variants" in rounds:
        lines += [
            f"**Decode ms/token** ({rounds['rounds_used']} rounds of {rounds['tokens']} tokens used of {rounds['rounds']}; "
            "per job the median step; median over jobs [95% bootstrap CI]; ratio: mean of per-round ratios to `grouped`)",
            "",
            "| variant | decode ms/token | ratio to grouped | prefill ms | kernels / step | GPU µs / step | top-1 vs eager |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        profiled = report.get("profile", {})
        agreement = report.get("agreement", {}).get("teacher_forced_top1_vs_eager", {})
        for name, v in rounds["variants"].items():
            p = profiled.get(name, {})
            gpu_us = f"{p['gpu_us']:.0f}" if "gpu_us" in p else "–"
            top1 = f"{100 * agreement[name]:.1f}%" if name in agreement else "–"
            lines.append(
                f"| {name} | {fmt_interval(v['ms_per_token'])} | {fmt_interval(v.get('ratio_to_grouped'))} | "
                f"{fmt_interval(v['prefill_ms'], 1)} | {p.get('kernels', '–')} | {gpu_us} | {top1} |"
            )
        lines.append("")
        fast = rounds["variants"].get("fast", {}).get("ms_per_token", {})
        if fast.get("high") is not None and fast.get("low") is not None:
            verdict = "met" if fast["high"] <= TARGET_MS_PER_TOKEN else ("missed" if fast["low"] > TARGET_MS_PER_TOKEN
                                                                         else "unresolved")  # fmt: skip
            lines += [f"Target ≤ {TARGET_MS_PER_TOKEN} ms/token (fast): **{verdict}**.", ""]
    sweep = report.get("sweep", {})
    if "best" in sweep:
        calls = sweep["us_per_call"]
        lines += [f"**Selected-experts kernels alone** (batch 1, {sweep['pairs']} pairs, "
                  f"{sweep['bytes_read'] / 1e6:.1f} MB of expert weights per call, GPU time in a CUDA graph): "
                  f"default blocks {calls['default']:.1f} µs ({calls['default'] and sweep['bytes_read'] / calls['default'] / 1e3:.0f} GB/s), "
                  f"best {calls['best']:.1f} µs ({sweep['bytes_read'] / calls['best'] / 1e3:.0f} GB/s): "
                  f"gate_up {sweep['best']['gate_up']}, down {sweep['best']['down']} (the `fast` variant ran these).",
                  "", "| kernel | rows | k | warps | µs / call (both kernels) |", "|---|---:|---:|---:|---:|"]  # fmt: skip
        for kernel in ("gate_up", "down"):
            for c in sweep[kernel][:5]:
                lines.append(f"| {kernel} | {c['rows']} | {c['k']} | {c['warps']} | {c['us_per_call']:.1f} |")
        lines.append("")
    top = report.get("profile", {}).get("fast", {}).get("top")
    if top:
        lines += ["**Where a `fast` decode step goes** (per step, top kernels)", "", "| kernel | per step | µs |",
                  "|---|---:|---:|"]
        lines += [f"| `{t['kernel']}` | {t['per_step']:.0f} | {t['us_per_step']:.1f} |" for t in top]
        lines.append("")
    for name, error in report.get("variant_errors", {}).items():
        lines.append(f"variant {name} failed: {error}")
    for section in ("sweep", "rounds", "profile", "agreement"):
        if "error" in report.get(section, {}):
            lines.append(f"{section}: {report[section]['error']}")
    lines.append(f"Benchmark wall time: {report.get('bench_wall_s', 0):.0f} s.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--min-rounds", type=int, default=5)
    parser.add_argument("--agreement-steps", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=540, help="whole script, compile included")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    json_path, md_path = out_dir / f"decode-{stamp}.json", out_dir / f"decode-{stamp}.md"
    report: dict[str, Any] = {"environment": environment(), "command": shlex.join(["python3", *sys.argv]),
                              "variants": names}  # fmt: skip

    def save() -> None:
        report["bench_wall_s"] = time.perf_counter() - _T0
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        md_path.write_text(markdown(report))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - _T0)

    with tempfile.TemporaryDirectory(prefix="dsocr-decode-") as tmp:
        page = Path(tmp) / "page.png"
        synthetic_page().save(page)
        if "fast" in names:
            log("sweep")
            try:
                report["sweep"] = section_sweep(args.model, args.device)
            except Exception as exc:
                traceback.print_exc()
                report["sweep"] = {"error": f"{type(exc).__name__}: {exc}"}
            save()
        sessions: dict[str, DeepSeekOCRSession] = {}
        report["warmup_s"] = {}
        for name in names:
            log(f"{name}: load and warm up")
            began = time.perf_counter()
            try:
                session = build_variant(name, args.model, args.device)
                for _ in range(2):
                    timed_job(session, page, args.tokens)
            except Exception as exc:
                traceback.print_exc()
                report.setdefault("variant_errors", {})[name] = f"{type(exc).__name__}: {exc}"
                continue
            sessions[name] = session
            report["warmup_s"][name] = time.perf_counter() - began
            log(f"{name}: ready in {report['warmup_s'][name]:.0f} s")
            save()
        # What is left: most to the rounds, then the profile (~10 s a variant) and the agreement (~25 s).
        sections = (
            ("rounds", lambda: section_rounds(sessions, page, args.tokens, max(left() - 60 - 10 * len(names), 10),
                                              args.min_rounds)),
            ("profile", lambda: section_profile(sessions, page)),
            ("agreement", lambda: section_agreement(sessions, page, args.model, args.device, args.agreement_steps)),
        )  # fmt: skip
        for section, run in sections:
            log(f"{section} ({left():.0f} s left)")
            try:
                report[section] = run()
            except Exception as exc:
                traceback.print_exc()
                report[section] = {"error": f"{type(exc).__name__}: {exc}"}
            save()
    save()
    print(md_path.read_text())
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
