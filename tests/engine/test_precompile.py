"""The warm-up's vision compile helpers (engine/precompile.py): which view sizes they take, how they share
them, and that the worker then loads every graph they compiled (inductor on the CPU, the tiny preset)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest
import torch

from dsocr_workers.engine.precompile import (
    PROCESSES_ENV,
    HelpersLock,
    HelperTask,
    VisionHelpers,
    VisionShapes,
    helper_processes,
    share,
    vision_shapes,
    warm_marker,
)
from dsocr_workers.engine.result import ModelSource
from dsocr_workers.engine.session import DeepSeekOCRSession, FastCompile, engine_kernels, fast_modules
from dsocr_workers.errors import InputError
from dsocr_workers.model.checkpoint import build_preset
from dsocr_workers.model.config import PRESETS

ALL_MODES = ["gundam", "tiny", "small", "base", "large"]


def template(shapes: list[VisionShapes], source: str = "tiny", max_crops: int = 3) -> HelperTask:
    return HelperTask(source=source, device="cpu", dtype="float32", attn_implementation="sdpa", backend="inductor",
                      dynamic_tiles=True, max_crops=max_crops, shapes=tuple(shapes))  # fmt: skip


def test_every_view_size_is_compiled_once_and_shared_out_evenly():
    shapes = vision_shapes(ALL_MODES)
    # gundam's global view is base's: five sizes, not six.
    assert [s.label for s in shapes] == ["global 1024 px", "tiles 640 px", "global 512 px", "global 640 px",
                                         "global 1280 px"]  # fmt: skip
    groups = share(shapes, 4)
    assert sorted(s.label for group in groups for s in group) == sorted(s.label for s in shapes)
    assert [[s.label for s in group] for group in groups] == [
        ["tiles 640 px"], ["global 1280 px"], ["global 1024 px"], ["global 640 px", "global 512 px"]]  # fmt: skip
    assert len(share(shapes, 9)) == 5 and len(share(vision_shapes(["base"]), 4)) == 1


def test_the_helper_count_setting():
    assert helper_processes({}) == 4
    assert helper_processes({PROCESSES_ENV: "0"}) == 0
    with pytest.raises(InputError, match=f"{PROCESSES_ENV}='two'"):
        helper_processes({PROCESSES_ENV: "two"})


def test_the_marker_names_the_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    task = template(vision_shapes(["gundam"]))
    gundam = warm_marker(task, PRESETS["tiny"], ["gundam"])
    assert gundam.parent == tmp_path / "dsocr-warm"
    assert gundam == warm_marker(task, PRESETS["tiny"], ["gundam"])
    assert gundam != warm_marker(task, PRESETS["tiny"], ["gundam", "tiny"])
    assert gundam != warm_marker(task, PRESETS["full"], ["gundam"])
    bf16 = HelperTask(**{**task.__dict__, "dtype": "bfloat16"})
    assert gundam != warm_marker(bf16, PRESETS["tiny"], ["gundam"])


def inductor_session() -> DeepSeekOCRSession:
    """A fast session on the CPU with inductor (its compilations are what the cache holds); building it
    compiles nothing."""
    cpu, fp32 = torch.device("cpu"), torch.float32
    kernels = {**engine_kernels("fast"), "experts_implementation": "batched_mm"}
    with torch.inference_mode():
        loaded = build_preset("tiny", device=cpu, dtype=fp32, **kernels)
        fast_modules(loaded.model)
    source = ModelSource("preset", "tiny", random_weights=True, seed=0)
    return DeepSeekOCRSession(
        loaded, source, cpu, fp32, "fast", fast_compile=FastCompile("inductor", cuda_graphs=False)
    )


def test_a_warm_cache_or_no_processes_start_no_helper(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fast = inductor_session()
    monkeypatch.setenv(PROCESSES_ENV, "0")
    task, marker, why = fast._plan_vision_helpers(["tiny"], 3)
    assert task is None and marker is not None and why == f"{PROCESSES_ENV}=0"
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    monkeypatch.delenv(PROCESSES_ENV)
    task, _, why = fast._plan_vision_helpers(["tiny"], 3)
    assert task is None and why.startswith("the compile cache is warm for these modes")
    task, _, why = fast._plan_vision_helpers(["gundam"], 3)  # another configuration
    assert why == "" and task is not None
    assert [shape.label for shape in task.shapes] == ["global 1024 px", "tiles 640 px"]
    assert fast._plan_vision_helpers([], 3) == (None, None, "no mode to warm")
    eager = DeepSeekOCRSession.from_local("tiny")
    assert eager._plan_vision_helpers(["tiny"], 3) == (None, None, "nothing compiled by inductor")


def test_a_failed_helper_is_a_warning_with_its_reason(tmp_path, monkeypatch, subprocess_env, caplog):
    monkeypatch.setenv("PYTHONPATH", subprocess_env["PYTHONPATH"])
    task = template(vision_shapes(["tiny"]), source=str(tmp_path / "no-checkpoint"))
    with caplog.at_level(logging.WARNING):
        report = VisionHelpers.start(task, 2).wait()
    assert report.results == () and report.failures == ("global 512 px: exit code 1",)
    assert "no-checkpoint: not a checkpoint directory" in caplog.text


# A worker's warm-up, in a fresh process: `inductor_session()`'s session warming the modes given.
WORKER = """
import dataclasses, json, sys, torch
from dsocr_workers.engine.result import ModelSource
from dsocr_workers.engine.session import DeepSeekOCRSession, FastCompile, engine_kernels, fast_modules
from dsocr_workers.model.checkpoint import build_preset

cpu, fp32 = torch.device("cpu"), torch.float32
with torch.inference_mode():
    loaded = build_preset("tiny", device=cpu, dtype=fp32, **{**engine_kernels("fast"), "experts_implementation": "batched_mm"})
    fast_modules(loaded.model)
fast = DeepSeekOCRSession(loaded, ModelSource("preset", "tiny", random_weights=True, seed=0), cpu, fp32, "fast",
                          fast_compile=FastCompile("inductor", cuda_graphs=False))
report = fast.warmup(sys.argv[1].split(","), max_new_tokens=8, max_crops=3)
counters = torch._dynamo.utils.counters
print(json.dumps({"report": dataclasses.asdict(report), "graphs": counters["stats"]["unique_graphs"],
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def test_the_worker_loads_every_graph_its_helpers_compiled(tmp_path, subprocess_env):
    """A fast warm-up of gundam with an empty cache (inductor on the CPU): two helpers compile its view
    sizes — the global view (SAM's two kinds of block and CLIP) and the tiles (SAM's two, their batch
    dynamic) — while the worker compiles its language model (the LM's two kinds of layer and the decode
    step). Then the worker's passes (the global view alone, then strips of 2 and 3 tiles) find all five
    vision graphs in the cache, and compile only CLIP over both view groups at once, which no helper
    runs. The warm-up ends warm and leaves its marker."""
    cache = tmp_path / "cache"
    worker = subprocess.run([sys.executable, "-c", WORKER, "gundam"], capture_output=True, text=True, timeout=900,
                            env={**subprocess_env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})  # fmt: skip
    assert worker.returncode == 0, worker.stderr[-3000:]
    found = json.loads(worker.stdout.strip().splitlines()[-1])
    report = found["report"]
    assert report["precompile"]["failures"] == [] and report["still_cold"] == []
    assert sorted((r["shapes"], r["graphs"], r["cache_hits"]) for r in report["precompile"]["results"]) == [
        (["global 1024 px"], 3, 0), (["tiles 640 px"], 2, 0)]  # fmt: skip
    assert (found["graphs"], found["hits"], found["misses"]) == (9, 5, 4)
    assert list(report["phases_ms"]) == ["prepare", "language", "helpers", "pass 1", "pass 2"]
    assert sum(report["phases_ms"].values()) == pytest.approx(report["ms"])
    # The marker, and the lock its helpers were started under (HelpersLock), free now.
    marker, lock = sorted((cache / "dsocr-warm").iterdir(), key=lambda path: path.suffix)
    assert lock == HelpersLock.path(marker) and HelpersLock.wait(marker, timeout_s=0)


# A worker killed during its warm-up: it starts helpers on every view size, then dies without waiting.
DYING_WORKER = """
import os
from dsocr_workers.engine.precompile import HelperTask, VisionHelpers, vision_shapes

task = HelperTask(source="tiny", device="cpu", dtype="float32", attn_implementation="sdpa", backend="inductor",
                  dynamic_tiles=True, max_crops=9, shapes=tuple(vision_shapes(["gundam", "tiny", "small", "base", "large"])))
helpers = VisionHelpers.start(task, 2)
print(" ".join(str(helper.process.pid) for helper in helpers._running), flush=True)
os._exit(0)
"""


def running(pid: int) -> bool:
    """Not gone and not a zombie (an orphan's zombie waits for whoever adopts it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_helpers_do_not_outlive_the_worker_that_started_them(tmp_path, subprocess_env):
    """Their graphs take minutes here (every view size of every mode, inductor on this CPU): alive, they
    would still be compiling at the deadline."""
    worker = subprocess.run([sys.executable, "-c", DYING_WORKER], capture_output=True, text=True, timeout=300,
                            env={**subprocess_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})  # fmt: skip
    assert worker.returncode == 0, worker.stderr[-3000:]
    helpers = [int(pid) for pid in worker.stdout.split()]
    assert len(helpers) == 2
    deadline = time.monotonic() + 60
    while any(running(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(running(pid) for pid in helpers)


def test_the_helpers_lock_is_held_once_and_freed_by_release_or_death(tmp_path, subprocess_env):
    marker = tmp_path / "dsocr-warm" / "configuration"
    first = HelpersLock.take(marker)
    assert first is not None and HelpersLock.take(marker) is None
    assert not HelpersLock.wait(marker, timeout_s=0.5)
    threading.Timer(1.0, first.release).start()
    began = time.monotonic()
    assert HelpersLock.wait(marker, timeout_s=30) and time.monotonic() - began >= 0.9
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from dsocr_workers.engine.precompile import "
         "HelpersLock; lock = HelpersLock.take(Path(sys.argv[1])); print(lock is not None, flush=True); time.sleep(600)", str(marker)],
        stdout=subprocess.PIPE, text=True, env=subprocess_env,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        assert HelpersLock.take(marker) is None
    finally:
        holder.kill()
        holder.wait()
    assert HelpersLock.wait(marker, timeout_s=10)  # the kernel freed a dead holder's lock


def test_a_second_worker_waits_for_the_first_ones_helpers(tmp_path, monkeypatch, subprocess_env):
    """Two processes warming one configuration at once (a worker's other GPUs): the one that finds the
    helpers' lock held starts no helper, compiles its language model, then waits for the lock."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    _, marker, _ = inductor_session()._plan_vision_helpers(["tiny"], 3)
    assert marker is not None
    first = HelpersLock.take(marker)  # the first worker's, whose helpers are compiling
    assert first is not None
    script = "import logging; logging.basicConfig(level=logging.INFO)\n" + WORKER
    worker = subprocess.Popen([sys.executable, "-c", script, "tiny"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**subprocess_env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})  # fmt: skip
    try:
        assert worker.stderr is not None
        seen = []
        for line in worker.stderr:  # until it has seen the lock held
            seen.append(line)
            if "another process's helpers compile these graphs" in line:
                break
        else:
            raise AssertionError("".join(seen)[-3000:])
        first.release()  # the first worker's helpers are done
        out, err = worker.communicate(timeout=900)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])["report"]
    assert report["precompile"] is None and report["still_cold"] == []
    assert report["precompile_skipped"].startswith("another process's helpers compile these graphs")
    assert list(report["phases_ms"])[:3] == ["prepare", "language", "helpers"]
