"""The warm-up's compile helpers (engine/coldstart/helpers.py, helper_process.py): how a plan is shared
out, when helpers start, that a share is compiled once per host, and that no helper outlives its worker.
That a worker then loads every graph its helpers compiled is the build's test
(tests/engine/test_coldstart_build.py: `dsocr precompile` forks them and runs the worker's warm-up)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch

from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.helper_process import compile_share
from dsocr_workers.engine.coldstart.helpers import CompileHelpers
from dsocr_workers.engine.coldstart.plan import (
    PROCESSES_ENV,
    CompilePlan,
    CompileShare,
    HelperTask,
    ShareLock,
    compile_plan,
    helper_processes,
    share,
    vision_shapes,
)
from dsocr_workers.engine.coldstart.warmup import plan_helpers
from dsocr_workers.engine.result import DecodeOptions, ModelSource
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.variants.fast import FastEngine
from dsocr_workers.errors import InputError
from dsocr_workers.model.checkpoint import build_preset
from dsocr_workers.model.deepseek_ocr.config import PRESETS
from dsocr_workers.model.families import FAMILIES

ALL_MODES = ["gundam", "tiny", "small", "base", "large"]
CPU_ENGINE = FastEngine()
CPU_KERNELS = {**CPU_ENGINE.kernels(), "experts_implementation": "batched_mm"}  # no Triton on a CPU


def cpu_plan(modes: list[str], source: str = "tiny", max_crops: int = 3) -> CompilePlan:
    """The plan `inductor_session()` makes for a warm-up of `modes` (8 tokens, the vendor's options)."""
    plan = compile_plan(source, torch.device("cpu"), torch.float32, CPU_KERNELS, CPU_ENGINE.compiled(), modes, 8,
                        None, max_crops, engine="fast")  # fmt: skip
    assert plan is not None
    return plan


def test_every_view_size_is_compiled_once_and_shared_out_evenly():
    shapes = vision_shapes(FAMILIES["deepseek-ocr"], ALL_MODES)
    # gundam's global view is base's: five sizes, not six.
    assert [s.label for s in shapes] == ["global 1024 px", "tiles 640 px", "global 512 px", "global 640 px",
                                         "global 1280 px"]  # fmt: skip
    groups = share(shapes, 4)
    assert sorted(s.label for group in groups for s in group) == sorted(s.label for s in shapes)
    assert [[s.label for s in group] for group in groups] == [
        ["tiles 640 px"], ["global 1280 px"], ["global 1024 px"], ["global 640 px", "global 512 px"]]  # fmt: skip
    assert len(share(shapes, 9)) == 5 and len(share(vision_shapes(FAMILIES["deepseek-ocr"], ["base"]), 4)) == 1
    # The language model's two shares first: the decode step takes longest.
    assert [s.label for s in cpu_plan(ALL_MODES).shares(4)] == [
        "decode step", "LM prefill", "tiles 640 px", "global 1280 px", "global 1024 px", "global 640 px, global 512 px"]  # fmt: skip


def test_the_helper_count_setting():
    assert helper_processes({}) == 4
    assert helper_processes({PROCESSES_ENV: "0"}) == 0
    with pytest.raises(InputError, match=f"{PROCESSES_ENV}='two'"):
        helper_processes({PROCESSES_ENV: "two"})


def test_a_plan_survives_its_json():
    plan = cpu_plan(["gundam"])
    task = HelperTask(plan, plan.shares(2)[-1])
    assert HelperTask.from_json(task.to_json()) == task
    windowed = CompilePlan(**{**plan.__dict__, "options": DecodeOptions(ngram_window=90, ngram_whitelist=(1, 2))})
    assert HelperTask.from_json(HelperTask(windowed, task.share).to_json()).plan == windowed


def inductor_session() -> DeepSeekOCRSession:
    """A fast session on the CPU with inductor (its compilations are what the cache holds); building it
    compiles nothing."""
    cpu, fp32 = torch.device("cpu"), torch.float32
    with torch.inference_mode():
        loaded = build_preset("tiny", device=cpu, dtype=fp32, **CPU_KERNELS)
        CPU_ENGINE.after_load(loaded.model)
    return DeepSeekOCRSession(loaded, ModelSource("preset", "tiny", random_weights=True, seed=0), cpu, fp32, CPU_ENGINE)


def write_manifest(plan: CompilePlan) -> None:
    """A manifest for `plan` in this environment, as `dsocr precompile` leaves one (its packages aside)."""
    here = artifacts.Environment.here(torch.device(plan.device))
    artifacts.write(artifacts.manifest(plan, PRESETS["tiny"], (), 0.0, here), artifacts.manifest_path(plan, PRESETS["tiny"], here))


def test_a_warm_cache_or_no_processes_start_no_helper(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fast = inductor_session()
    monkeypatch.setenv(PROCESSES_ENV, "0")
    plan, found, why = plan_helpers(fast, ["tiny"], 8, 3, None)
    assert plan == cpu_plan(["tiny"]) and found is not None and why == f"{PROCESSES_ENV}=0"
    assert found.summary.startswith("no artifacts: none built for this plan (tiny, fast engine, float32, modes tiny")
    write_manifest(plan)
    monkeypatch.delenv(PROCESSES_ENV)
    _, found, why = plan_helpers(fast, ["tiny"], 8, 3, None)
    assert why == f"prebuilt artifacts ({found.path})" and found.manifest is not None
    plan, _, why = plan_helpers(fast, ["gundam"], 8, 3, None)  # another plan
    assert why == "" and plan == cpu_plan(["gundam"])
    assert plan_helpers(fast, [], 8, 3, None) == (None, None, "no mode to warm")
    eager = DeepSeekOCRSession.from_local("tiny", engine="eager")
    assert plan_helpers(eager, ["tiny"], 8, 3, None) == (None, None, "nothing compiled by inductor")


def test_a_failed_helper_is_a_warning_with_its_reason(tmp_path, monkeypatch, subprocess_env, caplog):
    monkeypatch.setenv("PYTHONPATH", subprocess_env["PYTHONPATH"])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    plan = cpu_plan(["tiny"], source=str(tmp_path / "no-checkpoint"))
    with caplog.at_level(logging.WARNING):
        report = CompileHelpers.start(plan, 2).wait()
    assert report.results == () and report.how == "spawned"
    assert report.failures == ("decode step: exit code 1", "LM prefill: exit code 1", "global 512 px: exit code 1")
    assert "no-checkpoint: not a checkpoint directory" in caplog.text


# A worker killed during its warm-up: it starts its helpers, then dies without waiting.
DYING_WORKER = """
import os, sys, torch
from dsocr_workers.engine.coldstart.helpers import CompileHelpers
from dsocr_workers.engine.coldstart.plan import compile_plan
from dsocr_workers.engine.variants.fast import FastEngine

engine = FastEngine()
kernels = {**engine.kernels(), "experts_implementation": "batched_mm"}
plan = compile_plan("tiny", torch.device("cpu"), torch.float32, kernels, engine.compiled(),
                    ["gundam", "tiny", "small", "base", "large"], 8, None, 9, engine="fast")
helpers = CompileHelpers.start(plan, 2, fork=sys.argv[1] == "fork")
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
@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_helpers_do_not_outlive_the_worker_that_started_them(how, tmp_path, subprocess_env):
    """Their graphs take minutes here (every view size of every mode, inductor on this CPU): alive, they
    would still be compiling at the deadline."""
    worker = subprocess.run([sys.executable, "-c", DYING_WORKER, how], capture_output=True, text=True, timeout=300,
                            env={**subprocess_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})  # fmt: skip
    assert worker.returncode == 0, worker.stderr[-3000:]
    helpers = [int(pid) for pid in worker.stdout.split()]
    assert len(helpers) == 4  # the decode step, the LM prefill, two vision shares
    deadline = time.monotonic() + 60
    while any(running(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(running(pid) for pid in helpers)


def test_a_share_lock_is_held_once_and_freed_by_release_or_death(tmp_path, subprocess_env):
    path = tmp_path / "dsocr-warm" / "plan.share.lock"
    first = ShareLock.take(path)
    assert first is not None and ShareLock.take(path) is None
    assert ShareLock.hold(path, timeout_s=0.5) is None
    threading.Timer(1.0, first.release).start()
    began = time.monotonic()
    second = ShareLock.hold(path, timeout_s=30)
    assert second is not None and time.monotonic() - began >= 0.9
    second.release()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from dsocr_workers.engine.coldstart.plan "
         "import ShareLock; lock = ShareLock.take(Path(sys.argv[1])); print(lock is not None, flush=True); time.sleep(600)", str(path)],
        stdout=subprocess.PIPE, text=True, env=subprocess_env,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        assert ShareLock.take(path) is None
    finally:
        holder.kill()
        holder.wait()
    third = ShareLock.hold(path, timeout_s=10)  # the kernel freed a dead holder's lock
    assert third is not None
    third.release()


def test_a_share_another_process_compiles_is_waited_for_not_compiled_again(tmp_path, monkeypatch):
    """A worker's other GPU forks helpers for the same plan: each waits for the lock of its share, held
    by the first worker's helper, then takes that helper's done file as its answer; the plan's manifest
    answers at once."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    plan = cpu_plan(["tiny"])
    task = HelperTask(plan, CompileShare("decode"))
    lock_path, done = ShareLock.paths(artifacts.lookup(plan, PRESETS["tiny"]).path, task.share)
    held = ShareLock.take(lock_path)  # the first worker's helper, compiling
    assert held is not None

    def first_helper_done() -> None:
        done.touch()
        held.release()

    threading.Timer(1.0, first_helper_done).start()
    began = time.monotonic()
    result = compile_share(task)
    assert (result.outcome, result.graphs) == ("shared", 0) and time.monotonic() - began >= 0.9
    write_manifest(plan)
    assert compile_share(HelperTask(plan, CompileShare("prefill"))).outcome == "warm"


def test_a_load_that_fails_stops_the_helpers_started_for_it(database, tmp_path, monkeypatch, subprocess_env):
    """A worker child forks its helpers before it loads its model (farm/job/opening.py fork_compile_helpers):
    when the load fails, none of them is left compiling for a warm-up that will not happen (here they
    would compile every mode for minutes)."""
    from dsocr_workers.farm.job.process import JobProcess
    from dsocr_workers.farm.job.warm import Warmup
    from dsocr_workers.farm.run_options import ModelKey
    from dsocr_workers.settings import Settings

    monkeypatch.setenv("PYTHONPATH", subprocess_env["PYTHONPATH"])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    helpers = CompileHelpers.start(cpu_plan(ALL_MODES, max_crops=9), 2)
    pids = [helper.process.pid for helper in helpers._running]
    assert len(pids) == 4 and all(running(pid) for pid in pids)
    settings = Settings(database_url=database.engine.url.render_as_string(hide_password=False), queue="q")
    process = JobProcess.open(settings, "cpu", queues=("q",))
    try:
        with pytest.raises(InputError, match="not a checkpoint directory"):
            process.models.warm(Warmup(ModelKey(str(tmp_path / "missing"), "fast"), ("tiny",)), helpers)
    finally:
        process.close()
    assert not any(running(pid) for pid in pids)
