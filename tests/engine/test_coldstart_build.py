"""The build step and its artifacts (engine/coldstart/build.py, artifacts.py): a manifest keyed by all
that changes compiled code, refused with its reason when built elsewhere; `dsocr precompile` builds a
plan once (inductor on the CPU, the tiny preset), says "up to date" after, and a worker's warm-up then
loads every graph from it without a compile helper."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dsocr_workers.cli import main
from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.artifacts import Environment
from dsocr_workers.engine.coldstart.plan import CompilePlan, compile_plan
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants.fast import FastCompile, FastEngine
from dsocr_workers.model.config import PRESETS

ENGINE = FastEngine(FastCompile("inductor", cuda_graphs=False))
KERNELS = {**ENGINE.kernels(), "experts_implementation": "batched_mm"}  # no Triton on a CPU
H100 = "NVIDIA H100 80GB HBM3 (sm_90)"
H200 = "NVIDIA H200 (sm_90)"


def plan(modes: tuple[str, ...] = ("tiny",)) -> CompilePlan:
    made = compile_plan("tiny", torch.device("cuda", 0), torch.bfloat16, KERNELS, ENGINE.compiled(), modes, 8, None, 3,
                        engine="fast")  # fmt: skip
    assert made is not None
    return made


def test_the_plan_key_holds_all_that_changes_compiled_code():
    key = artifacts.plan_key(plan(), PRESETS["tiny"])
    assert key == artifacts.plan_key(plan(), PRESETS["tiny"])
    assert key != artifacts.plan_key(plan(), PRESETS["full"])
    for changed in ({"modes": ("gundam", "tiny")}, {"dtype": "float16"}, {"max_new_tokens": 9},
                    {"options": DecodeOptions(no_repeat_ngram_size=0)}, {"engine": "other"},
                    {"dynamic_tiles": False}, {"device": "cuda:1"}):  # fmt: skip
        assert key != artifacts.plan_key(CompilePlan(**{**plan().__dict__, **changed}), PRESETS["tiny"]), changed


def test_artifacts_built_elsewhere_are_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    on_h200 = Environment.here(torch.device("cpu"), gpu=H200)
    on_h100 = replace(on_h200, gpu=H100)
    config = PRESETS["tiny"]
    none = artifacts.lookup(plan(), config, on_h100)
    assert none.manifest is None
    assert none.summary == ("no artifacts: none built for this plan (tiny, fast engine, bfloat16, modes tiny, 8 tokens); "
                            "compiled at start")  # fmt: skip
    written = artifacts.record(plan(), config, "dsocr precompile", 12.3, environment=on_h200)
    assert written is not None and written.parent.parent == tmp_path / artifacts.MANIFESTS
    found = artifacts.lookup(plan(), config, on_h200)
    assert found.manifest is not None and found.path == written and found.manifest.kinds() == {"inductor-cache"}
    assert found.summary.startswith(f"prebuilt artifacts (dsocr precompile, {found.manifest.built_at}): ")
    assert artifacts.lookup(plan(), config, on_h100).reason == f"artifacts refused (built for {H200}, this is {H100})"
    newer = replace(on_h200, torch="9.9.9", code="0123")
    assert artifacts.lookup(plan(), config, newer).reason == (
        f"artifacts refused (torch {on_h200.torch} vs 9.9.9; built by other code of this package (its sources changed))")
    assert artifacts.lookup(plan(("gundam",)), config, on_h200).reason.startswith("none built for this plan")
    # Before CUDA is up (a worker child about to fork its helpers): listed if all but the GPU match.
    assert artifacts.listed_without_gpu(plan(), config, on_h100)
    assert not artifacts.listed_without_gpu(plan(), config, newer)
    # Another format: never read as this one.
    data = json.loads(written.read_text())
    written.write_text(json.dumps({**data, "format": artifacts.FORMAT + 1}))
    assert artifacts.lookup(plan(), config, on_h200).reason.startswith(f"artifacts refused (manifest format {artifacts.FORMAT + 1}")


def test_precompile_of_an_engine_that_compiles_nothing_says_so(tmp_path):
    result = CliRunner().invoke(main, ["precompile", "--model", "tiny", "--gpus", "cpu", "--modes", "tiny"],
                                env={"DSOCR_COMPILE_CACHE_DIR": str(tmp_path),
                                     "TORCHINDUCTOR_CACHE_DIR": None})  # set by the command: restored after  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "nothing to compile: -"
    assert "the eager engine compiles nothing ahead of jobs" in result.stderr
    bad = CliRunner().invoke(main, ["precompile", "--model", "tiny", "--gpus", "cpu", "--modes", "none"])
    assert bad.exit_code == 2 and "--modes none: nothing to build" in bad.output


# `dsocr precompile` as a CPU build runs it (argv[1] "build"), or a worker's start after it ("worker"):
# the fast engine with inductor, without CUDA graphs and with transformers' expert GEMMs (no Triton here).
BUILD = """
import dataclasses, json, sys, torch
from dsocr_workers.engine.coldstart.build import BuildRequest, build
from dsocr_workers.engine.coldstart.warmup import warm
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.variants.fast import FastCompile, FastEngine

class CpuFast(FastEngine):
    def kernels(self):
        return {**super().kernels(), "experts_implementation": "batched_mm"}

engine = CpuFast(FastCompile("inductor", cuda_graphs=False))
request = BuildRequest("tiny", engine, modes=("gundam",), max_new_tokens=8, device="cpu", max_crops=3)
report = build(request, progress=lambda line: print(line, file=sys.stderr))
found = {"outcome": report.outcome, "manifest": str(report.manifest),
         "warmup": dataclasses.asdict(report.warmup) if report.warmup else None}
if sys.argv[1] == "worker":
    session = DeepSeekOCRSession.from_local("tiny", device="cpu", engine=engine)
    found["warmup"] = dataclasses.asdict(warm(session, ["gundam"], max_new_tokens=8, max_crops=3))
counters = torch._dynamo.utils.counters
found.update(graphs=counters["stats"]["unique_graphs"], hits=counters["inductor"]["fxgraph_cache_hit"],
             misses=counters["inductor"]["fxgraph_cache_miss"])
print(json.dumps(found))
"""
GUNDAM_SHARES = [("LM prefill", "compiled", 2), ("decode step", "compiled", 1), ("global 1024 px", "compiled", 3),
                 ("tiles 640 px", "compiled", 3)]  # fmt: skip


def run_build(how: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", BUILD, how], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


def test_a_build_compiles_in_helpers_once_and_a_worker_then_loads_every_graph(tmp_path, subprocess_env):
    """`dsocr precompile` of a gundam plan with an empty cache (inductor on the CPU): its helpers, forked
    before the model is built, compile the decode step, the LM prefill's two kinds of layer, the global
    view (SAM's two kinds of block and CLIP) and the tiles (SAM's two, their batch dynamic, and CLIP over
    both view groups at once), while the build loads the model; its warm-up then compiles nothing (every
    graph it traces is in the cache). Built again: up to date, without loading anything. A worker's
    warm-up of the same plan then starts no helper and finds every graph."""
    cache = tmp_path / "cache"
    env = {**subprocess_env, "DSOCR_COMPILE_CACHE_DIR": str(cache)}
    built = run_build("build", env)
    assert built["outcome"] == "built" and "no artifacts for this plan here yet: compiling" in built["log"]
    warmup = built["warmup"]
    assert warmup["helpers"]["how"] == "forked" and warmup["helpers"]["failures"] == [], warmup["helpers"]
    assert sorted((r["share"], r["outcome"], r["graphs"]) for r in warmup["helpers"]["results"]) == GUNDAM_SHARES
    assert warmup["still_cold"] == [] and warmup["artifacts"].startswith("no artifacts: none built for this plan")
    assert (built["graphs"], built["hits"], built["misses"]) == (9, 9, 0)
    assert list(warmup["phases_ms"]) == ["prepare", "vision helpers", "vision", "prefill helper", "prefill",
                                         "decode helper", "pass 1", "pass 2"]  # fmt: skip
    assert sum(warmup["phases_ms"].values()) == pytest.approx(warmup["ms"])
    manifest = json.loads(Path(built["manifest"]).read_text())
    assert manifest["built_by"] == "dsocr precompile" and manifest["environment"]["gpu"] == "cpu"
    # The manifest, beside each share's lock and done file (and the build's lock).
    files = sorted(path.name for path in (cache / artifacts.MANIFESTS).rglob("*") if path.is_file())
    assert sum(name.endswith(".json") for name in files) == 1 and sum(name.endswith(".done") for name in files) == 4
    worker = run_build("worker", env)
    assert worker["outcome"] == "up to date" and worker["manifest"] == built["manifest"]
    warmup = worker["warmup"]
    assert warmup["helpers"] is None and warmup["helpers_skipped"] == f"prebuilt artifacts ({built['manifest']})"
    assert warmup["artifacts"].startswith("prebuilt artifacts (dsocr precompile, ") and warmup["still_cold"] == []
    assert (worker["graphs"], worker["hits"], worker["misses"]) == (9, 9, 0)
