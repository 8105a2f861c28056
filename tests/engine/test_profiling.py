"""A job under torch.profiler (engine/profiling.py) on the CPU: the stages as ranges, the decode sampled,
the trace and the kernels per stage, and a failed job that stops its profiler; a batched engine's sampled
steps, each under a profiler of its own."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from dsocr_workers.engine.batched import BatchedEngine, PageRequest
from dsocr_workers.engine.profiling import DecodeSample, JobProfiler, StepProfiler, StepSample
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.kernels import KernelSummary

PLAIN = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)


@pytest.fixture(scope="module")
def session() -> DeepSeekOCRSession:
    return DeepSeekOCRSession.from_local("tiny")


def profiled_job(session: DeepSeekOCRSession, tokens: int, sample: DecodeSample):
    page = Image.new("RGB", (640, 480), "white")
    prepared = session.prepare_job(page, mode="tiny")
    run = session.run_on_device(prepared.page, tokens, PLAIN, clock=prepared.clock,
                                profiler=JobProfiler(session.device, sample))  # fmt: skip
    return run.finish()


def test_a_profiled_job_has_its_stages_as_ranges_and_only_its_sampled_decode_steps(session):
    sample = DecodeSample(first=3, later=(10,), width=2)
    result = profiled_job(session, 16, sample)  # 15 decode steps: 0..14
    profile = result.profile
    assert profile is not None
    assert profile.summary.decode_steps == [0, 1, 2, 10, 11]

    trace = json.loads(gzip.decompress(profile.trace_gz))
    assert len(gzip.decompress(profile.trace_gz)) == profile.trace_bytes
    ranges = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("dsocr::")]
    for stage in ("setup", "prefill", "vision/sam", "vision/clip", "vision/projector", "lm_prefill", "first_token",
                  "decode", "readback"):  # fmt: skip
        assert f"dsocr::{stage}" in ranges
    steps = sorted(int(r.rsplit(" ", 1)[1]) for r in ranges if r.startswith("dsocr::decode step "))
    # The steps between the samples were not recorded: no range, and no operator of theirs.
    assert steps[:5] == [0, 1, 2, 10, 11] and all(s in (0, 1, 2, 10, 11, 15) for s in steps)

    summary = KernelSummary.from_json(json.loads(json.dumps(profile.summary.to_json())))
    assert summary == profile.summary and summary.activity == "cpu"
    stages = {s.stage: s for s in summary.stages}
    assert list(stages)[:3] == ["setup", "prefill", "vision/sam"] and "decode" in stages
    decode = stages["decode"]
    step_ms = result.timings.decode_step_ms
    # The decode's clock time is the sampled steps' own: its kernels fit inside it.
    assert decode.event_ms == pytest.approx(sum(step_ms[i] for i in summary.decode_steps))
    assert 0 < decode.kernel_ms <= decode.event_ms and decode.span_ms <= decode.event_ms
    assert any(k.name == "aten::mm" and k.calls >= 5 for k in decode.kernels)
    # Nested stages: the prefill holds the vision's and the LM prefill's operators.
    assert stages["prefill"].kernel_ms >= stages["vision/sam"].kernel_ms + stages["lm_prefill"].kernel_ms - 1e-6
    for stage in stages.values():
        assert stage.busy_ms <= stage.event_ms * 1.01 + 0.01, stage
        assert stage.crosscheck("cpu") != "FAIL (no kernel attributed)"


def test_a_job_that_fails_stops_its_profiler_and_the_next_one_can_be_profiled(session):
    page = session.prepare(Image.new("RGB", (640, 480), "white"), None, "tiny", 9)
    profiler = JobProfiler(session.device)

    def boom() -> None:  # where the farm waits for the job's claim: after the prefill, under the profiler
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        session.run_on_device(page, 8, PLAIN, profiler=profiler, before_decode=boom)
    assert torch.autograd.profiler._is_profiler_enabled is False  # noqa: SLF001 (torch's own flag)
    assert profiled_job(session, 4, DecodeSample()).profile is not None


# Whole prefills (a step a page), or split ones (pages joining while others decode: a sam and a join step).
@pytest.mark.parametrize(("split", "kinds"), [(False, {"prefill", "decode"}), (True, {"prefill", "sam", "join", "decode"})])
def test_a_batched_engine_runs_every_nth_step_of_each_kind_under_a_profiler_of_its_own(session, split, kinds):
    pages = [
        session.prepare(Image.new("RGB", (640 + 80 * i, 480), "white"), None, "tiny", 7) for i in range(6)
    ]
    engine = BatchedEngine.create(session, max_batch=3, max_prompt_tokens=max(p.prompt_tokens for p in pages),
                                  max_new_tokens=7, options=PLAIN, split_prefill=split)  # fmt: skip
    profiler = StepProfiler(session.device, StepSample(every=2))
    engine.profile_steps(profiler)
    # Budgets that end pages at other steps, and more pages in flight than slots, so that pages join
    # while more decode than wait (then they split).
    budgets = [3, 7, 4, 7, 5, 7]
    engine.run([PageRequest(str(i), page, budgets[i]) for i, page in enumerate(pages)], concurrency=4)
    assert not torch.autograd.profiler._is_profiler_enabled  # noqa: SLF001 (torch's own flag)
    assert {s.kind for s in engine.steps} == kinds
    by_kind = {kind: [s for s in engine.steps if s.kind == kind] for kind in kinds}
    assert sum(s.kind != "sam" for s in engine.steps if s.kind != "decode") == len(pages)
    assert len(by_kind["decode"]) >= 6
    for kind, steps in by_kind.items():
        sampled = {step.index: profiler.take(step.index) for step in steps}
        # The 2nd, 4th, ... of the kind, in launch order; the others ran with no profiler.
        assert [i for i, s in sampled.items() if s] == [s.index for s in steps[1::2]], kind
        for step in steps[1::2]:
            profile = sampled[step.index].collect(step.ms)
            assert sampled[step.index].collect(step.ms) is profile  # collected once
            (stage,) = profile.summary.stages
            assert stage.stage == f"batched/{kind}" and stage.event_ms == step.ms
            assert stage.kernel_ms > 0 and stage.busy_ms <= stage.event_ms * 1.01 + 0.01
            # SAM's linear layers add a bias (aten::addmm); the language model's have none.
            assert any(k.name in ("aten::mm", "aten::addmm") for k in stage.kernels), kind
            ranges = {e["name"] for e in json.loads(gzip.decompress(profile.trace_gz))["traceEvents"]
                      if e.get("name", "").startswith("dsocr::")}  # fmt: skip
            assert ranges == {f"dsocr::batched/{kind}"}
    assert profiler.take(by_kind["decode"][1].index) is None  # taken once
    assert [n for n in range(1, 10) if n in StepSample(3)] == [3, 6, 9]


def test_the_decode_sample_is_the_first_steps_and_a_few_at_later_positions():
    sample = DecodeSample()
    assert [s for s in range(5000) if s in sample] == [*range(8), 64, 65, 256, 257, 1024, 1025, 4096, 4097]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a replayed graph's kernels")
def test_a_replayed_cuda_graphs_kernels_count_for_the_range_that_replayed_it():
    from torch.profiler import ProfilerActivity, profile, record_function

    from dsocr_workers.engine.profiling import _device_work_by_launch

    x = torch.randn(512, 512, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        (x @ x).relu()  # warm the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        (x @ x).relu()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("dsocr::vision/sam"):
            graph.replay()
        (x + 1).sum()  # launched outside the range
        torch.cuda.synchronize()
    events = prof.events()
    (sam,) = [e for e in events if e.name == "dsocr::vision/sam" and e.device_type.name == "CPU"]
    inside = [k.name for at, k in _device_work_by_launch(events) if sam.time_range.start <= at <= sam.time_range.end]
    # The graph's two kernels (a GEMM and the ReLU), linked to cudaGraphLaunch rather than to an operator.
    assert len(inside) >= 2 and any("gemm" in n.lower() or "xmma" in n.lower() for n in inside), inside
    assert not any("reduce" in n for n in inside), inside  # the sum outside the range is not its


@pytest.mark.parametrize(
    ("event_ms", "kernel_ms", "span_ms", "verdict"),
    [
        (9.089, 8.537, 9.051, "explained: GPU idle between kernels"),  # a SAM stage's figures
        (13.528, 9.929, 11.167, "explained: GPU idle 3.6 ms (1.24 between kernels, 2.36 waiting on the host)"),
        (9.230, 0.018, 0.018, "FAIL"),  # SAM's replayed graph attributed to no stage: must not pass as idle
        (2.815, 1.064, 2.335, "FAIL"),  # setup: the page's copies wait on the host for most of it
        (4.0, 3.9, 3.95, "PASS"),
    ],
)
def test_the_gpu_crosscheck_explains_idle_time_only_while_the_kernels_fill_the_stage(event_ms, kernel_ms, span_ms,
                                                                                       verdict):  # fmt: skip
    from dsocr_workers.kernels import StageKernels

    stage = StageKernels("vision/sam", event_ms, kernel_ms, kernel_ms, span_ms)
    assert stage.crosscheck("cuda").startswith(verdict)


def test_a_profiled_job_prints_no_profiler_chatter(subprocess_env):
    """Kineto's stage lines ("USDT: ... profiler_start") stay out of a worker's log."""
    code = ("import torch; from dsocr_workers.engine.profiling import JobProfiler; p = JobProfiler(torch.device('cpu'));"
            " p.start(); torch.randn(64, 64) @ torch.randn(64, 64); p.stop()")
    env = {k: v for k, v in subprocess_env.items() if k != "KINETO_LOG_LEVEL"}
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "profiler_start" not in ran.stderr and "USDT" not in ran.stderr, ran.stderr


TOGGLED_JOB = """
import os, sys
import torch
from PIL import Image
from torch.profiler import profile

from dsocr_workers.engine.profiling import DecodeSample, JobProfiler
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession

toggle = profile.toggle_collection_dynamic

def toggle_beside_another_line(self, enable, activities):  # a line of another thread's, meanwhile
    os.write(2, b"another line on stderr\\n")
    toggle(self, enable, activities)

profile.toggle_collection_dynamic = toggle_beside_another_line
session = DeepSeekOCRSession.from_local("tiny")
prepared = session.prepare_job(Image.new("RGB", (640, 480), "white"), mode="tiny")
run = session.run_on_device(prepared.page, 10, DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True),
                            clock=prepared.clock, profiler=JobProfiler(session.device, DecodeSample(2, (6,), 1)))
print(run.finish().profile.summary.decode_steps)
"""


def test_a_profiled_job_drops_the_toggle_warnings_and_keeps_every_other_line(subprocess_env):
    """c10 logs "Toggling CPU activity with GPU activity on ..." at each switch of the sampled decode's
    collection: none of it in a profiled CPU job's stderr, while what else was written there stays."""
    env = {k: v for k, v in subprocess_env.items() if k != "TORCH_CPP_LOG_LEVEL"}
    ran = subprocess.run([sys.executable, "-c", TOGGLED_JOB], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[-3:] == ["[0,", "1,", "6]"], ran.stdout  # collection went off and on again
    assert "Toggling" not in ran.stderr, ran.stderr
    assert ran.stderr.count("another line on stderr") == 4, ran.stderr  # off after 1, on at 6, off, on
