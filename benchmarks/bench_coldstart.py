"""Cold start of the fast engine (issue 10 item 4): from process launch to ready for every gundam grid and
the four fixed modes, with an empty and with a warm compile cache; and whether warm jobs kept their pace.

    python benchmarks/bench_coldstart.py [--out DIR]

Each measurement is a fresh process (`--child`), as a worker start is: it loads a checkpoint directory
with the fast engine in bf16 (by default the `full` preset, RANDOM WEIGHTS, saved once in the vendor layout
before any start and not timed: a worker loads a checkpoint from disk, while generating the preset's 3.3 B
random numbers on the host takes ~20 s that no real start has), runs `warm(session, ...)` (engine/coldstart/warmup.py) over every shape of the modes (the
worker's warm-up: a page per tile count of gundam, one per fixed mode, repeated until a pass meets no cold
path; all modes in one call, as a worker warms them, or one at a time with `--per-mode`), then times jobs on a few pages (2 warm-up runs each, then `--repeats`, 64 tokens, EOS ignored).
  A. dynamic tile batch, empty DSOCR_COMPILE_CACHE_DIR  — the cold start without artifacts, dynamo in the
     process (target ≤ 60 s to ready)
  B. dynamic tile batch, the cache A filled               — a restart (target ≤ 10 s to ready); where the
     installation ships no Python bytecode, also the bytecode A wrote after its timed jobs (as the
     build step `dsocr precompile` does, engine/coldstart/cache.py)
  C. static tile batch (a graph per tile count, the engine before), only the timed pages' shapes: the
     reference for "warm e2e must not regress" (skipped when the budget is short)
"Ready" is the child's wall clock from launch to the end of its warm-up (python start, imports, load,
warm-up), measured by the parent. Per page, the medians of prefill, e2e and decode ms per token (CUDA events; e2e
also holds the host's preprocessing, which moves with the host's load) of the timed
jobs, and the timed jobs still flagged cold. Output: coldstart.json / coldstart.md in --out (default $OUT).
CPU smoke (fast runs eager there, numbers meaningless): `--device cpu --model tiny --modes tiny,gundam
--repeats 1`.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (width, height) of the timed pages: four gundam grids with different tile counts (the first is the
# anchors' page, 2x3)
PAGES = ((1600, 2000), (1400, 1400), (1280, 640), (800, 4000))
ALL_MODES = "gundam,tiny,small,base,large"
TARGETS = {"cold_ready_s": 60.0, "warm_cache_ready_s": 10.0}


def child(args: argparse.Namespace) -> int:
    """One worker-like start: imports, load, warm-up, timed jobs; JSON on the last line of stdout."""
    began = time.time()
    # As `dsocr worker` starts (cli/__init__.py): bytecode kept in the compile cache where the
    # installation ships none and may not write it.
    from dsocr_workers.engine.coldstart.cache import use_bytecode_cache, use_compile_cache, write_bytecode

    bytecode = use_bytecode_cache()
    use_compile_cache()
    import torch

    torch_imported = time.time()
    from benchmarks.bench_engine import synthetic_page
    from dsocr_workers.engine.coldstart.warmup import warm as warm_up
    from dsocr_workers.engine.generate import cache_bucket
    from dsocr_workers.engine.result import DecodeOptions
    from dsocr_workers.engine.session import DeepSeekOCRSession
    from dsocr_workers.engine.variants.fast import FastCompile, FastEngine

    imported = time.time()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    # Warmed with the timed jobs' decode options (the decode step is compiled per n-gram ban). All modes
    # in one warm-up, as a worker warms them; `--per-mode`: one mode at a time, so that each mode's share of the warm-up is known.
    options = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)
    modes = [mode for mode in args.modes.split(",") if mode]
    groups = [[mode] for mode in modes] if args.per_mode else [modes]
    engine = FastEngine(FastCompile(dynamic_tiles=args.tiles == "dynamic"))
    session = DeepSeekOCRSession.from_local(args.model, device=args.device, dtype=dtype, engine=engine)
    loaded = time.time()
    warm = {}
    compile_s = {}
    for group in groups:
        name = ",".join(group)
        warm[name] = warm_up(session, group, max_new_tokens=args.tokens, infer=options)
        compile_s[name] = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
        # A progress line per warm-up: what the parent keeps if the start overruns its budget.
        print(json.dumps({"progress": name, "since_launch_s": time.time() - began, "warmup_s": warm[name].ms / 1e3,
                          "shapes": warm[name].shapes, "compile_times": compile_s[name]}), flush=True)  # fmt: skip
    ready = time.time()
    # What a worker's first full collection would scan and cost (farm/job/process.py settle_heap), after ready.
    heap_objects = len(gc.get_objects())
    collecting = time.perf_counter()
    gc.collect()
    full_collect_s = time.perf_counter() - collecting
    pages = []
    for width, height in PAGES:
        image = synthetic_page().resize((width, height))
        runs = [session.run_inference(image, mode="gundam", max_new_tokens=args.tokens, infer=options)
                for _ in range(2 + args.repeats)]  # fmt: skip
        timed = runs[2:]
        pages.append({
            "page": f"{width}x{height}", "crop_grid": list(timed[0].crop_grid),
            "prefill_ms": statistics.median(r.timings.prefill_ms for r in timed),
            "e2e_ms": statistics.median(r.timings.e2e_ms for r in timed),
            "decode_ms_per_token": statistics.median(r.timings.decode_ms / len(r.timings.decode_step_ms) for r in timed),
            "kv_bucket": cache_bucket(timed[0].prompt_tokens + args.tokens, session.max_positions),
            "parts_ms": {part: statistics.median(r.timings.parts_ms[part] for r in timed) for part in timed[0].timings.parts_ms},
            "first_run_s": runs[0].timings.e2e_ms / 1e3, "timed_cold": sum(r.cold for r in timed),
        })  # fmt: skip
    # As the build step does (`dsocr precompile`): the bytecode of every module imported, for the next
    # start measured.
    writing = time.time()
    written_s = time.time() - writing if write_bytecode() is not None else None
    print(json.dumps({
        "launched_to_imported_s": imported - began, "torch_import_s": torch_imported - began, "load_s": loaded - imported, "warmup_s": ready - loaded,
        "ready_unix": ready, "shapes": [shape for w in warm.values() for shape in w.shapes],
        "passes": max((w.passes for w in warm.values()), default=0),
        "still_cold": {mode: w.still_cold for mode, w in warm.items() if w.still_cold},
        "warmup_s_by_mode": {mode: w.ms / 1e3 for mode, w in warm.items()},
        "heap_objects": heap_objects, "full_collect_s": full_collect_s,
        "warmup_phases_s": {mode: {phase: ms / 1e3 for phase, ms in w.phases_ms.items()} for mode, w in warm.items()},
        # dynamo's own accounting of where compilation went (tracing, inductor, graph capture), per function
        "compile_times": torch._dynamo.utils.compile_times(repr="str", aggregate=True),
        "compile_times_after_mode": compile_s,
        "compilations": compilations(torch),
        "engine_ran": session.engine_name, "dtype": dtype, "compile_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "bytecode_cache": str(bytecode) if bytecode else None,
        "bytecode_written_s": written_s,
        "torch": torch.__version__, "pages": pages,
    }))  # fmt: skip
    return 0


def compilations(torch: Any) -> list[dict[str, Any]]:
    """Every frame dynamo compiled, in order: which function, its seconds (whole, then inductor's part),
    whether inductor's FX graph cache had it, and why it was compiled again if it was a recompilation."""
    return [{
        "function": m.co_name, "compile_id": str(m.compile_id), "s": m.entire_frame_compile_time_s,
        "inductor_s": m.inductor_compile_time_s, "fx_cache_hits": m.inductor_fx_local_cache_hit_count,
        "recompile_reason": m.recompile_reason, "graph_ops": m.graph_op_count,
    } for m in torch._dynamo.utils.get_compilation_metrics()]  # fmt: skip


def compilations_table(runs: dict[str, Any]) -> list[str]:
    """Per compiled function: how many frames and seconds each start spent on it."""
    lines = ["", "| start | function | frames compiled | s | of which inductor s |", "|---|---|---:|---:|---:|"]
    for key in ("cold", "warm_cache"):
        per_function: dict[str, list[dict[str, Any]]] = {}
        for c in runs.get(key, {}).get("compilations", []):
            per_function.setdefault(c["function"], []).append(c)
        for function, frames in sorted(per_function.items(), key=lambda item: -sum(c["s"] or 0 for c in item[1])):
            lines.append(f"| {key} | {function} | {len(frames)} | {sum(c['s'] or 0 for c in frames):.1f} "
                         f"| {sum(c['inductor_s'] or 0 for c in frames):.1f} |")  # fmt: skip
    return lines


def run_child(
    args: argparse.Namespace, model: str, tiles: str, modes: str, cache: Path, timeout: float
) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--tiles", tiles, "--modes", modes,
               "--model", model, "--device", args.device, "--tokens", str(args.tokens),
               "--repeats", str(args.repeats), *(["--per-mode"] if args.per_mode else [])]  # fmt: skip
    env = {**os.environ, "DSOCR_COMPILE_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    launched = time.time()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # The modes it warmed before the budget ran out (its progress lines).
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        progress = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"progress"')]
        return {"error": f"overran the budget after {timeout:.0f} s", "progress": progress}
    if done.returncode != 0:
        raise RuntimeError(f"child exited {done.returncode}: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["ready_s"] = result["ready_unix"] - launched
    result["process_s"] = time.time() - launched
    return result


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(report: dict[str, Any]) -> str:
    from benchmarks.bench_engine import environment_line

    env = report["environment"]
    runs = report["runs"]
    lines = [
        f"### Fast-engine cold start, {env['date']}",
        "",
        f"{environment_line(env)} `{report['model']}` preset, RANDOM WEIGHTS, "
        f"{next((r['dtype'] for r in runs.values() if 'dtype' in r), '-')}; warm-up modes {report['modes']}; "
        f"{report['tokens']} tokens per job; "
        + (f"each start loads the preset saved as a checkpoint (saving it took {report['preset_saved_s']:.1f} s, "
           "before any start). " if "preset_saved_s" in report else "")
        + f"Command: `{report['command']}`",
        "",
        "| start | launch → ready s | of which load s | warm-up s | shapes warmed | passes "
        "| warm-up by mode: its parts s |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    starts = (("cold", "A. empty compile cache (target ≤ 60 s)"), ("warm_cache", "B. warm compile cache (target ≤ 10 s)"))
    for key, label in starts:
        r = runs.get(key, {})
        if "error" in r or not r:
            progress = ", ".join(f"{p['progress']} {p['warmup_s']:.1f} s (at {p['since_launch_s']:.1f} s)"
                                 for p in r.get("progress", []))  # fmt: skip
            lines.append(f"| {label} | {r.get('error', 'not run')} | | | | | {progress or '-'} |")
            continue
        lines.append(f"| {label} | {r['ready_s']:.1f} | {r['load_s']:.1f} | {r['warmup_s']:.1f} | {len(r['shapes'])} | {r['passes']} |")
        phases = r.get("warmup_phases_s", {})
        by_mode = "; ".join(f"{mode} {seconds:.1f} s" + (": " + ", ".join(f"{phase} {s:.1f}" for phase, s in phases[mode].items())
                                                        if mode in phases else "")
                            for mode, seconds in r.get("warmup_s_by_mode", {}).items())  # fmt: skip
        lines[-1] += f" {by_mode or '-'} |"
    heaps = [f"{label.split('.')[0]}: {r['heap_objects'] / 1e6:.2f} M objects, a full collection {r['full_collect_s'] * 1e3:.0f} ms"
             for key, label in starts if "heap_objects" in (r := runs.get(key, {}))]  # fmt: skip
    if heaps:
        lines += ["", "After ready, what a first full garbage collection scans and costs: " + "; ".join(heaps) + "."]
    lines += ["", "| page | gundam grid | dynamic tiles: prefill / e2e ms / decode ms per token "
              "| static tiles (before): prefill / e2e ms / decode ms per token | KV bucket "
              "| timed jobs cold (dynamic / static) | first job s (dynamic) |", "|---|---|---|---|---:|---|---:|"]  # fmt: skip
    dynamic = {p["page"]: p for p in runs.get("warm_cache", {}).get("pages", [])}
    static = {p["page"]: p for p in runs.get("static", {}).get("pages", [])}
    for width, height in PAGES:
        name = f"{width}x{height}"
        d, s = dynamic.get(name), static.get(name)
        grid = "x".join(map(str, (d or s or {}).get("crop_grid", [])))
        def cell(p: dict[str, Any] | None) -> str:
            return f"{p['prefill_ms']:.2f} / {p['e2e_ms']:.1f} / {fmt(p.get('decode_ms_per_token'))}" if p else "-"

        cold = f"{d['timed_cold'] if d else '-'} / {s['timed_cold'] if s else '-'}"
        bucket = (d or s or {}).get("kv_bucket", "-")
        lines.append(f"| {name} | {grid} | {cell(d)} | {cell(s)} | {bucket} | {cold} | {d['first_run_s']:.2f} |" if d else
                     f"| {name} | {grid} | {cell(d)} | {cell(s)} | {bucket} | {cold} | - |")  # fmt: skip
    lines += compilations_table(runs)
    for key, r in runs.items():
        if r.get("engine_ran") not in (None, "fast"):
            lines.append(f"\n{key}: the fast engine ran as {r['engine_ran']} (no CUDA): a smoke run.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tiles", choices=("dynamic", "static"), default="dynamic", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default=ALL_MODES)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=560)
    parser.add_argument("--per-mode", action="store_true", help="warm one mode at a time (each mode's share)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from benchmarks.bench_engine import environment

    began = time.perf_counter()
    report: dict[str, Any] = {
        "environment": environment(), "command": shlex.join(["python", "benchmarks/bench_coldstart.py", *sys.argv[1:]]),
        "model": args.model, "modes": args.modes, "tokens": args.tokens, "targets": TARGETS, "runs": {},
    }  # fmt: skip

    def save() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "coldstart.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.out / "coldstart.md").write_text(markdown(report))

    from dsocr_workers.model.deepseek_ocr.config import PRESETS

    with (tempfile.TemporaryDirectory() as dynamic_cache, tempfile.TemporaryDirectory() as static_cache,
          tempfile.TemporaryDirectory() as scratch):  # fmt: skip
        model = args.model
        if model in PRESETS:
            from dsocr_workers.model.checkpoint import save_preset

            saving = time.perf_counter()
            model = str(save_preset(args.model, Path(scratch) / args.model))
            report["preset_saved_s"] = time.perf_counter() - saving
        plan = [("cold", "dynamic", args.modes, dynamic_cache), ("warm_cache", "dynamic", args.modes, dynamic_cache),
                ("static", "static", "", static_cache)]  # fmt: skip
        for key, tiles, modes, cache in plan:
            left = args.budget_s - (time.perf_counter() - began)
            if key == "static" and left < 240:  # a compile per timed page's tile count: minutes
                report["runs"][key] = {"error": f"skipped: {left:.0f} s of budget left"}
                continue
            print(f"[{time.perf_counter() - began:6.1f}s] {key}", flush=True)
            try:
                report["runs"][key] = run_child(args, model, tiles, modes, Path(cache), max(left, 1))
            except Exception as exc:  # keep what the other starts measured
                report["runs"][key] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
            save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
