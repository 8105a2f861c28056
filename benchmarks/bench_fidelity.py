"""Fidelity of the fast engine to the eager reference (issue 10 item 6), on the 7 sample pages.

    python benchmarks/bench_fidelity.py [--dtypes float32,bfloat16] [--steps 128] [--out DIR]

Per dtype, one eager and one fast session of the `full` preset (RANDOM WEIGHTS, seed 0) on the GPU, and
for every page of datasets/samples/samples.txt in gundam mode (tiles from none to 3x3, EXIF rotation):
  - free running: both engines decode `--steps` greedy tokens (the vendor's 20-gram ban on, EOS ignored);
    the steps until the fast engine's first different token;
  - teacher forced: the fast engine fed the eager tokens, the fraction of steps whose top-1 is eager's
    token (`engine.verify.teacher_forced_top1`), and at every step where it is not, how far apart the
    two tokens are in eager's own scores (its one-shot forward over the same prefix,
    `engine.verify.one_shot_scores`): the gap relative to the top logit, and the fast token's rank;
  - the floor: the same eager session computing the same steps by its other path (one cache-free
    forward instead of prefill + decode), top-1 equal to its split path's token. Kernels that only
    round differently cannot be expected to agree more often than this;
  - `dsocr verify`'s checks (split decode = one-shot generation, KV growth, vision once inside prefill,
    NVTX balanced) on every page, for the fast session and, as the checks' own floor, the eager one:
    in bf16 on random weights the split = one-shot check meets near-ties past its rounding allowance on
    some pages (docs/benchmarks.md), so one page's verdict says little.
Targets: float32, 100% of steps equal free running; bfloat16, ≥ 99% teacher-forced top-1 over all pages.
Output: fidelity.json / fidelity.md in --out (default $OUT); the table is printed last. `--device cpu
--model tiny` is a smoke run of the script (the fast engine runs eager there: agreement is trivial).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, environment_line, fmt  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.engine.verify import NEAR_TIE, one_shot_scores, run_checks, teacher_forced_top1  # noqa: E402

SAMPLES = REPO / "datasets" / "samples" / "samples.txt"
TARGETS = {"float32_free_running": 1.0, "bfloat16_teacher_forced": 0.99}
OPTIONS = DecodeOptions(ignore_eos=True)  # greedy with the vendor's 20-gram ban, a fixed length
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def sample_pages() -> list[Path]:
    names = [line.strip() for line in SAMPLES.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [SAMPLES.parent / name for name in names]


def compare_page(eager: DeepSeekOCRSession, fast: DeepSeekOCRSession, page: Path, steps: int) -> dict[str, Any]:
    reference = eager.run_inference(page, mode="gundam", max_new_tokens=steps, infer=OPTIONS)
    free = fast.run_inference(page, mode="gundam", max_new_tokens=steps, infer=OPTIONS)
    forced = teacher_forced_top1(fast, page, reference.token_ids, OPTIONS, "gundam")
    scores = one_shot_scores(eager, page, reference.token_ids, OPTIONS, "gundam")
    same = next((k for k, (a, b) in enumerate(zip(reference.token_ids, free.token_ids, strict=True)) if a != b), steps)
    return {
        "page": page.name, "crop_grid": list(reference.crop_grid), "prompt_tokens": reference.prompt_tokens,
        "free_running_same_steps": same,
        "teacher_forced_agree": sum(a == b for a, b in zip(reference.token_ids, forced, strict=True)),
        "disagreements": disagreements(scores, reference.token_ids, forced, eager.dtype),
        "eager_one_shot_agree": int((scores.argmax(dim=-1) == torch.tensor(reference.token_ids)).sum()),
        "steps": steps, "fast_engine_ran": free.engine_name,
    }  # fmt: skip


def disagreements(scores: torch.Tensor, eager_tokens: list[int], fast_tokens: list[int], dtype: torch.dtype) -> list[dict[str, Any]]:
    """Each step where the fast engine's top-1 is not eager's token, seen in eager's scores: the logit
    gap between the two tokens relative to the top logit (a near-tie when within `NEAR_TIE` of the
    dtype, the rounding `dsocr verify` allows) and the fast token's rank (0 = eager's own pick)."""
    out = []
    for step, (mine, theirs) in enumerate(zip(eager_tokens, fast_tokens, strict=True)):
        if mine == theirs:
            continue
        row = scores[step]
        relative_gap = float(row[mine] - row[theirs]) / max(1.0, abs(float(row.max())))
        out.append({"step": step, "relative_gap": relative_gap, "fast_token_rank": int((row > row[theirs]).sum()),
                    "near_tie": relative_gap <= NEAR_TIE.get(dtype, 0.0)})  # fmt: skip
    return out


def bench_dtype(dtype: str, args: argparse.Namespace, pages: list[Path]) -> dict[str, Any]:
    sessions = {engine: DeepSeekOCRSession.from_local(args.model, device=args.device, dtype=dtype, engine=engine)
                for engine in ("eager", "fast")}  # fmt: skip
    out: dict[str, Any] = {"model": sessions["eager"].source.label, "pages": []}
    for page in pages:
        log(f"{dtype} {page.name}")
        out["pages"].append(compare_page(sessions["eager"], sessions["fast"], page, args.steps))
    out["verify"] = {
        engine: [{"page": page.name, "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail}
                                                for c in run_checks(sessions[engine], page, max_new_tokens=32)]}
                 for page in pages]
        for engine in ("fast", "eager")
    }  # fmt: skip
    total = sum(p["steps"] for p in out["pages"])
    out["free_running_share"] = sum(p["free_running_same_steps"] for p in out["pages"]) / total
    out["teacher_forced_share"] = sum(p["teacher_forced_agree"] for p in out["pages"]) / total
    out["eager_one_shot_share"] = sum(p["eager_one_shot_agree"] for p in out["pages"]) / total
    gaps = [d for p in out["pages"] for d in p["disagreements"]]
    out["disagreements_near_tied"] = sum(d["near_tie"] for d in gaps)
    out["max_relative_gap"] = max((d["relative_gap"] for d in gaps), default=None)
    return out


def scientific(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"### Fast vs eager fidelity, {env['date']}",
        "",
        f"{environment_line(env)} `{report['model']}` preset, RANDOM WEIGHTS; {report['pages']} sample pages in gundam mode; "
        f"{report['steps']} greedy steps (20-gram ban, EOS ignored). Command: `{report['command']}`",
        "",
        *(["**The fast engine ran as eager here (no CUDA): a smoke run of the script, agreement is trivial.**", ""]
          if any(p["fast_engine_ran"] != "fast" for r in report["dtypes"].values() for p in r.get("pages", []))
          else []),
        "| dtype | page | grid | free running: steps equal | teacher forced: top-1 equal | disagreements near-tied | "
        "largest gap / top logit | floor: eager one-shot = eager split |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, result in report["dtypes"].items():
        if "error" in result:
            lines.append(f"| {dtype} | ERROR {result['error']} | | | | | | |")
            continue
        for p in result["pages"]:
            gaps = p["disagreements"]
            largest = max((d["relative_gap"] for d in gaps), default=None)
            lines.append(f"| {dtype} | {p['page']} | {p['crop_grid'][0]}x{p['crop_grid'][1]} | "
                         f"{p['free_running_same_steps']} / {p['steps']} | {p['teacher_forced_agree']} / {p['steps']} | "
                         f"{sum(d['near_tie'] for d in gaps)} / {len(gaps)} | {scientific(largest)} | "
                         f"{p['eager_one_shot_agree']} / {p['steps']} |")  # fmt: skip
        total = sum(len(p["disagreements"]) for p in result["pages"])
        lines.append(f"| {dtype} | **all pages** | | **{fmt(100 * result['free_running_share'], 2)}%** | "
                     f"**{fmt(100 * result['teacher_forced_share'], 2)}%** | {result['disagreements_near_tied']} / {total} | "
                     f"{scientific(result['max_relative_gap'])} | **{fmt(100 * result['eager_one_shot_share'], 2)}%** |")  # fmt: skip
    lines.append("")
    for dtype, result in report["dtypes"].items():
        lines.extend(verify_lines(dtype, result.get("verify", {})))
    f32, b16 = report["dtypes"].get("float32", {}), report["dtypes"].get("bfloat16", {})
    if "free_running_share" in f32:
        lines.append(f"\nfloat32 free running equal {f32['free_running_share']:.2%} (target 100%).")
    if "teacher_forced_share" in b16:
        lines.append(f"bfloat16 teacher-forced top-1 {b16['teacher_forced_share']:.2%} (target ≥ 99%).")
    return "\n".join(lines) + "\n"


def verify_lines(dtype: str, verify: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per `dsocr verify` check, the pages each engine passes, and every failure's detail."""
    lines = []
    names = [check["name"] for check in next(iter(verify.values()), [{"checks": []}])[0]["checks"]]
    for index, name in enumerate(names):
        passed = {engine: sum(page["checks"][index]["passed"] for page in pages) for engine, pages in verify.items()}
        counts = ", ".join(f"{engine} {passed[engine]} / {len(pages)} pages" for engine, pages in verify.items())
        lines.append(f"- {dtype} `dsocr verify`, {name}: passed by {counts}")
        lines.extend(f"  - FAIL {engine}, {page['page']}: {page['checks'][index]['detail']}"
                     for engine, pages in verify.items() for page in pages if not page["checks"][index]["passed"])
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--pages", type=int, default=None, help="only the first N sample pages (smoke runs)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_fidelity needs a CUDA GPU (or --device cpu --model tiny for a smoke run)", file=sys.stderr)
        return 2
    pages = sample_pages()[: args.pages]
    report: dict[str, Any] = {
        "environment": environment(), "command": shlex.join(["python", "benchmarks/bench_fidelity.py", *sys.argv[1:]]),
        "model": args.model, "steps": args.steps, "pages": len(pages), "targets": TARGETS, "dtypes": {},
    }  # fmt: skip
    for dtype in args.dtypes.split(","):
        try:
            report["dtypes"][dtype] = bench_dtype(dtype, args, pages)
        except Exception as exc:  # keep the other dtype's numbers
            traceback.print_exc()
            report["dtypes"][dtype] = {"error": f"{type(exc).__name__}: {exc}"}
        torch._dynamo.reset()  # the compiled graphs of this dtype's fast session go with its weights
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.out / "fidelity.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
