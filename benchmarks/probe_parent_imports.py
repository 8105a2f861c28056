"""What `dsocr worker`'s parent pays for its imports (`farm/celery/preimport.py` `import_for_jobs`), as
shipped and with one of its choices undone, side by side: rounds of fresh processes, the variants in a
new random order each round, each process timing `import_for_jobs()` alone.

- `shipped`: as a worker runs it;
- `collector-on`: the cyclic garbage collector left on during the imports;
- `left-in`: nothing left out (`LEFT_OUT` emptied: scikit-learn, SciPy, torchvision and torchaudio
  imported where installed, as transformers does).

    python3 benchmarks/probe_parent_imports.py --rounds 8 --out benchmarks/results

Each process first takes the bytecode as `dsocr` does (`use_bytecode_cache`): with `--compile-cache
DIR` on an installation that has none and may not be written (the GPU image; Python there runs with
PYTHONDONTWRITEBYTECODE), from DIR/python-bytecode, which a first process, not counted, writes after
importing every variant's modules (`write_bytecode`, as the build step does); the other variants then
run once, not counted either, to read every file once. Without it, a process that compiles every source
takes three to four times as long. Prints each process's time, then the median of each variant and the
median paired difference to `shipped`; writes the same as markdown and JSON into --out
(parent-imports-<UTC>.{md,json}), with the command, host, Python, torch and transformers versions.

    python3 benchmarks/probe_parent_imports.py --rounds 8 --compile-cache /tmp/dc --out $OUT   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Each variant's change, made before `import_for_jobs()` in its own fresh process.
VARIANTS = {
    "shipped": "",
    "collector-on": "import gc; gc.disable = lambda: None",
    "left-in": "p.LEFT_OUT = ()",
}
# As `dsocr`'s entry point does before any heavy import: the bytecode from the compile cache where the
# installation has none and may not be written (engine/coldstart/cache.py).
TIMED = """
import json, time
from dsocr_workers.engine.coldstart.cache import use_bytecode_cache, write_bytecode
use_bytecode_cache()
import dsocr_workers.farm.celery.preimport as p
{change}
began = time.perf_counter()
imported = p.import_for_jobs()
print(json.dumps({{"s": time.perf_counter() - began, "modules": imported.modules}}))
{after}
"""


def one_process(variant: str, after: str = "") -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", TIMED.format(change=VARIANTS[variant], after=after)],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="folder for parent-imports-<UTC>.{md,json}")
    parser.add_argument("--compile-cache", type=Path, default=None,
                        help="DSOCR_COMPILE_CACHE_DIR for the processes: where the bytecode goes (as a worker's)")
    args = parser.parse_args()
    import torch
    import transformers

    began = datetime.now(UTC)
    if args.compile_cache is not None:
        os.environ["DSOCR_COMPILE_CACHE_DIR"] = str(args.compile_cache)
    one_process("left-in", after="write_bytecode()")  # every variant's modules
    for variant in VARIANTS:
        one_process(variant)
    rounds: list[dict[str, dict[str, float]]] = []
    for index in range(args.rounds):
        order = random.sample(list(VARIANTS), len(VARIANTS))
        measured = {variant: one_process(variant) for variant in order}
        rounds.append(measured)
        print(f"round {index + 1}: " + ", ".join(f"{v} {measured[v]['s']:.3f} s" for v in order), flush=True)
    lines = [
        f"# {platform.node()}, {began:%Y-%m-%d %H:%M} UTC, {args.rounds} rounds; Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        f"# {'PYTHONPYCACHEPREFIX=' + os.environ['PYTHONPYCACHEPREFIX'] + ' ' if os.environ.get('PYTHONPYCACHEPREFIX') else ''}"
        f"python3 benchmarks/probe_parent_imports.py --rounds {args.rounds}"
        f"{' --compile-cache ' + str(args.compile_cache) if args.compile_cache else ''}",
        "",
        "| variant | modules | median s | min s | max s | paired difference to shipped, median s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for variant in VARIANTS:
        times = [r[variant]["s"] for r in rounds]
        paired = [r[variant]["s"] - r["shipped"]["s"] for r in rounds]
        summary[variant] = {
            "modules": rounds[0][variant]["modules"], "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "paired_median_s": statistics.median(paired), "times_s": times,
        }  # fmt: skip
        row = summary[variant]
        lines.append(
            f"| {variant} | {row['modules']} | {row['median_s']:.3f} | {row['min_s']:.3f} | {row['max_s']:.3f} | "
            f"{row['paired_median_s']:+.3f} |"
        )
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"parent-imports-{began:%Y-%m-%dT%H%M}"
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        stem.with_suffix(".json").write_text(json.dumps({"began": began.isoformat(), "rounds": rounds,
                                                         "summary": summary}, indent=1))  # fmt: skip
        print(f"written: {stem}.md, .json")


if __name__ == "__main__":
    main()
