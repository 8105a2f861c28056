"""The farm against its engine alone, side by side in one call: the same pages, concurrency, token budget
and job count on one GPU, first through the batched engine in one process (bench_serving.py), then
through `dsocr worker` behind Redis and Celery (bench_scaling.py, K = 1).

The two are read alike: output tokens/s over the steady window the farm's report uses (from the first
page finished to the last one admitted; bench_serving's `steady_output_tokens_per_s`), beside each one's
own headline (the engine's over its whole wall, the farm's report's Serving figure), TPOT, ITL and TTFT;
then their decode steps of 64+ pages: the step's p50 and what its attention read (KV positions per page,
the longest page's). The target: the farm at >= 0.97 of the engine. With `--admission window,one-a-step`
the engine alone also runs with its pages joining at most one a step, as the farm's arrive (their lengths
staggered, bench_serving's `--admission`), and the farm's ratio to each is printed. --out gets
farm-vs-engine.md: that comparison, then both sides' own tables (each with its GPU, versions and tree).

Both sides read `--variants` distinct versions of each listed page (page_variants.py, written to a
temporary folder): on random weights copies of one page decode the same tokens, and copies at the same step
(a wave over fewer pages than slots) make the routed experts read fewer experts than distinct pages do.

    python3 benchmarks/bench_farm_vs_engine.py --out $OUT --concurrency 128 --max-new-tokens 1024 \\
        --compile-cache /tmp/dc [--admission window,one-a-step]
    python3 benchmarks/bench_farm_vs_engine.py --out /tmp/fve --cpu --model tiny --mode small \\
        --concurrency 2 --max-new-tokens 8 --filelist datasets/samples/samples.txt  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import fmt  # noqa: E402
from benchmarks.bench_scaling import GENERATIONS, level_repeats, listed_pages  # noqa: E402
from benchmarks.page_variants import VARIANTS, write_variants  # noqa: E402

TARGET = 0.97


def jobs_for(concurrency: int, pages: int, generations: int = GENERATIONS) -> tuple[int, int]:
    """The farm run's repeats of the file list and its job count, as bench_scaling sizes a level at K = 1."""
    repeats = level_repeats(1, concurrency, 1, pages, generations)
    return repeats, repeats * pages


def run(command: list[str], log: Path, timeout_s: float, compile_cache: str) -> int:
    print("$", " ".join(command), flush=True)
    env = {**os.environ, "DSOCR_COMPILE_CACHE_DIR": compile_cache}
    with open(log, "w") as out:
        try:
            return subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


ADMITTED = {"window": "engine alone", "one-a-step": "engine alone, one page joining a step"}


def engine_rows(path: Path, concurrency: int) -> dict[str, dict[str, Any]]:
    """The engine alone's level at `concurrency`, per admission it ran."""
    if not path.is_file():
        return {}
    levels = json.loads(path.read_text()).get("levels", [])
    return {row.get("admission", "window"): row for row in levels
            if row.get("concurrency") == concurrency and "wall_s" in row}  # fmt: skip


def farm_run(folder: Path) -> dict[str, Any] | None:
    reports = sorted(folder.glob("scaling-*.json"))
    if not reports:
        return None
    runs = json.loads(reports[-1].read_text()).get("runs", [])
    return next((r for r in runs if (r.get("stats") or {}).get("serving")), None)


def table(engines: dict[str, dict[str, Any]], farm: dict[str, Any] | None, args: argparse.Namespace, jobs: int) -> str:
    lines = [
        f"# The farm against its engine alone: concurrency {args.concurrency}, {jobs} jobs of "
        f"{args.max_new_tokens} tokens ({args.filelist.name} in {args.variants} variants a page, {args.mode}, "
        "EOS ignored)",
        "",
        "| | output tok/s (steady window) | output tok/s (own headline) | TPOT p50 ms | ITL p50 / p99 ms "
        "| TTFT p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for admission, engine in engines.items():
        lines.append(
            f"| {ADMITTED[admission]} | {fmt(engine.get('steady_output_tokens_per_s'), 0)} | "
            f"{fmt(engine['output_tokens_per_s'], 0)} | {fmt(engine['tpot_ms']['p50'])} | "
            f"{fmt(engine['itl_ms']['p50'])} / {fmt(engine['itl_ms']['p99'])} | "
            f"{fmt(engine['ttft_ms']['p50'], 0)} / {fmt(engine['ttft_ms']['p99'], 0)} |"
        )
    serving = (farm or {}).get("stats", {}).get("serving")
    # A farm cut short by its budget reads a window of its first jobs only: no ratio from it.
    farm_status = (farm or {}).get("status", "not run")
    if serving:
        lines.append(
            f"| farm (K = 1){'' if farm_status == 'complete' else ', cut short'} | {fmt(serving['output_tokens_per_s'], 0)} | {fmt(serving['output_tokens_per_s'], 0)} | "
            f"{fmt(serving.get('tpot_ms_p50'))} | {fmt(serving.get('itl_ms_p50'))} / {fmt(serving.get('itl_ms_p99'))} | "
            f"{fmt(serving.get('ttft_ms_p50'), 0)} / {fmt(serving.get('ttft_ms_p99'), 0)} |"
        )
    steps = (farm or {}).get("stats", {}).get("steps") or {}
    lines += [
        "",
        "Decode steps of 64+ pages (the farm's from its report's Batch steps table):",
        "",
        "| | p50 ms | KV positions a page's attention read, mean | the longest page's, mean |",
        "|---|---:|---:|---:|",
    ]
    for admission, engine in engines.items():
        lines.append(
            f"| {ADMITTED[admission]} | {fmt(engine.get('wide_decode_step_ms_p50'))} | {fmt(engine.get('wide_kv_per_page'), 0)} "
            f"| {fmt(engine.get('wide_kv_longest'), 0)} |"
        )
    if steps:
        lines.append(
            f"| farm (K = 1) | {fmt(steps.get('decode_64_p50_ms'))} | {fmt(steps.get('decode_64_kv_per_page'), 0)} "
            f"| {fmt(steps.get('decode_64_kv_longest'), 0)} |"
        )
    lines.append("")
    farm_tokens = (serving or {}).get("output_tokens_per_s")
    for admission in args.admission.split(","):
        steady = engines.get(admission, {}).get("steady_output_tokens_per_s")
        if farm_status != "complete":
            lines.append(f"Farm / {ADMITTED[admission]}: not measured (the farm's run: {farm_status})")
        elif not (steady and farm_tokens):
            lines.append(f"Farm / {ADMITTED[admission]}: not measured (a side is missing: see the logs)")
        elif admission == "window":
            verdict = "PASS" if farm_tokens / steady >= TARGET else "FAIL"
            lines.append(f"Farm / engine alone (steady windows): **{farm_tokens / steady:.3f}** (target >= {TARGET}): "
                         f"{verdict}")  # fmt: skip
        else:
            lines.append(f"Farm / {ADMITTED[admission]} (steady windows): **{farm_tokens / steady:.3f}**")
    return "\n".join(lines) + "\n"


def both_sides(args: argparse.Namespace, pages: Path, began: float, engine_out: Path, farm_out: Path) -> int:
    """The engine alone into `engine_out`, then the farm into `farm_out`, on the file list `pages`, within
    what is left of --budget-s since `began`. Returns the job count, the same on each side."""
    repeats, jobs = jobs_for(args.concurrency, listed_pages(pages), args.generations)
    python = sys.executable
    run(
        [python, "benchmarks/bench_serving.py", "--model", args.model, "--mode", args.mode, "--pages",
         str(pages), "--concurrency", str(args.concurrency), "--tokens", str(args.max_new_tokens),
         "--min-requests", str(jobs), "--batch1-pages", "1", "--admission", args.admission, "--out", str(engine_out),
         *(["--device", "cpu", "--attention", "masked"] if args.cpu else [])],  # fmt: skip
        args.out / "engine.log",
        args.budget_s * (0.4 + 0.1 * len(args.admission.split(","))),  # the farm's side gets the rest
        args.compile_cache,
    )
    left = args.budget_s - (time.perf_counter() - began)
    run(
        [python, "benchmarks/bench_scaling.py", "--gpus", "cpu" if args.cpu else "1", "--ks", "1", "--engines", "fast", "--model",
         args.model, "--mode", args.mode, "--filelist", str(pages), "--max-new-tokens",
         str(args.max_new_tokens), "--repeats", f"fast={repeats}", "--generations", str(args.generations), "--concurrency", str(args.concurrency),
         "--compile-cache", args.compile_cache, "--budget-s", str(max(left - 15, 60)), "--run-timeout-s",
         str(max(left - 120, 60)), "--out", str(farm_out)],  # fmt: skip
        args.out / "farm.log",
        max(left - 5, 60),
        args.compile_cache,
    )
    return jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--filelist", type=Path, default=REPO / "datasets/omnidocbench/subsets/demo-18.txt")
    parser.add_argument("--model", default="full")
    parser.add_argument("--mode", default="gundam")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--compile-cache", default="/tmp/dc", help="DSOCR_COMPILE_CACHE_DIR of both sides")
    parser.add_argument("--admission", default="window", help="the engine alone's: window, one-a-step or both")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (figures meaningless)")
    parser.add_argument("--generations", type=int, default=GENERATIONS,
                        help="jobs: this many times the concurrency, on each side (bench_scaling's)")
    parser.add_argument("--variants", type=int, default=len(VARIANTS),
                        help="distinct versions of each page (page_variants.py; 1: the list as it is)")
    parser.add_argument("--budget-s", type=float, default=570, help="both sides within this many seconds")
    args = parser.parse_args()
    if not set(args.admission.split(",")) <= set(ADMITTED):
        parser.error(f"--admission takes window, one-a-step or both, not {args.admission}")
    began = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    engine_out, farm_out = args.out / "engine", args.out / "farm"
    with tempfile.TemporaryDirectory(prefix="farm-vs-engine-pages-") as folder:
        pages = args.filelist if args.variants == 1 else write_variants(args.filelist, args.variants, Path(folder))
        jobs = both_sides(args, pages, began, engine_out, farm_out)
    text = table(engine_rows(engine_out / "serving.json", args.concurrency), farm_run(farm_out), args, jobs)
    print(text)
    # One raw file: the comparison, then each side's own tables (with its GPU, versions and tree).
    sides = [("The farm's run (bench_scaling.py)", sorted(farm_out.glob("scaling-*.md"))),
             ("The engine alone (bench_serving.py)", [engine_out / "serving.md"])]  # fmt: skip
    for title, found in sides:
        text += f"\n## {title}\n\n" + ("".join(f.read_text() for f in found if f.exists()) or "(none written)\n")
    (args.out / "farm-vs-engine.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
