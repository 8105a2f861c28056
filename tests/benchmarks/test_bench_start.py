"""benchmarks/bench_start.py on the CPU: two lanes started batch-1 and batched, each start's total from
launch to its last child's worker session, in parts that add up to it without double counting."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_start.py"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server: the script starts its own")
def test_starts_of_both_regimes_are_timed_to_every_child_ready_in_parts(tmp_path: Path, subprocess_env) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--compile-cache", str(tmp_path / "cache"),
               "--devices", "cpu", "--model", "tiny", "--engine", "eager", "--modes", "tiny", "--ks", "2",
               "--concurrency", "1,4", "--max-new-tokens", "8", "--timeout-s", "240"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (report_path,) = out.glob("start-*.json")
    report = json.loads(report_path.read_text())
    assert report["floor"]["torch_import_s"] > 0 and report["floor"]["weights_gb"] > 0
    assert [(s["concurrency"], s["k"], s["cache"]) for s in report["starts"]] == [(1, 2, "built"), (4, 2, "built")]
    for start in report["starts"]:
        assert start["children_ready"] == 2 and len(start["sessions"]) == 2, start
        parts = start["parts_s"]
        # The parent imported for both children; each child loaded and ran its warm-up's passes.
        assert parts["imports"] > 0 and parts["load"] > 0 and parts["pass 1"] > 0, parts
        assert parts["CLI"] > 0 and parts["Celery and fork"] > 0, parts
        # No part counted twice (the phases come from the record's text, each rounded to 0.01 s).
        assert all(value >= -0.05 for value in parts.values()), parts
        assert sum(parts.values()) == pytest.approx(start["total_s"], abs=0.01)
        assert start["children_warm_s"] <= start["total_s"] + 5.0  # the log's last warm line: just after the last ready_at
    batch_1, batched = report["starts"]
    assert "batched start" not in batch_1["parts_s"] and batched["parts_s"]["batched start"] >= 0  # parsed
    table = (out / report_path.name.replace(".json", ".md")).read_text()
    assert "| 1 | 2 | built: none used | **" in table and "| 4 | 2 | built: none used | **" in table


def test_a_warm_ups_passes_and_prefill_captures_are_parts_of_their_own() -> None:
    from benchmarks.bench_start import warmup_parts

    text = ("gundam (256 tokens); warm-up 6.00 s (load packages 0.20 s, pass 1 1.80 s, "
            "prefill graphs 1 3.00 s, pass 2 0.30 s, prefill graphs 2 0.00 s); 27 LM prefill graphs captured")  # fmt: skip
    parts = warmup_parts(text, 6.0)
    assert parts == pytest.approx({"artifacts": 0.2, "pass 1": 1.8, "later passes": 0.3, "prefill graphs": 3.0,
                                   "rest of warm-up": 0.7})  # fmt: skip
