"""The build step and its artifacts (engine/coldstart/build.py, artifacts.py, aoti.py): a manifest keyed by
all that changes compiled code, refused with its reason when built elsewhere; `dsocr precompile` builds a
plan's AOTInductor packages once (on the CPU, the tiny preset), the batched engine's step for its
concurrency included, says "up to date" after, and a worker's warm-up and batched engine's start in a
fresh process then load them, compile nothing and decode the tokens the compiled path decodes. One
process of a host compiles a plan at a time (`artifacts.host_lock`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
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
from dsocr_workers.engine.variants.fast import FastEngine
from dsocr_workers.model.deepseek_ocr.config import PRESETS

ENGINE = FastEngine()
KERNELS = {**ENGINE.kernels(), "experts_implementation": "batched_mm"}  # no Triton on a CPU
H100 = "NVIDIA H100 80GB HBM3 (sm_90)"
H200 = "NVIDIA H200 (sm_90)"


def plan(modes: tuple[str, ...] = ("tiny",)) -> CompilePlan:
    made = compile_plan("tiny", torch.device("cuda", 0), torch.bfloat16, KERNELS, ENGINE.compiled(), modes, 8, None, 3,
                        engine="fast", family="deepseek-ocr")  # fmt: skip
    assert made is not None
    return made


def test_the_plan_key_holds_all_that_changes_compiled_code():
    key = artifacts.plan_key(plan(), PRESETS["tiny"])
    assert key == artifacts.plan_key(plan(), PRESETS["tiny"])
    assert key != artifacts.plan_key(plan(), PRESETS["full"])
    for changed in ({"modes": ("gundam", "tiny")}, {"dtype": "float16"}, {"max_new_tokens": 9},
                    {"options": DecodeOptions(no_repeat_ngram_size=0)}, {"engine": "other"},
                    {"dynamic_tiles": False}, {"device": "cuda:1"}, {"concurrency": 128}):  # fmt: skip
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
    package = artifacts.Artifact("aoti-package", str(tmp_path / "decode_step.pt2"), '{"region": "decode_step"}')
    written = artifacts.manifest_path(plan(), config, on_h200)
    artifacts.write(artifacts.manifest(plan(), config, (package,), 12.3, on_h200), written)
    assert written.parent.parent == tmp_path / artifacts.MANIFESTS
    found = artifacts.lookup(plan(), config, on_h200)
    assert found.manifest is not None and found.path == written and found.manifest.kinds() == {"aoti-package"}
    assert found.manifest.packages() == {'{"region": "decode_step"}': tmp_path / "decode_step.pt2"}
    assert found.manifest.compiler.split(":")[0] in ("c++", *filter(None, [os.environ.get("CXX")]))
    assert found.summary.startswith(f"prebuilt artifacts (dsocr precompile, {found.manifest.built_at}): ")
    assert artifacts.lookup(plan(), config, on_h100).reason == f"artifacts refused (built for {H200}, this is {H100})"
    newer = replace(on_h200, torch="9.9.9", code="0123")
    assert artifacts.lookup(plan(), config, newer).reason == (
        f"artifacts refused (torch {on_h200.torch} vs 9.9.9; built by other code of this package (its sources changed))")
    assert artifacts.lookup(plan(("gundam",)), config, on_h200).reason.startswith("none built for this plan")
    batched = replace(plan(), concurrency=128)
    assert artifacts.lookup(batched, config, on_h200).reason.endswith("modes tiny, 8 tokens, concurrency 128)")
    # Before CUDA is up (the build, before it loads anything): listed if all but the GPU match.
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


def test_a_partial_package_of_a_killed_build_is_removed_and_a_live_builders_is_kept(tmp_path):
    """A build killed mid-package leaves `.<name>.<pid>.pt2`: the next build removes it, never a live
    builder's partial nor a finished package."""
    from dsocr_workers.engine.coldstart.aoti import remove_partial_packages

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = tmp_path / f".lm_prefill-0123456789ab.{ended.pid}.pt2"
    live = tmp_path / f".sam-0123456789ab.{os.getpid()}.pt2"
    finished = tmp_path / "lm_prefill-0123456789ab.pt2"
    for path in (dead, live, finished):
        path.write_bytes(b"package")
    assert remove_partial_packages(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and finished.exists()
    assert remove_partial_packages(tmp_path / "not built yet") == []


def test_packages_that_do_not_load_are_named_with_the_reason_and_those_after_them_too(tmp_path):
    """The build opens its packages in a child process before its own check (a loader that crashes kills
    the child, not the build): the first that fails, and those after it, unchecked, are named, with why."""
    from dsocr_workers.engine.coldstart.aoti import check_packages_load

    first, second = tmp_path / "lm_layer-0123456789ab.pt2", tmp_path / "sam_block-0123456789ab.pt2"
    first.write_bytes(b"not a zip archive")
    second.write_bytes(b"")
    check = check_packages_load([first, second], torch.device("cpu"))
    assert check.not_loaded == (first, second)
    assert "Error" in check.reason or "killed by" in check.reason, check.reason

# `dsocr precompile` as a CPU build runs it (argv[1] "build"), or a worker's start after it ("worker"): the fast
# engine without CUDA graphs and with transformers' expert GEMMs (no Triton here); the worker also decodes
# a page with the packages and with the regions run by their eager kernels (dynamo's aot_eager: inductor
# compiling them again took ~50 s of the CI's CPUs and held the packages to inductor itself), and looks
# the plan up as a worker built for another torch would ("refused": run after the manifest was edited).
BUILD = """
import dataclasses, json, sys, torch
from PIL import Image
from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.build import BuildRequest, build
from dsocr_workers.engine.coldstart.cache import use_compile_cache
from dsocr_workers.engine.batched import PageRequest
from dsocr_workers.engine.coldstart.warmup import session_plan, start_batched, warm
from dsocr_workers.engine.regions import TorchCompiler
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.variants.fast import FastEngine

class CpuFast(FastEngine):
    router_kernel = False

    def kernels(self):
        return {**super().kernels(), "experts_implementation": "batched_mm"}

engine = CpuFast()
concurrency = 1 if sys.argv[1] == "build1" else 2
request = BuildRequest("tiny", engine, modes=("tiny",), max_new_tokens=8, device="cpu", max_crops=3,
                       concurrency=concurrency, batched_compiled=concurrency > 1)
found = {}
if sys.argv[1] == "refused":
    use_compile_cache()  # as the CLI does before a worker starts
    session = DeepSeekOCRSession.from_local("tiny", device="cpu", engine=engine)
    plan = session_plan(session, ["tiny"], 8, None, 3, concurrency=2)
    print(json.dumps({"summary": artifacts.lookup(plan, session.loaded.config).summary}))
    sys.exit(0)
report = build(request, progress=lambda line: print(line, file=sys.stderr))
found = {"outcome": report.outcome, "manifest": str(report.manifest), "packages": sorted(report.packages),
         "checked": [dataclasses.asdict(started) for started in report.batched]}
if sys.argv[1] == "worker":
    session = DeepSeekOCRSession.from_local("tiny", device="cpu", engine=engine)
    # Warmed batch-1 (no concurrency told): the batched start opens its plan's packages then.
    found["warmup"] = dataclasses.asdict(warm(session, ["tiny"], max_new_tokens=8, max_crops=3))
    page, options = Image.new("RGB", (512, 512), "white"), DecodeOptions(ignore_eos=True)
    batched, started = start_batched(session, 2, "tiny", 8, options, max_crops=3, compiled=True)
    found["batched_start"] = dataclasses.asdict(started)
    found["dynamo"] = "torch._dynamo.utils" in sys.modules and torch._dynamo.utils.counters["stats"]["unique_graphs"]
    found["tokens"] = session.run_inference(page, mode="tiny", max_new_tokens=16, infer=options).token_ids
    prepared = session.prepare(page, None, "tiny", 3)
    outputs = batched.run([PageRequest(str(n), prepared, 8) for n in range(3)], 2)  # buckets 2, then 1
    found["batched_tokens"] = [output.token_ids for output in outputs]
    session.use_compiler(TorchCompiler("aot_eager"))
    found["eager_tokens"] = session.run_inference(page, mode="tiny", max_new_tokens=16, infer=options).token_ids
print(json.dumps(found))
"""
TINY_REGIONS = ["batched_step", "batched_step", "decode_step", "lm_layer", "lm_layer", "sam_block", "sam_block",
                "view_block"]  # fmt: skip


# The builds compile eight packages with inductor's C++ (~3 CPU-minutes); CI runs it beside other tests on 2 cores.
PROCESS_TIMEOUT_S = 900


def run_build(how: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", BUILD, how], capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


@pytest.mark.timeout(4 * PROCESS_TIMEOUT_S)  # its four processes, each under its own limit, not the suite's 600 s
def test_a_build_makes_packages_a_fresh_worker_loads_and_decodes_with_as_eager(tmp_path, subprocess_env):
    """`dsocr precompile` of a tiny-mode plan at concurrency 1, then at 2 (the CPU, inductor's C++): the
    warm-up's pages and the batched step's buckets recorded, one AOTInductor package per region kind and
    shape (SAM's two block kinds, CLIP's, the LM's dense and MoE layers, the decode step; then the batched
    step a package per bucket, the batch-1 plan's packages taken as they are), checked by the warm-up and
    the batched engine's start on them, then the manifest.
    Built again: up to date, nothing loaded. In a fresh process a worker's batch-1 warm-up loads the
    batch-1 packages and its batched start the batched plan's (dynamo compiles nothing); it decodes,
    alone and batched, the greedy tokens the regions' eager kernels decode. A manifest built by another
    torch is refused, saying so."""
    cache = tmp_path / "cache"
    env = {**subprocess_env, "DSOCR_COMPILE_CACHE_DIR": str(cache)}
    batch_1 = run_build("build1", env)
    assert sorted(name.split("-")[0] for name in batch_1["packages"]) == TINY_REGIONS[2:]
    built = run_build("build", env)
    assert built["outcome"] == "built" and "checked: the warm-up on the packages" in built["log"], built["log"][-2000:]
    # Only the batched step compiled: the batch-1 plan's six packages are its own.
    assert sorted(name.split("-")[0] for name in built["packages"]) == TINY_REGIONS[:2]
    assert built["log"].count("built already") == 6, built["log"][-2000:]
    assert built["manifest"] != batch_1["manifest"]
    manifest = json.loads(Path(built["manifest"]).read_text())
    assert manifest["built_by"] == "dsocr precompile" and manifest["environment"]["gpu"] == "cpu"
    assert sorted(a["kind"] for a in manifest["artifacts"] if a["kind"] == "aoti-package") == ["aoti-package"] * 8
    assert [(list(c["captures_ms"]), c["compiled"], c["packages_missed"]) for c in built["checked"]] == [(["1", "2"], 0, [])]
    worker = run_build("worker", env)
    assert worker["outcome"] == "up to date" and worker["manifest"] == built["manifest"]
    warmup = worker["warmup"]
    assert warmup["artifacts"].startswith("prebuilt artifacts (dsocr precompile, ") and warmup["still_cold"] == []
    assert (warmup["packages"], warmup["packages_missed"], worker["dynamo"], warmup["compiled"]) == (6, [], False, {})
    assert list(warmup["phases_ms"])[:2] == ["load packages", "pass 1"]
    started = worker["batched_start"]
    assert (list(started["captures_ms"]), started["compiled"], started["packages_missed"]) == (["1", "2"], 0, [])
    assert "concurrency 2, 2 slots" in started["engine"]
    assert worker["tokens"] == worker["eager_tokens"] and len(worker["tokens"]) == 16
    assert worker["batched_tokens"] == [worker["tokens"][:8]] * 3
    Path(built["manifest"]).write_text(json.dumps({**manifest, "environment": {**manifest["environment"], "torch": "0.0"}}))
    refused = run_build("refused", env)
    assert refused["summary"].startswith(f"no artifacts: artifacts refused (torch 0.0 vs {torch.__version__}")


def test_the_batched_steps_buckets_share_one_copy_of_the_slots_cache():
    """The build records the batched step once a bucket, each call with its state copied as it was: the
    slots' KV cache, the same tensors in every bucket (the filled attention reads every slot), is copied
    once (at 128 pages of 1,024 tokens a copy is about 19 GB: a copy a bucket ran an H200 out of memory);
    each bucket's rows, views of their own shape, get copies of their own."""
    from dsocr_workers.engine.batched.slots import SlotRows
    from dsocr_workers.engine.coldstart.aoti import Recorder

    slots, layers = 4, 2
    keys = [torch.zeros(slots, 2, 16, 8) for _ in range(layers)]
    values = [torch.zeros(slots, 2, 16, 8) for _ in range(layers)]
    tokens = torch.zeros(slots, 16, dtype=torch.int64)
    length, visible = torch.ones(slots, dtype=torch.int64), torch.ones(slots, dtype=torch.int64)
    model = torch.nn.Linear(2, 2, dtype=torch.bfloat16)  # the region's dtype is its module's
    recorder = Recorder()
    ran = []
    step = recorder.region("batched_step", lambda *args: ran.append(args[3].length.shape[0]))
    for n in (1, 2, 4):
        rows = SlotRows(tokens[:n], length[:n], length[:n], length[:n])
        step(model, keys, values, rows, DecodeOptions(), None, visible, {"SPLIT_KV": 2})
    calls = list(recorder.calls.values())
    assert ran == [1, 2, 4] and len(calls) == 3
    caches = [call.state[4 : 4 + 2 * layers] for call in calls]
    assert all(copy is first for cache in caches[1:] for copy, first in zip(cache, caches[0], strict=True))
    assert all(copy is not kept and torch.equal(copy, kept) for copy, kept in zip(caches[0], keys + values, strict=True))
    assert [call.state[0].shape[0] for call in calls] == [1, 2, 4]


# Holds the plan's host lock (as a build or a compiling worker does) until killed.
HOLDER = """
import sys, time, torch
from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.plan import compile_plan
from dsocr_workers.engine.variants.fast import FastEngine
from dsocr_workers.model.deepseek_ocr.config import PRESETS

engine = FastEngine()
kernels = {**engine.kernels(), "experts_implementation": "batched_mm"}
plan = compile_plan("tiny", torch.device("cuda", 0), torch.bfloat16, kernels, engine.compiled(), ("tiny",), 8, None, 3,
                    engine="fast", family="deepseek-ocr")
with artifacts.host_lock(plan, PRESETS["tiny"]) as held:
    print(held, flush=True)
    time.sleep(600)
"""


def test_one_process_of_a_host_compiles_a_plan_at_a_time(tmp_path, monkeypatch, subprocess_env):
    """A worker with nothing built compiles its plan in-process: while another process of the host (a build,
    another GPU's worker) compiles it, it waits, then goes on beside the other waiters, its compilations
    found in inductor's cache; a build waits its turn. The kernel frees the lock of a holder that dies
    (killed during its start): nothing is left waiting on it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    config, said, got = PRESETS["tiny"], [], {}
    released = threading.Event()

    def worker(name: str, shared_wait: bool) -> None:
        with artifacts.host_lock(plan(), config, said.append, shared_wait=shared_wait) as held:
            got[name] = (held, released.is_set())
            if name == "first waiter":
                time.sleep(0.5)  # the second waiter goes on meanwhile: both hold it shared

    with artifacts.host_lock(plan(), config) as held:
        assert held
        waiters = [threading.Thread(target=worker, args=(name, True)) for name in ("first waiter", "second waiter")]
        for thread in waiters:
            thread.start()
        time.sleep(1.0)
        assert all(thread.is_alive() for thread in waiters)
        released.set()
    for thread in waiters:
        thread.join(60)
    assert got == {"first waiter": (False, True), "second waiter": (False, True)}
    assert said == ["another process of this host compiles this plan: waiting for it"] * 2
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**subprocess_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        build = threading.Thread(target=worker, args=("build", False))
        build.start()
        time.sleep(1.0)
        assert build.is_alive()  # its turn comes when the holder's ends
    finally:
        holder.kill()
        holder.wait()
    build.join(60)
    assert got["build"] == (True, True)


def test_a_plan_names_its_family_and_a_deepseek_ocr_build_is_never_deepseek_ocr2_s(tmp_path, monkeypatch):
    """The plan key holds the model family (and its config): artifacts built for DeepSeek-OCR are not
    found for DeepSeek-OCR-2, which says none were built for its plan. `dsocr precompile --modes` takes the
    family's modes (exit 2 naming them), and an eager OCR-2 build compiles nothing."""
    from dsocr_workers.model.deepseek_ocr2.config import PRESETS as OCR2_PRESETS

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ocr2 = compile_plan("ocr2-tiny", torch.device("cuda", 0), torch.bfloat16, KERNELS, ENGINE.compiled(), ("gundam",),
                        8, None, 3, engine="fast", family="deepseek-ocr2")  # fmt: skip
    assert ocr2 is not None and (plan().family, ocr2.family) == ("deepseek-ocr", "deepseek-ocr2")
    v1_as_gundam = replace(plan(("gundam",)), max_crops=ocr2.max_crops)
    assert artifacts.plan_key(ocr2, OCR2_PRESETS["ocr2-tiny"]) != artifacts.plan_key(
        replace(v1_as_gundam, source="ocr2-tiny"), OCR2_PRESETS["ocr2-tiny"]
    )  # the family alone changes the key
    on_h200 = Environment.here(torch.device("cpu"), gpu=H200)
    package = artifacts.Artifact("aoti-package", str(tmp_path / "decode_step.pt2"), '{"region": "decode_step"}')
    v1 = artifacts.manifest(v1_as_gundam, PRESETS["tiny"], (package,), 1.0, on_h200)
    artifacts.write(v1, artifacts.manifest_path(v1_as_gundam, PRESETS["tiny"], on_h200))
    found = artifacts.lookup(ocr2, OCR2_PRESETS["ocr2-tiny"], on_h200)
    assert found.manifest is None and found.reason == (
        "none built for this plan (ocr2-tiny, fast engine, bfloat16, modes gundam, 8 tokens)"
    )
    env = {"DSOCR_COMPILE_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": None}
    precompile = ["precompile", "--model", "ocr2-tiny", "--gpus", "cpu", "--modes"]
    bad = CliRunner().invoke(main, [*precompile, "tiny"], env=env)  # a DeepSeek-OCR mode
    assert bad.exit_code == 2 and "modes of DeepSeek-OCR-2 (ocr2-tiny): gundam, base, small" in bad.output
    eager = CliRunner().invoke(main, [*precompile, "gundam"], env=env)
    assert eager.exit_code == 0 and eager.stdout.strip() == "nothing to compile: -", eager.output


def test_the_moe_prefill_layer_has_a_package_per_block_size_of_its_experts_kernels():
    """A package fixes the grouped experts kernels' blocks as it is traced: the MoE layer's packages are
    keyed by the blocks `blocks_for` gives the padded prompt, each exported over exactly the padded
    lengths that choose them (the `full` preset's 64 experts, 6 a token); the dense layer has one."""
    from dsocr_workers.engine.coldstart.aoti import Limits, _positions_dim, region_key
    from dsocr_workers.engine.regions import PREFILL_BUCKET
    from dsocr_workers.model.checkpoint import build_preset
    from dsocr_workers.model.grouped_experts import GROUPED_BLOCKS, blocks_for, tokens_for

    layers = build_preset("tiny", device="cpu", dtype=torch.float32).model.language_model.layers
    dense, moe = layers[0], layers[1]

    def key(layer: torch.nn.Module, padded: int) -> dict:
        return json.loads(region_key("lm_layer", (layer, torch.zeros(1, padded, 4)), torch.float32, True))

    text = moe.mlp.config
    pairs = {padded: key(moe, padded).get("expert_block_pairs") for padded in range(64, 1025, 64)}
    assert pairs == {p: blocks_for(p * text.num_experts_per_tok, text.n_routed_experts).gate_up.m for p in pairs}
    assert len(set(pairs.values())) == 3  # the tiny preset: 32 pairs at 64 positions, 64 at 128, 128 past
    assert {json.dumps(key(dense, padded)) for padded in (64, 1024)} == {json.dumps({"dtype": "float32", "kind": "DeepseekOcr2TextMLP", "region": "lm_layer"})}  # fmt: skip

    limits = Limits(max_crops=9, max_positions=8192)
    spans = []
    for blocks in GROUPED_BLOCKS:
        dim = _positions_dim(limits, tokens_for(blocks, top_k=6, num_experts=64))
        span = range(dim.min, dim.max + 1, PREFILL_BUCKET)
        assert {blocks_for(padded * 6, 64) for padded in span} == {blocks}
        spans += span
    assert spans == list(range(64, 8193, 64))  # every padded length in exactly one package
    assert _positions_dim(Limits(9, 64), tokens_for(GROUPED_BLOCKS[0], 6, 64)) is None  # one length: static


# A package's kernel launches name their constants (`'BLOCK_M': 32`) in its generated sources.
BLOCK_M = re.compile(r"""['"]?BLOCK_M['"]?\s*[:=]\s*(\d+)""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: AOTInductor packages of Triton kernels")
def test_cuda_moe_prefill_packages_hold_the_blocks_their_lengths_choose(tmp_path):
    """Prompts of three block sizes recorded (the tiny preset: 64, 128 and 192 padded positions take 32-,
    64- and 128-pair blocks): a package each for the MoE layer, compiled with those blocks only, and from
    the packages every length of each range prefills as the eager layers do, no length missed."""
    from dsocr_workers.engine import generate
    from dsocr_workers.engine.coldstart.aoti import (
        Limits,
        PackagedRegions,
        Recorder,
        build_package,
        check_packages_load,
        package_name,
    )
    from dsocr_workers.engine.regions import TorchCompiler
    from dsocr_workers.engine.session import DeepSeekOCRSession

    fast = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype="float32", engine="fast")
    model, hidden = fast.model, fast.model.config.text.hidden_size
    recorder = Recorder()
    fast.use_compiler(recorder)

    def prompt(length: int) -> torch.Tensor:
        return torch.randn(1, length, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(length))

    with torch.inference_mode():
        for length in (53, 81, 150):
            fast.runners.prefill(model, prompt(length), fast.buffers_for(1016).cache)
    moe = {key: call for key, call in recorder.calls.items() if "expert_block_pairs" in key}
    assert sorted(json.loads(key)["expert_block_pairs"] for key in moe) == [32, 64, 128]
    paths = {}
    for key, call in moe.items():
        paths[key] = build_package(call, Limits(3, fast.max_positions), True, tmp_path / package_name(key))
        with zipfile.ZipFile(paths[key]) as package:
            sources = [package.read(name).decode(errors="replace") for name in package.namelist()
                       if name.endswith((".cpp", ".py", ".json", ".h"))]  # fmt: skip
        found = {int(m) for text in sources if "grouped_gate_up_kernel" in text for m in BLOCK_M.findall(text)}
        assert found == {json.loads(key)["expert_block_pairs"]}, (key, found)
    del recorder, moe
    # Opened in a child first, as a build checks them: a wrapper built by a compiler whose packages do not
    # load (CXX) crashes its loader.
    assert check_packages_load(list(paths.values()), torch.device("cuda", 0)).not_loaded == ()
    packaged = PackagedRegions.load(paths, torch.device("cuda", 0), TorchCompiler("aot_eager"))
    fast.use_compiler(packaged)
    with torch.inference_mode():
        for length in (20, 64, 70, 128, 140, 192, 300):  # padded 64, 64, 128, 128, 192, 192, 320
            embeds = prompt(length)
            ours, reference = fast.buffers_for(1016), generate.DecodeBuffers.allocate(model, 1024, fast.device)
            logits = fast.runners.prefill(model, embeds, ours.cache)
            torch.testing.assert_close(logits, generate.prefill(model, embeds, reference.cache), rtol=1e-4, atol=1e-4)
    # The dense layer ran through dynamo (no package built for it here); every MoE length had its package.
    assert [json.loads(key)["kind"] for key in packaged.missed] == ["FusedGateUpMLP"], packaged.missed
