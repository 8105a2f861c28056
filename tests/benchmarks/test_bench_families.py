"""benchmarks/bench_families.py end to end on the CPU: both families' tiny presets (random weights) through
the interleaved batch-1 jobs and one batched level, on one small page, a few tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_families.py"
SAMPLE = REPO / "datasets" / "samples" / "small_600x480.png"


def test_both_families_side_by_side(tmp_path: Path) -> None:
    pages = tmp_path / "pages.txt"
    pages.write_text(f"{SAMPLE}\n")
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--models", "tiny,ocr2-tiny", "--device", "cpu", "--tokens", "3",
               "--repeats", "2", "--pages", str(pages), "--concurrency", "2", "--min-requests", "2",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "families.json").read_text())
    assert report["errors"] == {}
    jobs = report["jobs"]
    # Interleaved: each round has one job of each model, and the order alternates between rounds.
    assert [j["model"] for j in jobs] == ["tiny", "ocr2-tiny", "ocr2-tiny", "tiny"]
    assert all(j["output_tokens"] == 3 and j["encoder_ms"] > 0 and j["sam_ms"] > 0 for j in jobs)
    tokens = {j["model"]: j["image_tokens"] for j in jobs}
    assert tokens["ocr2-tiny"] != tokens["tiny"]  # DeepSeek-OCR-2's queries, not CLIP's patch grid
    summary = report["batch1"]
    assert summary["ratio"]["image_tokens"]["value"] == tokens["ocr2-tiny"] / tokens["tiny"]
    assert summary["tiny"]["figures"]["e2e_ms"]["n"] == 2
    assert {r["model"] for r in report["batched"] if "output_tokens_per_s" in r} == {"tiny", "ocr2-tiny"}
    assert set(report["best_batched"]) == {"tiny", "ocr2-tiny"}
    table = (out / "families.md").read_text()
    assert table.count("RANDOM WEIGHTS") == 2 and "| batch-1 e2e ms |" in table
    assert "Not measured" not in table


def test_bad_models_exit_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--models", "tiny,tiny", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 2 and "distinct" in done.stderr and "Traceback" not in done.stderr
