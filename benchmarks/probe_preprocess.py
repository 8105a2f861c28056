"""Host preprocessing of gundam pages (`preprocess.prepare_page`), this tree against another revision's, on
the CPU, interleaved, outputs checked equal:

    python benchmarks/probe_preprocess.py [--before REV] [--rounds N]

The other revision's `dsocr_workers/model/preprocess.py` is read with `git show REV:...` and imported
beside this one (it imports the rest of the package from this tree). Prints a markdown table: page, crop
grid, median ms before / now, ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAGES = ((1600, 2000), (1400, 1400), (800, 4000), (1280, 640))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD~1", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    from benchmarks.bench_engine import synthetic_page
    from dsocr_workers.model import preprocess
    from dsocr_workers.model.tokenizer import OCRTokenizer

    source = subprocess.run(["git", "show", f"{args.before}:dsocr_workers/model/preprocess.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "preprocess_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("preprocess_before", path)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = before  # its dataclasses look their module up there
        spec.loader.exec_module(before)
    tokenizer = OCRTokenizer.build_preset()
    print(f"| page | grid | before ({args.before}) ms | now ms | ratio |\n|---|---|---:|---:|---:|")
    for size in PAGES:
        image = synthetic_page().resize(size)
        times: dict[str, list[float]] = {"before": [], "now": []}
        for round_ in range(args.rounds):
            order = (("before", before), ("now", preprocess)) if round_ % 2 else (("now", preprocess), ("before", before))
            for name, module in order:
                began = time.perf_counter()
                page = module.prepare_page(image, tokenizer.encode, mode="gundam")
                times[name].append(time.perf_counter() - began)
        old = before.prepare_page(image, tokenizer.encode, mode="gundam")
        new = preprocess.prepare_page(image, tokenizer.encode, mode="gundam")
        assert (old.global_pixels == new.global_pixels).all() and (old.input_ids == new.input_ids).all()
        assert (old.tile_pixels is None) == (new.tile_pixels is None)
        assert old.tile_pixels is None or (old.tile_pixels == new.tile_pixels).all()
        was, now = statistics.median(times["before"]) * 1e3, statistics.median(times["now"]) * 1e3
        print(f"| {size[0]}x{size[1]} | {page.crop_grid[0]}x{page.crop_grid[1]} | {was:.1f} | {now:.1f} | {now / was:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
