"""Decode ms/token and the parts of end-to-end per KV-cache bucket, in one process (issue 10 item 4).

The fast engine compiles its decode step once for every cache bucket (the capacity is symbolic); before,
the first bucket a process met got a static graph and the second one dynamo's automatic dynamic graph.
This runs the anchors' page (1600x2000, gundam 2x3, 916 prompt tokens; `--modes` adds the page in other
modes) with each token budget of `--tokens` (64 → the 1024-position bucket, 256 → 2048), every budget
once to compile and capture, then 4 warm-up and `--runs` timed jobs per budget; prints the medians (CUDA
events; prefill also per stage) as one JSON line. Run it on two commits in one device call to compare
them side by side.

    python benchmarks/bench_buckets.py [--tokens 64,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,256", help="token budgets, comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="timed jobs per budget (after 4 warm-up jobs)")
    parser.add_argument("--modes", default="gundam", help="modes, comma-separated: the page resized by each")
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (fast runs eager there)")
    args = parser.parse_args()

    from benchmarks.bench_engine import synthetic_page
    from dsocr_workers.engine.result import DecodeOptions
    from dsocr_workers.engine.session import DeepSeekOCRSession

    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    session = DeepSeekOCRSession.from_local(args.model, device=args.device, dtype=dtype, engine="fast")
    page = synthetic_page().resize((1600, 2000))
    options = DecodeOptions(no_repeat_ngram_size=20, ignore_eos=True)
    budgets = [int(tokens) for tokens in args.tokens.split(",")]
    report: dict = {"repo": str(REPO), "model": args.model, "engine": session.engine_name, "dtype": dtype,
                    "random_weights": session.source.random_weights}  # fmt: skip
    modes = args.modes.split(",")
    for mode in modes:  # every bucket once: compiles and captures whatever it meets first
        for tokens in budgets:
            session.run_inference(page, mode=mode, max_new_tokens=tokens, infer=options)
    for mode, tokens in ((mode, tokens) for mode in modes for tokens in budgets):
        for _ in range(4):
            session.run_inference(page, mode=mode, max_new_tokens=tokens, infer=options)
        runs = [session.run_inference(page, mode=mode, max_new_tokens=tokens, infer=options) for _ in range(args.runs)]
        # Keyed by the budget alone for gundam (the script's first output), by mode/budget otherwise.
        report[str(tokens) if mode == "gundam" else f"{mode}/{tokens}"] = {
            "kv_length": runs[0].kv_length,
            "decode_ms_per_token_mean": statistics.median(r.timings.decode_ms / len(r.timings.decode_step_ms) for r in runs),
            "decode_step_p50": statistics.median(statistics.median(r.timings.decode_step_ms) for r in runs),
            "prefill_ms": statistics.median(r.timings.prefill_ms for r in runs),
            "prefill_stages_ms": {stage: statistics.median(getattr(r.timings, f"{stage}_ms") for r in runs)
                                  for stage in ("sam", "clip", "projector", "lm_prefill")},
            "parts_ms": {part: statistics.median(r.timings.parts_ms[part] for r in runs) for part in runs[0].timings.parts_ms},
            "e2e_ms": statistics.median(r.timings.e2e_ms for r in runs),
            "cold": sum(r.cold for r in runs),
        }  # fmt: skip
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
