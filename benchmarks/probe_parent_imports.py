"""What `dsocr worker`'s parent pays for its imports (`farm/celery/preimport.py` `import_for_jobs`), as
shipped and with one of its choices undone, side by side: rounds of fresh processes, the variants in a
new random order each round, each process timing `import_for_jobs()` alone.

- `shipped`: as a worker runs it;
- `collector-on`: the cyclic garbage collector left on during the imports;
- `left-in`: nothing left out (`LEFT_OUT` emptied: scikit-learn, SciPy, torchvision and torchaudio
  imported where installed, as transformers does).

    python3 benchmarks/probe_parent_imports.py --rounds 8 --out benchmarks/results

A first round, not counted, writes the bytecode the variants' imports lack (where PYTHONPYCACHEPREFIX
points, if set: on a GPU image whose packages cannot be written, as a worker's build writes its bytecode
into the compile cache) and reads every file once. Prints each process's time, then the median of each
variant and the median paired difference to `shipped`; writes the same as markdown and JSON into --out
(parent-imports-<UTC>.{md,json}), with the command, host, Python, torch and transformers versions.
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
TIMED = """
import json, time
import dsocr_workers.farm.celery.preimport as p
{change}
began = time.perf_counter()
imported = p.import_for_jobs()
print(json.dumps({{"s": time.perf_counter() - began, "modules": imported.modules}}))
"""


def one_process(variant: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", TIMED.format(change=VARIANTS[variant])],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="folder for parent-imports-<UTC>.{md,json}")
    args = parser.parse_args()
    import torch
    import transformers

    began = datetime.now(UTC)
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
        f"python3 benchmarks/probe_parent_imports.py --rounds {args.rounds}",
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
