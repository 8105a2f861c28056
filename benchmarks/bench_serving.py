"""Batched serving on one GPU: the batched engine's throughput and latency
over a sweep of concurrency levels, beside the batch-1 path in the same process.

One process, one device:
  1. load the model (`full` preset, random weights, bf16 on CUDA; the fast engine) and preprocess the
     pages (default: the 7 synthetic samples and OmniDocBench's 18 demo pages, gundam); a listed page
     that is missing is reported and left out;
  2. warm the batch-1 path on every page (its vision graph per page shape, its LM prefill graph per
     prompt length: the batched engine's prefills reuse both), then time the batch-1 path on
     `--batch1-pages` pages of `--tokens` tokens each (EOS ignored): output tokens/s over the pages'
     e2e, TTFT, TPOT;
  3. per concurrency level (1, 2, 4, …, 128 by default), a batched engine sized for it as the farm sizes
     a run's batch by its --concurrency: as many slots as the level (fewer where the free memory does not
     hold them: the plan is reported; a level above its slots is skipped), a CUDA graph per bucket up to
     it, its decode step compiled for the first engine and reused by the next (the build is timed);
  4. on it, max(2 x level, `--min-requests`) requests cycling over the pages, at most `level` in flight (a
     closed loop, as `vllm bench serve --max-concurrency`), `--tokens` each, EOS ignored. Reported:
     request throughput, output tokens/s, TTFT / TPOT / ITL / e2e (mean, p50, p90, p99), the decode
     steps' occupancy and time, the prefill share of the device's step time, and the bandwidth bound of
     a decode step at that occupancy (weights read + KV read, over the GPU's peak memory bandwidth:
     `--peak-tbps`, by default from the GPU's name) with the measured step's share of it;
  5. bf16 agreement: for each page the batch-1 path ran, the batched engine's tokens of that page at
     the highest level that ran (equal, or the first step where they differ), per attention.
With `--attention masked,filled` every level runs on an engine of each attention (engine/batched/slots.py),
one after the other in the same process: the two steps side by side. With `--prefill split,whole` every
level (and attention) runs on an engine of each (engine/batched/scheduler.py: split, a page joining while
others decode is prefilled in two steps, its SAM and then the rest; whole, every prefill in one launch):
ITL p50 / p99, TTFT p99 and output tokens/s side by side ("Prefills side by side" in serving.md, and a
line per setting on stdout as it ends).
With `--admission window,one-a-step` every level also runs with its pages joining at most one a step, as
the farm's do (claimed and prepared one by one), beside the closed loop's window: with one output length
the window's pages start, grow and end together (waves), the farm's stay staggered over the whole range;
the decode steps of 64+ pages and what their attention read are listed per level, with the distinct
token streams among its pages: on random weights two copies of a page decode the same tokens, so a wave
over fewer pages than slots feeds copies in lockstep (benchmarks/page_variants.py makes distinct pages).
With `--attention-options 'rule;{...}'` every level runs on an engine of each kernel option set of the
filled attention (FlexAttention's decoding kernel: SPLIT_KV, BLOCK_N, num_warps, num_stages), the
engine's own rule beside them: the options probe_flex_decoding.py found, in the whole step.
With `--profile N` every N-th step of each kind runs under torch.profiler (engine/profiling.py, as a
farm run's `--profile N`), and each level lists its sampled decode steps of half its concurrency or more
(at 128 the farm report's 64+ band) kernel by kernel, the levels side by side: ms a step per kernel, the
kernels' busy time, the idle time between them. The sampled steps are left out of the step's p50; the
level's throughput and latencies carry their cost.
Every level is written into --out (serving.json, serving.md) as soon as it ends, so a run cut short
(`--budget-s`: no new level starts past it) still reports what it measured.

The bandwidth arithmetic (per decode step of b pages):
  weights = every language-model weight a step reads once whatever b (attention, the dense first
  layer's MLP, the shared experts, the routers, the final norm, the LM head; the embedding table: b rows)
  + the routed experts the step touches: per MoE layer E x (1 - (1 - k/E)^b) experts of 3 x hidden x
  moe_intermediate weights each (k of E picked per token, routing taken as uniform: the random weights'
  routing is close to it, a trained router's is not);
  KV, "masked" (--attention): b_bucket x capacity x bytes per position: the step attends over each slot's
  whole capacity (a mask stops each page at its length), so that is what it reads, not the pages' lengths;
  KV, "filled": the occupied rows' filled 128-position blocks, from the pages' mean length over their
  decode (prompt + half the output, + half a block) + one block per free row of the bucket (the rows past
  the bucket read none).

    python benchmarks/bench_serving.py --out $OUT --budget-s 330                      # one H100 / H200
    python benchmarks/bench_serving.py --model tiny --device cpu --tokens 8 \\
        --concurrency 1,2,4 --batch1-pages 2 --pages datasets/samples/samples.txt --attention masked \\
        --out /tmp/serving  # CPU smoke
    python benchmarks/bench_serving.py --out $OUT --concurrency 128 --prefill split,whole \\
        --tokens-range-ratio 0.5 --min-requests 512  # split prefills beside whole ones at 128 in flight
    python benchmarks/bench_serving.py --out $OUT --concurrency 128 --admission window,one-a-step \\
        --min-requests 1296 --pages datasets/omnidocbench/subsets/demo-18.txt  # waves beside staggered pages
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast, get_args

import torch
from torch.nn.attention.flex_attention import FlexKernelOptions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, fmt  # noqa: E402
from dsocr_workers.engine.batched import BatchedEngine, BatchedOutput, PageRequest, ServingSummary  # noqa: E402
from dsocr_workers.engine.batched.metrics import StepRecord, percentiles  # noqa: E402
from dsocr_workers.engine.batched.slots import KV_BLOCK, SlotAttention  # noqa: E402
from dsocr_workers.engine.coldstart.cache import use_compile_cache  # noqa: E402
from dsocr_workers.engine.profiling import SampledStep, StepProfiler, StepSample  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions, InferenceResult  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession, force_eos_at  # noqa: E402
from dsocr_workers.farm.filelist import read_filelist  # noqa: E402
from dsocr_workers.farm.run_options import PREFILLS  # noqa: E402
from dsocr_workers.kernels import KernelSummary  # noqa: E402
from dsocr_workers.model.config import dtype_name  # noqa: E402
from dsocr_workers.model.preprocess import PreparedPage  # noqa: E402
from dsocr_workers.report.kernel_tables import by_stage  # noqa: E402

DEFAULT_PAGES = ("datasets/samples/samples.txt", "datasets/omnidocbench/subsets/demo-18.txt")
# Peak memory bandwidth by GPU name (the vendors' figures: H100 SXM5 HBM3, H200 HBM3e, A100 80GB).
PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}
TARGET_TOKENS_PER_S = 10_000
TARGET_TPOT_P50_MS = 10.0
TARGET_BOUND_SHARE = 0.6
SECONDS_PER_DAY = 86_400
ADMISSIONS = ("window", "one-a-step")  # how pages join (`--admission`)
RULE = "rule"  # `--attention-options`: the engine's own (slots.py `filled_kernel_options`)
# The farm report's widest occupancy band ("64+"): the decode steps compared with the farm's.
WIDE_OCCUPANCY = 64


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------
# bandwidth arithmetic


def weight_bytes(session: DeepSeekOCRSession) -> dict[str, Any]:
    """What a decode step reads of the language model: the weights read whatever the batch, and one
    routed expert's bytes with the experts per layer (E) and per token (k)."""
    model = session.model
    language_model = model.language_model
    text = model.config.text
    experts_params, fixed = 0, 0
    for name, parameter in language_model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if ".experts." in name:
            experts_params += size
        elif name.startswith("embed_tokens"):
            continue  # b rows of it per step: counted per page
        else:
            fixed += size
    fixed += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    moe_layers = text.num_hidden_layers - text.first_k_dense_replace
    expert_bytes = experts_params // max(moe_layers * text.n_routed_experts, 1)
    return {
        "fixed_bytes": fixed,
        "expert_bytes": expert_bytes,
        "moe_layers": moe_layers,
        "experts": text.n_routed_experts,
        "experts_per_token": text.num_experts_per_tok,
        "embedding_row_bytes": text.hidden_size * model.lm_head.weight.element_size(),
    }


def step_bound(
    weights: dict[str, Any],
    occupancy: float,
    kv_positions: float,
    per_position: int,
    peak_bytes_per_s: float | None,
) -> dict[str, float | None]:
    """The bytes one decode step of `occupancy` pages reads (the weights, and `kv_positions` of KV) and
    the time the bandwidth allows for it (None where the peak bandwidth is unknown: a CPU, an unlisted
    GPU without --peak-tbps)."""
    e, k = weights["experts"], weights["experts_per_token"]
    touched = e * (1 - (1 - k / e) ** occupancy)
    weights_read = (
        weights["fixed_bytes"]
        + weights["moe_layers"] * touched * weights["expert_bytes"]
        + occupancy * weights["embedding_row_bytes"]
    )
    kv_read = kv_positions * per_position
    bound_ms = None if peak_bytes_per_s is None else (weights_read + kv_read) / peak_bytes_per_s * 1e3
    return {
        "experts_touched_per_layer": touched,
        "weights_read_gb": weights_read / 1e9,
        "kv_read_gb": kv_read / 1e9,
        "bound_step_ms": bound_ms,
        "bound_tokens_per_s": None if bound_ms is None else occupancy / bound_ms * 1e3,
    }


# ---------------------------------------------------------------------------------------------------
# the parts


def load_pages(
    session: DeepSeekOCRSession, lists: list[str], mode: str, max_crops: int
) -> tuple[list, list[str]]:
    """(name, prepared page) for every readable page of the lists, and what was left out."""
    pages, left_out = [], []
    for listed in lists:
        filelist = read_filelist(REPO / listed if not Path(listed).is_absolute() else listed)
        if filelist.bad:
            left_out.append(filelist.describe_bad())
        for image in filelist.images:
            prepared = session.prepare_job(
                image.path, None, mode, max_crops=max_crops, clock=session.new_clock(marks_steps=False)
            )
            pages.append((image.image, prepared.page))
    if not pages:
        raise SystemExit(f"no readable page in {', '.join(lists)}:\n" + "\n".join(left_out))
    return pages, left_out


def warm_batch1(
    session: DeepSeekOCRSession, pages: list[tuple[str, PreparedPage]], tokens: int, options: DecodeOptions
) -> float:
    """Every page once through the batch-1 path with the timed jobs' cache bucket and decode step
    (EOS forced early): vision per page shape, the LM prefill per prompt length, the decode step."""
    start = time.perf_counter()
    stop_early = DecodeOptions(**{**options.__dict__, "ignore_eos": False})
    for _, page in pages:
        session.run_on_device(page, tokens, stop_early, after_step=force_eos_at(2)).finish()
    sync()
    return time.perf_counter() - start


def batch1(
    session: DeepSeekOCRSession, pages: list[tuple[str, PreparedPage]], tokens: int, options: DecodeOptions
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The batch-1 path on `pages`, one after another: output tokens/s over the sum of e2e, TTFT, TPOT."""
    results: list[InferenceResult] = []
    sync()
    start = time.perf_counter()
    for _, page in pages:
        results.append(session.run_on_device(page, tokens, options).finish())
    sync()
    wall = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    tpot = [r.timings.decode_ms / (len(r.token_ids) - 1) for r in results if len(r.token_ids) > 1]
    steps = [ms for r in results for ms in r.timings.decode_step_ms]
    summary = {
        "pages": len(results),
        "output_tokens": produced,
        "wall_s": wall,
        "output_tokens_per_s": produced / wall,
        "request_throughput": len(results) / wall,
        "ttft_ms": percentiles([r.timings.ttft_ms for r in results]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(steps),
        "e2e_ms": percentiles([r.timings.e2e_ms for r in results]),
    }
    return summary, {name: r.token_ids for (name, _), r in zip(pages, results, strict=True)}


def start_engine(
    session: DeepSeekOCRSession,
    concurrency: int,
    pages: list[tuple[str, PreparedPage]],
    args: argparse.Namespace,
    options: DecodeOptions,
    attention: SlotAttention | None,
    prefill: str,
    attention_options: FlexKernelOptions | None = None,
) -> tuple[BatchedEngine, dict[str, Any]]:
    """The batched engine of one level, sized as the farm sizes a run's batch: `concurrency` slots (fewer
    where the free memory does not hold them), its buckets up to that, its prefills `prefill` ("split" or
    "whole"); then a short round to settle it (the allocator, the
    first joins) before timing. The step compiled for the first engine serves the next ones (one graph
    dynamic in the batch): a later engine costs its captures. Returns the engine and what to report of
    it."""
    start = time.perf_counter()
    engine = BatchedEngine.create(
        session,
        concurrency,
        max(p.prompt_tokens for _, p in pages),
        args.tokens,
        options,
        reserve_bytes=int(args.reserve_gib * 2**30),
        compiled=False if args.eager_step else None,
        cuda_graphs=False if args.no_graphs else None,
        attention=attention,
        split_prefill=prefill == "split",
        attention_options=attention_options,
    )
    sync()
    record = dict(
        attention=engine.attention,
        prefill=prefill,
        attention_options=engine.runner.attention_options,
        slots=engine.plan.slots,
        compile_and_capture_s=time.perf_counter() - start,
        plan=engine.plan.describe(),
        step="eager" if args.eager_step else "compiled",
        cuda_graphs=engine.runner.cuda_graphs,
        kv_plan=engine.plan.__dict__,
        buckets=list(engine.buckets),
        graphs=engine.runner.captured,
    )
    engine.run(
        [PageRequest(f"warm{i}", page, 16) for i, (_, page) in enumerate(pages[:4])], min(4, concurrency)
    )
    if args.profile:  # after the settling round: its steps are no level's
        engine.profile_steps(StepProfiler(session.device, StepSample(args.profile)))
    return engine, record


def engine_level(
    session: DeepSeekOCRSession,
    concurrency: int,
    pages: list[tuple[str, PreparedPage]],
    args: argparse.Namespace,
    options: DecodeOptions,
    attention: SlotAttention | None,
    prefill: str,
    admission: str,
    weights: dict[str, Any],
    peak: float | None,
    attention_options: FlexKernelOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[BatchedOutput]]:
    """One level on an engine of its own (`start_engine`, dropped on return): what to report of the
    engine, the level's row (or why it was skipped) and its outputs."""
    engine, record = start_engine(session, concurrency, pages, args, options, attention, prefill, attention_options)
    if concurrency > engine.plan.slots:
        return (
            record,
            {
                "concurrency": concurrency,
                "attention": engine.attention,
                "prefill": prefill,
                "admission": admission,
                "skipped": f"only {engine.plan.slots} slots fit",
            },
            [],
        )
    requests = max(2 * concurrency, args.min_requests)
    row, outputs = level(
        engine,
        pages,
        concurrency,
        output_lengths(requests, args.tokens, args.tokens_range_ratio),
        admission,
        weights,
        peak,
    )
    return record, row, outputs


def output_lengths(requests: int, tokens: int, range_ratio: float) -> list[int]:
    """Each request's output tokens: `tokens`, or with `range_ratio` drawn (seeded) from [tokens x (1 -
    range_ratio), tokens], as `vllm bench serve --random-range-ratio` draws them: pages that end at other
    steps, so pages join while others decode (with one length, a batch ends and refills together)."""
    if not range_ratio:
        return [tokens] * requests
    draw = random.Random(0)
    return [draw.randint(max(1, round(tokens * (1 - range_ratio))), tokens) for _ in range(requests)]


def level(
    engine: BatchedEngine,
    pages: list[tuple[str, PreparedPage]],
    concurrency: int,
    lengths: list[int],
    admission: str,
    weights: dict[str, Any],
    peak: float | None,
) -> tuple[dict[str, Any], list[BatchedOutput]]:
    """One concurrency level, a request of each output length in `lengths`, joining as `admission` says:
    its serving summary, the decode steps' bandwidth bound, its outputs."""
    requests = len(lengths)
    asked = [
        PageRequest(f"{i}:{pages[i % len(pages)][0]}", pages[i % len(pages)][1], tokens)
        for i, tokens in enumerate(lengths)
    ]
    first_step = len(engine.steps)
    sync()
    start = time.perf_counter()
    outputs = engine.run(asked, concurrency, one_a_step=admission == "one-a-step")
    sync()
    wall = time.perf_counter() - start
    steps = engine.steps[first_step:]
    summary = ServingSummary.of([o.metrics for o in outputs], steps)
    decode = [s for s in steps if s.kind == "decode"]
    occupancy = sum(s.occupancy for s in decode) / len(decode)
    bucket = sum(s.bucket for s in decode) / len(decode)
    step_ms = sum(s.ms for s in decode) / len(decode)
    if engine.attention == "filled":
        mean_length = (
            sum(o.prompt_tokens + len(o.token_ids) / 2 for o in outputs) / len(outputs) + KV_BLOCK / 2
        )
        positions = occupancy * mean_length + (bucket - occupancy) * KV_BLOCK
    else:
        positions = bucket * engine.plan.capacity
    bound = step_bound(weights, occupancy, positions, engine.plan.bytes_per_position, peak)
    profiled = sampled_steps(engine.runner.profiler, steps)
    wide = [s for s in decode if s.occupancy >= WIDE_OCCUPANCY and s.index not in profiled]
    report = {
        "concurrency": concurrency,
        "attention": engine.attention,
        "prefill": "split" if engine.split_prefill else "whole",
        "admission": admission,
        "attention_options": engine.runner.attention_options,
        "requests": requests,
        "wall_s": wall,
        **summary.__dict__,
        "steady_output_tokens_per_s": steady_tokens_per_s(outputs, steps),
        "decode_tokens_per_s": occupancy / step_ms * 1e3,
        "mean_decode_step_ms": step_ms,
        "mean_occupancy": occupancy,
        "mean_bucket": bucket,
        "wide_decode_steps": len(wide),
        "wide_decode_step_ms_p50": statistics.median(s.ms for s in wide) if wide else None,
        "wide_kv_per_page": sum(s.kv_positions for s in wide) / sum(s.occupancy for s in wide) if wide else None,
        "wide_kv_longest": sum(s.kv_longest for s in wide) / len(wide) if wide else None,
        "distinct_outputs": len({tuple(o.token_ids) for o in outputs}),
        "full_step_kernels": step_kernels([profiled[s.index].collect(s.ms).summary for s in decode
                                           if 2 * s.occupancy >= concurrency and s.index in profiled]),  # fmt: skip
        **bound,
        "bound_share": None if bound["bound_step_ms"] is None else bound["bound_step_ms"] / step_ms,
        "pages_per_day": summary.request_throughput * SECONDS_PER_DAY,
        "per_page": [
            {
                "request": o.request_id,
                "ttft_ms": o.metrics.ttft_ms,
                "tpot_ms": o.metrics.tpot_ms,
                "e2e_ms": o.metrics.e2e_ms,
                "queue_wait_ms": o.metrics.queue_wait_ms,
                "mean_occupancy": o.metrics.mean_occupancy,
                "tokens": len(o.token_ids),
            }
            for o in outputs
        ],
    }
    return report, outputs


def steady_tokens_per_s(outputs: list[BatchedOutput], steps: list[StepRecord]) -> float | None:
    """Output tokens/s in the window the farm's report calls steady (report/throughput.py, per lane): from
    the first page finished to the last page admitted, the tokens of the steps that ended inside it. The
    fill before it and the drain after it are left out, as they are of a farm run."""
    start = min(o.metrics.finished_s for o in outputs)
    end = max(o.metrics.admitted_s for o in outputs)
    if end <= start:
        return None
    return sum(s.occupancy for s in steps if start < s.ended_s <= end) / (end - start)


def agreement(batched: list[BatchedOutput], alone: dict[str, list[int]]) -> dict[str, Any]:
    """Per page the batch-1 path ran: the batched engine's tokens equal (as far as the shorter one goes:
    `--tokens-range-ratio`), or where they first differ."""
    pages: dict[str, Any] = {}
    for output in batched:
        name = output.request_id.split(":", 1)[1]
        if name in alone and name not in pages:
            mine, theirs = output.token_ids, alone[name][: len(output.token_ids)]
            differ = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
            pages[name] = {"equal": mine == theirs, "first_difference": differ, "tokens": len(theirs)}
    return {"pages": pages, "equal": sum(p["equal"] for p in pages.values()), "compared": len(pages)}


def sampled_steps(profiler: StepProfiler | None, steps: list[StepRecord]) -> dict[int, SampledStep]:
    """The steps of `steps` that ran under `profiler`, by index (every one taken, so none is kept past its
    level)."""
    if profiler is None:
        return {}
    taken = {s.index: profiler.take(s.index) for s in steps}
    return {index: sampled for index, sampled in taken.items() if sampled is not None}


def step_kernels(summaries: list[KernelSummary]) -> dict[str, Any] | None:
    """Sampled steps' kernels averaged a step: the steps, their clock, busy and idle ms, and each kernel's
    calls and ms a step, longest first."""
    stage = next(iter(by_stage(summaries).values()), None)
    if stage is None:
        return None
    n = len(stage.jobs)
    kernels = [{"name": name, "calls": stage.calls[name] / n, "ms": sum(us) / n / 1e3}
               for name, us in stage.kernel_us.items()]  # fmt: skip
    return {
        "steps": n,
        "clock_ms": sum(row.event_ms for row in stage.jobs) / n,
        "busy_ms": sum(row.busy_ms for row in stage.jobs) / n,
        "idle_ms": sum(row.idle_ms for row in stage.jobs) / n,
        "kernels": sorted(kernels, key=lambda k: -k["ms"]),
    }


# ---------------------------------------------------------------------------------------------------
# the report


def setting(row: dict[str, Any]) -> str:
    """A level's engine in words: its attention, its prefills and, where not the window's, how pages join."""
    joining = ", one page joining a step" if row.get("admission") == "one-a-step" else ""
    chosen = row.get("attention_choice", RULE)
    kernel = "" if chosen == RULE else f", kernel options {chosen}"
    return f"{row.get('attention')}, {row.get('prefill', 'whole')} prefills{kernel}{joining}"


def prefill_figures(row: dict[str, Any]) -> str:
    """What the prefills change, in one line: ITL p50 / p99, TTFT p99, output tokens/s."""
    return (
        f"ITL p50 {fmt(row['itl_ms']['p50'])} / p99 {fmt(row['itl_ms']['p99'])} ms, "
        f"TTFT p99 {fmt(row['ttft_ms']['p99'], 0)} ms, {fmt(row['output_tokens_per_s'], 0)} output tokens/s"
    )


def prefills_table(report: dict[str, Any]) -> list[str]:
    """The levels side by side by their prefills (where both ran): ITL p50 / p99 and their ratio, TTFT
    p99, output tokens/s, the steps that prefill (ms p50 / p99), the pages split."""
    ran = [row for row in report["levels"] if "output_tokens_per_s" in row]
    if len({row.get("prefill") for row in ran}) < 2:
        return []
    lines = [
        "",
        "Prefills side by side (split: a page joining while others decode is prefilled in two steps, its "
        "SAM and then the rest; whole: in one launch):",
        "",
        "| concurrency | attention | prefills | ITL p50 ms | ITL p99 ms | p99 / p50 | TTFT p99 ms | output tok/s | "
        "prefill step p50 / p99 ms | pages split |",
        "|" + "---|" * 10,
    ]
    for row in sorted(ran, key=lambda r: (r["concurrency"], r["attention"], r.get("prefill", "whole"))):
        launches, itl = row["prefill_step_ms"], row["itl_ms"]
        ratio = itl["p99"] / itl["p50"] if itl["p50"] else None
        lines.append(
            f"| {row['concurrency']} | {row['attention']} | {row.get('prefill', 'whole')} | "
            f"{fmt(itl['p50'])} | {fmt(itl['p99'])} | {fmt(ratio, 2)} | {fmt(row['ttft_ms']['p99'], 0)} | "
            f"{fmt(row['output_tokens_per_s'], 0)} | {fmt(launches['p50'])} / {fmt(launches['p99'])} | "
            f"{row['split_prefills']} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    env, setup = report["environment"], report.get("setup", {})
    lines = [
        f"# Batched serving, {env.get('gpu', 'CPU')} ({env['date']})",
        "",
        f"{report['model']}, {report['dtype']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"git {env.get('git_sha')}; pages: {setup.get('pages')} ({setup.get('mode')}), "
        f"{setup.get('tokens')} output tokens each (EOS ignored"
        + (
            f"; the levels' drawn from {1 - ratio:.2f} x that up to it"
            if (ratio := setup.get("tokens_range_ratio"))
            else ""
        )
        + ")",
        "",
    ]
    for built in setup.get("engines", []):
        lines.append(
            f"- Batched engine of {built['slots']} slots, {built['attention']} attention, "
            f"{built.get('prefill', 'whole')} prefills: KV plan {built['plan']}; "
            f"decode step compiled and captured ({built['buckets']}) in {built['compile_and_capture_s']:.1f} s"
        )
    if setup.get("engines"):
        lines.append("")
    lines += [f"Batch-1 warm-up {setup.get('batch1_warmup_s', 0):.1f} s", ""]
    header = (
        "| concurrency | attention, prefills | pages | output tok/s | req/s | TTFT p50 / p90 / p99 ms | "
        "TPOT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | occupancy | decode step ms | bound ms | "
        "of bound | prefill share |"
    )
    lines += [header, "|" + "---|" * 13]

    def triple(stats: dict[str, Any]) -> str:
        return " / ".join(fmt(stats.get(f"p{q}"), 1) for q in (50, 90, 99))

    base = report.get("batch1")
    if base and "output_tokens_per_s" in base:
        lines.append(
            f"| batch-1 path | - | {base['pages']} | {fmt(base['output_tokens_per_s'], 0)} | "
            f"{fmt(base['request_throughput'], 3)} | {triple(base['ttft_ms'])} | {triple(base['tpot_ms'])} | "
            f"{triple(base['itl_ms'])} | 1 | - | - | - | - |"
        )
    for row in report["levels"]:
        if "error" in row or "skipped" in row:
            lines.append(
                f"| {row['concurrency']} | {setting(row)} | {row.get('error') or row.get('skipped')} |"
            )
            continue
        lines.append(
            f"| {row['concurrency']} | {setting(row)} | {row['pages']} | {fmt(row['output_tokens_per_s'], 0)} | "
            f"{fmt(row['request_throughput'], 3)} | {triple(row['ttft_ms'])} | {triple(row['tpot_ms'])} | "
            f"{triple(row['itl_ms'])} | {fmt(row['mean_occupancy'], 1)} | {fmt(row['mean_decode_step_ms'])} | "
            f"{fmt(row['bound_step_ms'])} | {percent(row['bound_share'])} | {percent(1 - row['decode_share'], 1)} |"
        )
    lines += wide_steps_lines(report)
    lines += step_kernels_table(report)
    lines += prefills_table(report)
    for engine in dict.fromkeys(setting(row) for row in report["levels"]):
        lines += best_line(report, engine)
    for engine, a in report.get("agreement", {}).items():
        lines += [
            "",
            f"Batched ({engine}) vs batch-1 greedy tokens ({report['dtype']}, concurrency "
            f"{a.get('concurrency')}): {a['equal']} of {a['compared']} pages equal; first differences at "
            f"{[p['first_difference'] for p in a['pages'].values() if not p['equal']]}",
        ]
    if report.get("left_out"):
        lines += ["", "Pages left out:", "```", *report["left_out"], "```"]
    return "\n".join(lines) + "\n"


def wide_steps_lines(report: dict[str, Any]) -> list[str]:
    """Per level, its decode steps of WIDE_OCCUPANCY pages or more, as the farm report's "64+" band reads
    them: the step's p50 and what its attention read (KV positions per page, the longest page's)."""
    lines = []
    for row in report["levels"]:
        if row.get("wide_decode_steps"):
            lines.append(
                f"- {row['concurrency']}, {setting(row)}: {row['wide_decode_steps']} decode steps of "
                f"{WIDE_OCCUPANCY}+ pages: p50 {fmt(row['wide_decode_step_ms_p50'])} ms; KV positions a page's "
                f"attention read, mean {fmt(row['wide_kv_per_page'], 0)}, the longest page's "
                f"{fmt(row['wide_kv_longest'], 0)}; {row['distinct_outputs']} distinct token streams among its "
                f"{row['requests']} pages"
            )
    return ["", *lines] if lines else []


KERNEL_ROWS = 25  # the sampled steps' longest kernels listed; the rest summed
KERNEL_NAME = 70  # characters of a kernel's name shown


def step_kernels_table(report: dict[str, Any]) -> list[str]:
    """The levels' sampled decode steps of half their concurrency or more (at 128: the farm report's 64+
    band) side by side, kernel by kernel: ms a step (calls a step), then the other kernels' sum, the
    kernels' busy time, the idle time between them and the clock."""
    profiled = [row for row in report["levels"] if row.get("full_step_kernels")]
    if not profiled:
        return []
    tables = [row["full_step_kernels"] for row in profiled]
    longest: dict[str, float] = {}
    for table in tables:
        for kernel in table["kernels"]:
            longest[kernel["name"]] = max(longest.get(kernel["name"], 0.0), kernel["ms"])
    shown = sorted(longest, key=lambda name: -longest[name])[:KERNEL_ROWS]
    lines = [
        "",
        "Sampled decode steps of half the level's concurrency or more, kernel by kernel (`--profile`; ms a step, "
        "calls a step in brackets):",
        "",
        "| kernel | " + " | ".join(f"{row['concurrency']}, {setting(row)} ({t['steps']} steps)"
                                   for row, t in zip(profiled, tables, strict=True)) + " |",  # fmt: skip
        "|---|" + "---:|" * len(profiled),
    ]

    def cell(table: dict[str, Any], name: str) -> str:
        kernel = next((k for k in table["kernels"] if k["name"] == name), None)
        return "-" if kernel is None else f"{kernel['ms']:.3f} ({kernel['calls']:.3g})"

    for name in shown:
        label = name if len(name) <= KERNEL_NAME else name[: KERNEL_NAME - 1] + "…"
        lines.append(f"| `{label}` | " + " | ".join(cell(t, name) for t in tables) + " |")
    rest = [sum(k["ms"] for k in t["kernels"] if k["name"] not in shown) for t in tables]
    lines.append("| the other kernels | " + " | ".join(f"{ms:.3f}" for ms in rest) + " |")
    for label, key in (("kernels busy", "busy_ms"), ("idle between kernels", "idle_ms"), ("clock", "clock_ms")):
        lines.append(f"| {label} | " + " | ".join(f"{t[key]:.3f}" for t in tables) + " |")
    return lines


def best_line(report: dict[str, Any], engine: str) -> list[str]:
    """The best output tokens/s of the levels on `engine` (a `setting`), against the targets, with its
    bound's arithmetic; and the best such level whose TPOT p50 meets its target."""
    setup = report.get("setup", {})
    ran = [row for row in report["levels"] if "output_tokens_per_s" in row and setting(row) == engine]
    lines: list[str] = []
    within = [row for row in ran if (row["tpot_ms"]["p50"] or 0) <= TARGET_TPOT_P50_MS]
    for label, rows in (("Best", ran), ("Best with TPOT p50 within its target", within)):
        if not rows:
            continue
        best = max(rows, key=lambda row: row["output_tokens_per_s"])
        lines += [
            "",
            f"{label} ({engine}): concurrency {best['concurrency']}: {best['output_tokens_per_s']:,.0f} output tokens/s "
            f"(target ≥ {TARGET_TOKENS_PER_S:,}), TPOT p50 {fmt(best['tpot_ms']['p50'])} ms (≤ {TARGET_TPOT_P50_MS}), "
            f"{percent(best['bound_share'])} of the bandwidth bound (≥ {100 * TARGET_BOUND_SHARE:.0f}%), "
            f"{best['pages_per_day']:,.0f} pages/day at {setup.get('tokens')} tokens a page",
            f"Bound at that point: {best['weights_read_gb']:.2f} GB of weights "
            f"({best['experts_touched_per_layer']:.1f} experts per MoE layer) + {best['kv_read_gb']:.2f} GB of KV "
            f"per step over {report.get('peak_tbps')} TB/s = {fmt(best['bound_step_ms'])} ms for "
            f"{best['mean_occupancy']:.1f} pages",
        ]
    return lines


def percent(share: float | None, digits: int = 0) -> str:
    return "-" if share is None else f"{100 * share:.{digits}f}%"


def write(report: dict[str, Any], out: Path | None) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "serving.md").write_text(markdown(report))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--pages", action="append", help=f"file lists (default: {', '.join(DEFAULT_PAGES)})")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--max-crops", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=1024, help="output tokens per page (EOS ignored)")
    parser.add_argument(
        "--tokens-range-ratio",
        type=float,
        default=0.0,
        help="the levels' output tokens per page drawn from [tokens x (1 - R), tokens] (seeded), as vllm bench "
        "serve's --random-range-ratio: pages end at other steps and join while others decode; 0: all --tokens",
    )
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--batch1-pages", type=int, default=6)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=20)
    parser.add_argument(
        "--attention",
        default=None,
        help="how a decode step reads the slots (engine/batched/slots.py): filled, masked, or both "
        "(masked,filled: each level on an engine of each, side by side); unset: the engine's default",
    )
    parser.add_argument(
        "--prefill",
        default="split",
        help="how a joining page is prefilled (engine/batched/scheduler.py): split (the engine's default), "
        "whole, or both (split,whole: each level and attention on an engine of each, side by side)",
    )
    parser.add_argument(
        "--admission",
        default="window",
        help="how pages join: window (every free slot of the window filled at once, as vllm bench serve's "
        "closed loop), one-a-step (at most one page a step, as the farm's pages arrive: their lengths stay "
        "staggered), or both (window,one-a-step: each on an engine of its own, side by side)",
    )
    parser.add_argument(
        "--attention-options",
        default=RULE,
        help="the filled attention's kernel options, ';'-separated, each level on an engine of each, side by "
        "side: 'rule' (the engine's, slots.py filled_kernel_options) or a JSON object of FlexAttention's "
        "kernel options ({}: its own choices), e.g. "
        '\'rule;{"SPLIT_KV": 2, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4}\'',
    )
    parser.add_argument(
        "--eager-step", action="store_true", help="the batched step uncompiled (still graphed)"
    )
    parser.add_argument(
        "--no-graphs", action="store_true", help="the batched step launched op by op (diagnosis)"
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="every N-th step of each kind under torch.profiler: the kernels of the decode steps of "
                        "half the level's concurrency or more, per level, side by side (0: none)")  # fmt: skip
    parser.add_argument("--reserve-gib", type=float, default=4.0)
    parser.add_argument("--peak-tbps", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=330.0, help="start no level past this many seconds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    began = time.perf_counter()
    use_compile_cache()  # DSOCR_COMPILE_CACHE_DIR where set: a farm run after it compiles less
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    attentions: list[SlotAttention | None] = (
        [None] if args.attention is None else [cast(SlotAttention, a) for a in dict.fromkeys(args.attention.split(","))]
    )
    if args.attention is not None and not set(attentions) <= set(get_args(SlotAttention)):
        parser.error(f"--attention takes masked, filled or both, not {args.attention}")
    prefills = list(dict.fromkeys(args.prefill.split(",")))
    if not set(prefills) <= set(PREFILLS):
        parser.error(f"--prefill takes split, whole or both, not {args.prefill}")
    admissions = list(dict.fromkeys(args.admission.split(",")))
    if not set(admissions) <= set(ADMISSIONS):
        parser.error(f"--admission takes window, one-a-step or both, not {args.admission}")
    kernel_choices: dict[str, FlexKernelOptions | None] = {}  # as given → the options (None: the rule)
    for choice in (choice.strip() for choice in args.attention_options.split(";")):
        try:
            given = None if choice == RULE else json.loads(choice)
        except json.JSONDecodeError:
            given = "not JSON"
        if choice != RULE and not isinstance(given, dict):
            parser.error(f"--attention-options takes 'rule' or JSON objects, ';'-separated, not {choice!r}")
        kernel_choices[choice] = cast(FlexKernelOptions | None, given)
    if not 0 <= args.tokens_range_ratio < 1:
        parser.error(f"--tokens-range-ratio takes a ratio in [0, 1), not {args.tokens_range_ratio}")
    options = DecodeOptions(no_repeat_ngram_size=args.no_repeat_ngram_size, ignore_eos=True)
    env = environment()
    peak_tbps = args.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in env.get("gpu", "")), None)
    session = DeepSeekOCRSession.from_local(
        args.model,
        device=args.device,
        dtype=args.dtype,
        engine="fast" if args.device.startswith("cuda") else "eager",
    )
    report: dict[str, Any] = {
        "environment": env,
        "model": session.source.label,
        "engine": session.engine_name,
        "dtype": dtype_name(session.dtype),
        "peak_tbps": peak_tbps,
        "options": options.__dict__,
        "levels": [],
        "setup": {},
    }
    pages, report["left_out"] = load_pages(
        session, args.pages or list(DEFAULT_PAGES), args.mode, args.max_crops
    )
    setup = report["setup"]
    setup.update(
        pages=len(pages),
        mode=args.mode,
        tokens=args.tokens,
        tokens_range_ratio=args.tokens_range_ratio,
        prompt_tokens=percentiles([p.prompt_tokens for _, p in pages]),
    )
    setup["batch1_warmup_s"] = warm_batch1(session, pages, args.tokens, options)
    write(report, args.out)
    report["batch1"], alone = batch1(session, pages[: args.batch1_pages], args.tokens, options)
    write(report, args.out)
    weights = weight_bytes(session)
    setup["weights"] = weights
    peak = None if peak_tbps is None else peak_tbps * 1e12
    last: dict[str, tuple[int, list[BatchedOutput]]] = {}
    setup["engines"] = []
    settings = itertools.product(levels, attentions, kernel_choices.items(), prefills, admissions)
    for concurrency, attention, (chosen, attention_options), prefill, admission in settings:
        named = {"concurrency": concurrency, "attention": attention or "default", "prefill": prefill,
                 "admission": admission, "attention_choice": chosen}  # fmt: skip
        if time.perf_counter() - began > args.budget_s:
            report["levels"].append({**named, "skipped": f"past --budget-s {args.budget_s:.0f}"})
            continue
        try:
            record, row, outputs = engine_level(
                session, concurrency, pages, args, options, attention, prefill, admission, weights, peak,
                attention_options,
            )
            row["attention_choice"] = chosen
            setup["engines"].append(record)
            report["levels"].append(row)
            if outputs:
                last[setting(row)] = (concurrency, outputs)
        except Exception:  # a level that fails is recorded; the others still run
            row = {**named, "error": traceback.format_exc(limit=4)}
            report["levels"].append(row)
        gc.collect()  # the level's engine, its KV cache and graphs, before the next one's are allocated
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        figures = f" {prefill_figures(row)};" if "output_tokens_per_s" in row else ""
        print(
            f"concurrency {concurrency}, {setting(named)}:{figures} done at {time.perf_counter() - began:.0f} s",
            flush=True,
        )
        write(report, args.out)
    report["agreement"] = {
        engine: {"concurrency": at, **agreement(outputs, alone)} for engine, (at, outputs) in last.items()
    }
    report["wall_s"] = time.perf_counter() - began
    write(report, args.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
