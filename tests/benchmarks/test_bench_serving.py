"""benchmarks/bench_serving.py --profile on the CPU: every N-th step under torch.profiler, the level's
sampled decode steps kernel by kernel, and those steps out of its step-time statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


def test_a_profiled_level_lists_its_sampled_decode_steps_kernel_by_kernel(tmp_path, subprocess_env):
    out = tmp_path / "serving"
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu", "--tokens", "8", "--concurrency",
               "2", "--batch1-pages", "1", "--pages", "datasets/samples/samples.txt", "--attention", "masked",
               "--min-requests", "4", "--profile", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env,
                          cwd=SCRIPT.parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((out / "serving.json").read_text())["levels"]
    kernels = row["full_step_kernels"]
    decode_steps = row["pages"] * 7 / row["mean_occupancy"]  # 8 tokens a page: the first from its prefill
    assert 0 < kernels["steps"] <= decode_steps / 2 + 1  # every 2nd step of its kind, not every step
    names = {k["name"]: k for k in kernels["kernels"]}
    assert "aten::mm" in names and names["aten::mm"]["calls"] > 0
    assert 0 < kernels["busy_ms"] <= kernels["clock_ms"]
    markdown = (out / "serving.md").read_text()
    assert "kernel by kernel" in markdown and "| `aten::mm` |" in markdown
