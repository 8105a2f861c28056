"""The split prefill/decode engine on the tiny preset (CPU): result contract, stop rules, checks."""

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from PIL import Image, ImageDraw

from dsocr_workers.engine import generate
from dsocr_workers.engine.clock import StageClock
from dsocr_workers.engine.coldstart.warmup import warm
from dsocr_workers.engine.regions import capture_graph, dynamo_graphs
from dsocr_workers.engine.result import DecodeOptions, ModelSource
from dsocr_workers.engine.session import DeepSeekOCRSession, force_eos_at
from dsocr_workers.engine.variants.fast import FastCompile, FastEngine
from dsocr_workers.engine.verify import run_checks, teacher_forced_agreement
from dsocr_workers.errors import InputError
from dsocr_workers.model.checkpoint import save_preset
from dsocr_workers.model.config import EOS_TOKEN_ID
from dsocr_workers.model.decoder import CACHE_ARGUMENT
from dsocr_workers.model.deepseek_ocr.config import PRESETS
from tests.engine.test_clock import small_host_gap


def page(width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for row in range(height // 60):
        draw.text((40, 20 + row * 60), f"Row {row}: the quick brown fox", fill="black")
    return image


@pytest.fixture(scope="module")
def session() -> DeepSeekOCRSession:
    return DeepSeekOCRSession.from_local("tiny")


def test_a_preset_saved_as_a_checkpoint_is_still_labelled_random_weights(tmp_path):
    directory = save_preset("tiny", tmp_path / "tiny", seed=5)
    source = DeepSeekOCRSession.from_local(directory).source
    assert (source.kind, source.random_weights, source.seed) == ("checkpoint", True, 5)
    assert source.label == f"checkpoint:{directory.resolve()} (RANDOM WEIGHTS, seed 5)"


def test_gundam_page_result_contract(session):
    result = session.run_inference(page(1600, 2000), max_new_tokens=12, job_id="7")
    assert result.crop_grid == (2, 3)
    assert result.image_tokens == 903
    assert result.prompt_tokens > result.image_tokens
    assert len(result.token_ids) == 12 and result.stop_reason == "max_new_tokens"
    assert result.kv_length == result.prompt_tokens + 11  # the last token is never fed back
    assert result.vision_calls == 1
    assert result.model.random_weights and "RANDOM WEIGHTS" in result.model.label
    t = result.timings
    assert t.clock == "perf_counter"
    assert len(t.decode_step_ms) == 11 and all(ms > 0 for ms in t.decode_step_ms)
    assert t.sam_ms > 0 and t.clip_ms > 0 and t.projector_ms > 0 and t.lm_prefill_ms > 0
    assert t.vision_ms == pytest.approx(t.sam_ms + t.clip_ms + t.projector_ms)
    assert t.vision_ms + t.lm_prefill_ms <= t.prefill_ms
    assert t.preprocess_ms + t.prefill_ms <= t.ttft_ms <= t.e2e_ms
    assert result.to_dict()["timings"]["decode_step_ms"] == t.decode_step_ms


@pytest.mark.parametrize(("mode", "tokens"), [("tiny", 73), ("small", 111), ("base", 273), ("large", 421)])
def test_modes_token_schedule(session, mode, tokens):
    result = session.run_inference(page(800, 600), mode=mode, max_new_tokens=2)
    assert result.image_tokens == tokens and result.crop_grid == (1, 1)


def test_checks_pass_on_a_correct_engine(session):
    checks = run_checks(session, page(1000, 800), max_new_tokens=16)
    assert [c.passed for c in checks] == [True] * 4, checks


def test_split_check_catches_an_off_by_one_position(session, monkeypatch):
    def off_by_one(model, cache, ban, options):
        position = ban.length.view(1, 1)  # one past the token's real position
        token = ban.tokens[(ban.length - 1).view(1)].view(1, 1)
        hidden = model.language_model(
            inputs_embeds=model.embed(token), position_ids=position, use_cache=True, **{CACHE_ARGUMENT: cache}
        ).last_hidden_state
        return generate.choose_token(model.logits(hidden[:, -1]), ban, options)

    monkeypatch.setattr(session, "runners", replace(session.runners, decode_step=off_by_one))
    checks = run_checks(session, page(1000, 800), max_new_tokens=24)
    assert not checks[0].passed and "first divergence" in checks[0].detail


def test_eos_stops_decoding_and_is_trimmed(session):
    bias = torch.zeros(session.model.config.text.vocab_size)
    bias[EOS_TOKEN_ID] = 1e4  # make EOS the certain choice from the first token on
    original = session.model.lm_head
    head = torch.nn.Linear(original.in_features, original.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(original.weight)
        head.bias.copy_(bias)
    session.model.lm_head = head
    try:
        result = session.run_inference(page(600, 480), max_new_tokens=50)
        forced = session.run_inference(page(600, 480), max_new_tokens=5, infer=DecodeOptions(ignore_eos=True))
    finally:
        session.model.lm_head = original
    assert result.token_ids == [EOS_TOKEN_ID] and result.stop_reason == "eos" and result.text == ""
    assert result.timings.decode_step_ms == []
    assert len(forced.token_ids) == 5 and forced.stop_reason == "max_new_tokens"


def test_cache_buckets_and_ceiling(session):
    # Decoding all the way to 8192 positions is too slow for CI (a 128-position preset reaches its
    # positions below); the bucket rule is what bounds it.
    assert session.max_positions == 8192
    assert generate.cache_bucket(9000, 8192) == 8192
    assert generate.cache_bucket(916 + 256, 8192) == 2048


def test_a_job_that_reaches_the_models_positions_stops_there(monkeypatch):
    # The tiny preset with 128 positions: a tiny-mode page's prompt (109) leaves room for 19 tokens.
    tiny = PRESETS["tiny"]
    monkeypatch.setitem(PRESETS, "tiny-128", replace(tiny, text=replace(tiny.text, max_position_embeddings=128)))
    short = DeepSeekOCRSession.from_local("tiny-128")
    capped = short.run_inference(page(600, 480), mode="tiny", max_new_tokens=1000)
    assert capped.prompt_tokens == 109 and capped.stop_reason == "max_positions"
    assert len(capped.token_ids) == 128 - 109 and EOS_TOKEN_ID not in capped.token_ids
    assert capped.kv_length == 127  # every position but the last token's, which is never fed back
    unbounded = short.run_inference(page(600, 480), mode="tiny")  # no budget: up to the positions
    assert unbounded.token_ids == capped.token_ids and unbounded.stop_reason == "max_positions"
    within = short.run_inference(page(600, 480), mode="tiny", max_new_tokens=18)
    assert within.token_ids == capped.token_ids[:18] and within.stop_reason == "max_new_tokens"
    with pytest.raises(InputError, match="the prompt takes 147 positions; the model has 128"):
        short.run_inference(page(600, 480), mode="small")


def test_a_job_reads_nothing_an_earlier_job_left_in_the_cache(session):
    """Setup resets no cache: a prefill fills it from slot 0, and no query reads a slot past its own
    position. A short job after a long one in the same bucket writes what it writes on a fresh session,
    bit for bit, over the long job's keys and values still lying past it."""
    options = DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)
    session.run_inference(page(1600, 2000), max_new_tokens=40, infer=options)  # ~950 positions of 1024
    short = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=24, infer=options)
    fresh = DeepSeekOCRSession.from_local("tiny")
    alone = fresh.run_inference(page(600, 480), mode="tiny", max_new_tokens=24, infer=options)
    assert short.token_ids == alone.token_ids
    length = short.kv_length
    layers = zip(session.buffers_for(length).cache.layers, fresh.buffers_for(length).cache.layers, strict=True)
    for used, clean in layers:
        assert torch.equal(used.keys[:, :, :length], clean.keys[:, :, :length])
        assert torch.equal(used.values[:, :, :length], clean.values[:, :, :length])
        assert int(used.cumulative_length) == length
        assert used.keys[:, :, length + 100].abs().sum() > 0 and clean.keys[:, :, length:].abs().sum() == 0


def test_a_page_prepared_ahead_runs_as_the_same_job(session):
    whole = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=6)
    # Where the farm's prefetch prepares it, on a thread of its own while another job runs.
    with ThreadPoolExecutor(1) as thread:
        prepared = thread.submit(session.prepare_job, page(600, 480), None, "tiny", "8").result()
    time.sleep(0.2)  # the page waits for its job
    ahead = session.run_on_device(prepared.page, max_new_tokens=6, clock=prepared.clock).finish()
    untimed = session.run_on_device(prepared.page, max_new_tokens=6).finish()
    assert ahead.token_ids == untimed.token_ids == whole.token_ids
    assert ahead.timings.preprocess_ms > 0 and untimed.timings.preprocess_ms == 0
    assert ("push", "preprocess") in prepared.clock.nvtx_log and prepared.clock.job_id == "8"
    # The wait is no part of the job: named, outside e2e (not in the host gap), and the parts add up. A page
    # run at once waits only for its thread to be scheduled (milliseconds on a loaded machine).
    assert ahead.timings.page_wait_ms >= 200 and whole.timings.page_wait_ms < ahead.timings.page_wait_ms - 100
    for t in (ahead.timings, untimed.timings, whole.timings):
        assert sum(t.parts_ms.values()) == pytest.approx(t.e2e_ms, abs=1e-6)
        # Far below the 200-ms wait, which it would hold had the wait leaked in (how small the gap is
        # otherwise, over a loaded machine's preemptions: tests/engine/test_clock.py `small_host_gap`).
        assert 0 <= t.host_gap_ms < 100
        assert t.ttft_ms == pytest.approx(t.preprocess_ms + t.ttft_from_device_start_ms)
    span = ahead.device_span
    assert span is not None and span.started_s < span.first_token_s < span.finished_s


def test_seeded_sampling_is_reproducible(session):
    options = DecodeOptions(temperature=1.0, top_p=0.9, top_k=50, seed=11)
    a = session.run_inference(page(600, 480), max_new_tokens=8, infer=options).token_ids
    b = session.run_inference(page(600, 480), max_new_tokens=8, infer=options).token_ids
    greedy = session.run_inference(page(600, 480), max_new_tokens=8).token_ids
    assert a == b and a != greedy


def test_no_repeat_ngram_is_applied(session):
    plain = session.run_inference(page(600, 480), max_new_tokens=40,
                                  infer=DecodeOptions(no_repeat_ngram_size=0, ignore_eos=True)).token_ids
    banned = session.run_inference(page(600, 480), max_new_tokens=40,
                                   infer=DecodeOptions(no_repeat_ngram_size=2, ignore_eos=True)).token_ids
    bigrams = list(zip(banned, banned[1:], strict=False))
    assert len(bigrams) == len(set(bigrams))
    assert plain != banned or len(set(zip(plain, plain[1:], strict=False))) == len(plain) - 1


def test_teacher_forced_agreement_with_itself_is_total(session):
    assert teacher_forced_agreement(session, session, page(600, 480), steps=8) == 1.0


# Each model family's tiny preset and its smallest mode.
TINY_MODES = {"tiny": "tiny", "ocr2-tiny": "small"}


@pytest.mark.parametrize("preset", list(TINY_MODES))
def test_fast_engine_on_cpu_says_so_and_runs_eager(preset):
    fast = DeepSeekOCRSession.from_local(preset, engine="fast")
    assert fast.engine_name == "eager" and "CUDA" in fast.engine_note
    job = fast.run_inference(page(600, 480), mode=TINY_MODES[preset], max_new_tokens=2)
    assert job.engine == "eager" and len(job.token_ids) == 2
    # Its family's view encoder timed, the other family's None (no such stage).
    own, other = ("qwen2_ms", "clip_ms") if preset == "ocr2-tiny" else ("clip_ms", "qwen2_ms")
    assert getattr(job.timings, own) > 0 and getattr(job.timings, other) is None


@pytest.mark.parametrize("preset", list(TINY_MODES))
def test_auto_engine_is_eager_on_a_cpu_without_a_note(preset):
    """A run's default: fast where the job meets a GPU, the eager reference on a CPU, as asked."""
    auto = DeepSeekOCRSession.from_local(preset, engine="auto")
    assert auto.engine_name == "eager" and auto.engine_note == ""


class CpuFast(FastEngine):
    """The fast engine's modules (SDPA attention, fused projections, folded SAM attention) and its compiled
    regions on the CPU. dynamo's aot_eager traces without generating code (inductor takes minutes over a
    whole model on a CPU). The routed experts are transformers' batched GEMMs and the router is
    transformers': the Triton kernels run on a CPU only in Triton's interpreter, which a compiled graph
    cannot trace (tests/model/test_fast_kernels.py checks them uncompiled here, compiled on a GPU)."""

    router_kernel = False

    def kernels(self) -> dict[str, str]:
        return {**super().kernels(), "experts_implementation": "batched_mm"}

    def compile_backend(self) -> str:
        return "aot_eager"


def fast_on_cpu(source: ModelSource, decode_only: bool = True) -> DeepSeekOCRSession:
    """`source`'s preset on the fast engine (`CpuFast`) in float32, its decode step compiled as the engine
    compiles it (one graph, fullgraph); with `decode_only` vision and prefill stay uncompiled."""
    engine = CpuFast(FastCompile(decode_only=decode_only))
    return DeepSeekOCRSession.from_local(
        source.name, device="cpu", dtype=torch.float32, engine=engine, seed=source.seed or 0, instrumented=True
    )


def test_fast_kernels_and_compiled_decode_follow_eager_on_cpu(session):
    assert session.dtype == torch.float32 and session.engine_name == "eager"
    fast = fast_on_cpu(session.source)
    options = DecodeOptions(ignore_eos=True)  # the vendor's n-gram ban stays on: it runs inside the step
    reference = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=16, infer=options)
    first = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=16, infer=options)
    # Greedy in float32: the fast kernels and the compiled step pick eager's tokens.
    assert first.token_ids == reference.token_ids
    assert first.engine == "fast" and "compiled 1 new graph(s)" in first.cold_reasons
    # Compiled once, then replayed: the next job, with other stop options, compiles nothing; EOS is
    # found at the next check and the output trimmed there, as on the eager engine.
    eos = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=16, after_step=force_eos_at(5))
    assert not eos.cold, eos.cold_reasons
    assert eos.token_ids == reference.token_ids[:5] + [EOS_TOKEN_ID] and eos.stop_reason == "eos"
    assert eos.wasted_steps == 3 and eos.kv_length == eos.prompt_tokens + 8


def test_the_warm_up_compiles_the_decode_step_the_jobs_will_run(session):
    """The compiled decode step is specialised on the n-gram ban: a warm-up with the vendor's ban left a
    run without it to compile on its first job. Warmed with the jobs' options, it
    meets nothing cold; a job with another ban still does, and says so."""
    fast = fast_on_cpu(session.source)
    # Bans no other test compiles: dynamo keeps a compiled step per code object, across sessions.
    jobs, other = DecodeOptions(no_repeat_ngram_size=7, ignore_eos=True), DecodeOptions(no_repeat_ngram_size=9)
    warm(fast, ["tiny"], max_new_tokens=8, infer=jobs)
    job = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=8, infer=jobs)
    assert not job.cold, job.cold_reasons
    unwarmed = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=8, infer=other)
    assert unwarmed.cold_reasons == ("compiled 1 new graph(s)",)


def test_one_compiled_decode_step_serves_every_cache_bucket(session):
    """A cache bucket is a new length for the cache and the token buffer: the second bucket a worker
    met used to compile the decode step again. The capacity is a
    symbol from the first compilation now; each bucket still decodes what eager decodes."""
    fast = fast_on_cpu(session.source)
    graphs = torch._dynamo.utils.counters["stats"]
    # A ban no other test compiles: dynamo keeps a compiled step per code object, across sessions.
    options, eos_at_6 = DecodeOptions(no_repeat_ngram_size=5), force_eos_at(6)
    first = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=8, infer=options, after_step=eos_at_6)
    assert "compiled 1 new graph(s)" in first.cold_reasons
    compiled = graphs["unique_graphs"]
    for max_new_tokens, capacity in ((1500, 2048), (3000, 4096), (6000, 8192)):
        job = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=max_new_tokens, infer=options,
                                 after_step=eos_at_6)
        assert job.cold_reasons == (f"first use of the {capacity}-position KV cache bucket",)
        assert graphs["unique_graphs"] == compiled
        reference = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=max_new_tokens, infer=options,
                                          after_step=eos_at_6)
        assert job.token_ids == reference.token_ids == first.token_ids


def test_a_warm_up_that_compiles_names_what_dynamo_compiled_and_its_time(session, caplog):
    """A warm-up that compiles (no packages) records each region's compiling calls: its log line and the
    worker session's record say which regions compiled how many graphs in how long."""
    fast = fast_on_cpu(session.source)  # the decode step compiled (vision and prefill left to other tests)
    jobs = DecodeOptions(no_repeat_ngram_size=11)  # a ban no other test compiles: the decode step compiles here
    before = dynamo_graphs()
    with caplog.at_level(logging.INFO, logger="dsocr_workers.engine.coldstart.warmup"):
        report = warm(fast, ["tiny"], max_new_tokens=8, infer=jobs)
    assert list(report.compiled) == ["decode_step"]
    graphs, seconds = report.compiled["decode_step"]
    assert graphs == dynamo_graphs() - before >= 1 and seconds > 0
    assert f"compiled by dynamo: decode_step {graphs} graph" in report.describe()
    assert "compiled by dynamo: decode_step" in caplog.text
    # dynamo's own timers divide that time: all of its compilation, of which its backend's.
    timers = report.compile_timers
    assert 0 < timers["OutputGraph.call_user_compiler"] < timers["_compile.compile_inner"] <= seconds
    assert f"(its timers: _compile.compile_inner {timers['_compile.compile_inner']:.1f} s" in report.describe()
    # A second warm-up compiles nothing and says nothing of it.
    again = warm(fast, ["tiny"], max_new_tokens=8, infer=jobs)
    assert (again.compiled, again.compile_timers) == ({}, {}) and "its timers" not in again.describe()


def test_fast_vision_compiles_once_for_every_crop_grid_on_cpu(session):
    """Each tile count used to be a graph of its own: the tile
    batch is dynamic now, so the first gundam page with tiles compiles and other grids reuse its graphs.
    And the encoders are compiled block by block: a graph per kind of block (SAM windowed, SAM global,
    CLIP) and view group, not one per encoder holding every layer."""
    fast = fast_on_cpu(session.source, decode_only=False)
    clock = StageClock(fast.device, nvtx_enabled=False, timing_enabled=False)

    def encode(on: DeepSeekOCRSession, width: int, height: int) -> tuple[tuple[int, int], torch.Tensor]:
        prepared = on.prepare(page(width, height), None, "gundam", 9)
        with torch.inference_mode():
            return prepared.crop_grid, on.encode_image(on.upload(prepared), clock)

    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    assert encode(fast, 1280, 640)[0] == (2, 1)
    compiled = graphs["unique_graphs"]
    # The global view (batch 1) and the tiles (batch 2, dynamic): SAM's 2 kinds of block each, and
    # CLIP's layer over both groups at once; the LM prefill is compiled too (`decode_only=False`) but
    # not reached by encode_image.
    assert compiled - before == 5
    for (width, height), grid in (((1920, 640), (3, 1)), ((1280, 1280), (2, 2)), ((1920, 1280), (3, 2))):
        found, embeds = encode(fast, width, height)
        assert found == grid
        assert graphs["unique_graphs"] == compiled, f"{grid}: compiled again"
        torch.testing.assert_close(embeds, encode(session, width, height)[1])


def test_fast_lm_prefill_compiles_a_graph_per_kind_of_layer_on_cpu(session):
    """The LM prefill compiled whole was one graph of every decoder layer. Layer by layer it is one graph for the dense first layer and one for the MoE layers, for every
    prompt length and cache bucket, and over the prompt padded to its bucket it leaves what the
    uncompiled prefill leaves: the logits of the last position, every layer's cache for the prompt's
    positions and its fill count."""
    fast = fast_on_cpu(session.source, decode_only=False)
    model, hidden = fast.model, fast.model.config.text.hidden_size
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    for length, capacity in ((53, 1024), (81, 1024), (97, 2048)):
        embeds = torch.randn(1, length, hidden, generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():  # as the session allocates and runs: a graph guards on it
            compiled, reference = (generate.DecodeBuffers.allocate(model, capacity, fast.device) for _ in range(2))
            # Into a cache another prompt filled, as a graph's replay after another job: from slot 0 again.
            fast.runners.prefill(model, torch.randn(1, length + 7, hidden), compiled.cache)
            logits = fast.runners.prefill(model, embeds.clone(), compiled.cache)
            expected = generate.prefill(model, embeds.clone(), reference.cache)
        assert graphs["unique_graphs"] - before == 2, f"prompt of {length} in a {capacity} bucket compiled again"
        torch.testing.assert_close(logits, expected)
        for ours, theirs in zip(compiled.cache.layers, reference.cache.layers, strict=True):
            # The prompt's slots; the padding's slots after them are overwritten by decoding.
            torch.testing.assert_close(ours.keys[:, :, :length], theirs.keys[:, :, :length])
            torch.testing.assert_close(ours.values[:, :, :length], theirs.values[:, :, :length])
            assert int(ours.cumulative_length) == int(theirs.cumulative_length) == length
    # Through the session, as eager decodes; a prompt of another length (another grid) compiles nothing.
    options = DecodeOptions(ignore_eos=True)
    for width, height in ((1280, 640), (1280, 1280)):
        job = fast.run_inference(page(width, height), mode="gundam", max_new_tokens=8, infer=options)
        assert job.token_ids == session.run_inference(page(width, height), mode="gundam", max_new_tokens=8,
                                                      infer=options).token_ids  # fmt: skip
        if width == height:
            assert graphs["unique_graphs"] == compiled
        compiled = graphs["unique_graphs"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"engine": "turbo"}, "unknown engine"),
    ({"dtype": "int3"}, "unknown dtype"),
    ({"device": "cuda:7"}, "CUDA"),
])
def test_bad_session_options(kwargs, message):
    with pytest.raises(InputError, match=message):
        DeepSeekOCRSession.from_local("tiny", **kwargs)


def test_bad_inputs_are_input_errors(session, tmp_path):
    bad = tmp_path / "page.png"
    bad.write_text("not an image")
    with pytest.raises(InputError):
        session.run_inference(bad)
    with pytest.raises(InputError, match="mode"):
        session.run_inference(page(600, 480), mode="huge")
    with pytest.raises(InputError, match="max_new_tokens"):
        session.run_inference(page(600, 480), max_new_tokens=0)
    with pytest.raises(InputError, match="unknown preset|not a checkpoint"):
        DeepSeekOCRSession.from_local(str(tmp_path / "missing"))


# --- measurements a user can trust: parts that add up, EOS, warm-up, cold flags ------------------------


def test_parts_add_up_to_end_to_end(session):
    result = session.run_inference(page(1000, 800), max_new_tokens=10, infer=DecodeOptions(ignore_eos=True))
    t = result.timings
    parts = t.parts_ms
    assert set(parts) == {"preprocess", "setup", "prefill", "first_token", "decode", "wasted_decode",
                          "readback", "postprocess", "host_gap"}
    assert all(parts[name] > 0 for name in ("preprocess", "setup", "prefill", "first_token", "decode",
                                            "readback", "postprocess"))
    assert sum(parts.values()) == pytest.approx(t.e2e_ms, abs=1e-6)
    # The gap is host glue between stages on the CPU: never negative, and small in one of a few jobs (a
    # loaded machine may preempt the process between two stages of any one job).
    assert t.host_gap_ms >= 0
    again = lambda: session.run_inference(page(1000, 800), max_new_tokens=10, infer=DecodeOptions(ignore_eos=True)).timings  # noqa: E731
    assert small_host_gap(t, again)
    assert t.ttft_ms == pytest.approx(t.preprocess_ms + t.setup_ms + t.prefill_ms + t.first_token_ms, rel=0.02)
    assert result.wasted_steps == 0 and t.wasted_decode_ms == 0
    assert result.memory is None  # allocator statistics are CUDA's


@pytest.mark.parametrize(("eos_at", "steps_run"), [(0, 0), (5, 8), (8, 8), (9, 16)])
def test_forced_eos_stops_at_the_next_check_and_counts_the_steps_past_it(session, eos_at, steps_run):
    from dsocr_workers.engine.stopping import EOS_CHECK_INTERVAL

    assert EOS_CHECK_INTERVAL == 8  # the expected steps below follow from it (CPU: each check is read at once)
    result = session.run_inference(page(600, 480), max_new_tokens=40, after_step=force_eos_at(eos_at))
    assert result.stop_reason == "eos" and result.token_ids[-1] == EOS_TOKEN_ID
    assert len(result.token_ids) == eos_at + 1
    assert result.wasted_steps == steps_run - eos_at
    assert result.kv_length == result.prompt_tokens + steps_run
    t = result.timings
    assert len(t.decode_step_ms) == eos_at
    assert (t.wasted_decode_ms > 0) == (steps_run > eos_at)
    assert sum(t.parts_ms.values()) == pytest.approx(t.e2e_ms, abs=1e-6)


def test_ignore_eos_runs_the_budget_through_a_forced_eos(session):
    result = session.run_inference(page(600, 480), max_new_tokens=12,
                                   infer=DecodeOptions(ignore_eos=True), after_step=force_eos_at(3))
    assert len(result.token_ids) == 12 and result.token_ids[3] == EOS_TOKEN_ID
    assert result.stop_reason == "max_new_tokens" and result.wasted_steps == 0


def test_cold_paths_are_flagged_and_warm_up_removes_them(caplog):
    fresh = DeepSeekOCRSession.from_local("tiny")
    first = fresh.run_inference(page(600, 480), mode="base", max_new_tokens=4)
    assert first.cold
    assert any("first job" in reason for reason in first.cold_reasons)
    assert any("1024-position KV cache bucket" in reason for reason in first.cold_reasons)
    second = fresh.run_inference(page(600, 480), mode="base", max_new_tokens=4)
    assert not second.cold, second.cold_reasons
    # 273 + 1000 > 1024: the next bucket (decoding stops at an EOS forced early: the bucket is what is read)
    bigger = fresh.run_inference(page(600, 480), mode="base", max_new_tokens=1000, after_step=force_eos_at(2))
    assert bigger.cold_reasons == ("first use of the 2048-position KV cache bucket",)

    warmed = DeepSeekOCRSession.from_local("tiny")
    with caplog.at_level(logging.INFO, logger="dsocr_workers.engine.coldstart.warmup"):
        report = warm(warmed, ["base", "gundam"], max_new_tokens=4, max_crops=3)
    # Each job of a pass timed, by shape, and its jobs' parts summed, in the log.
    assert re.search(r"warm-up pass 1: jobs base [\d.]+ s, gundam [\d.]+ s, gundam:2x1 [\d.]+ s, gundam:3x1 [\d.]+ s "
                     r"\(by part: setup [\d.]+ s, sam [\d.]+ s, clip [\d.]+ s, .*lm_prefill [\d.]+ s, .*\)$", caplog.text, re.MULTILINE), caplog.text  # fmt: skip
    assert report.shapes == ["base", "gundam", "gundam:2x1", "gundam:3x1"] and report.ms > 0
    # Eager: no helpers, no language job; its parts add up to the warm-up. One pass: it met only the first
    # job and the buckets' first uses, which running once resolves (the jobs below are warm).
    assert report.passes == 1 and report.still_cold == ()
    assert list(report.phases_ms) == ["pass 1"]  # the pages prepared beside it
    assert sum(report.phases_ms.values()) == pytest.approx(report.ms)
    assert warm(warmed, []).shapes == []
    for image in (page(600, 480), page(1000, 800)):  # base; gundam 2x1
        result = warmed.run_inference(image, mode="gundam" if image.width == 1000 else "base",
                                      max_new_tokens=4, max_crops=3)
        assert not result.cold, result.cold_reasons
    # The LM prefill is readied up to the longest prompt of any grid: 1x3's, 20 newlines more than the
    # 3x1 strip the warm-up ran; base's page is the shortest.
    tall = warmed.run_inference(page(480, 1440), mode="gundam", max_new_tokens=4, max_crops=3)
    assert tall.crop_grid == (1, 3) and not tall.cold, tall.cold_reasons
    shortest = warmed.run_inference(page(600, 480), mode="base", max_new_tokens=4).prompt_tokens
    assert report.prompt_lengths == (shortest, tall.prompt_tokens)


# --- repetition loops: found after decoding, and stopped early when asked -----------------------------


def looping_head(session, token: int) -> torch.nn.Linear:
    """An LM head whose bias makes `token` the certain choice at every step: a period-1 loop."""
    original = session.model.lm_head
    head = torch.nn.Linear(original.in_features, original.out_features, bias=True)
    bias = torch.zeros(original.out_features)
    bias[token] = 1e4
    with torch.no_grad():
        head.weight.copy_(original.weight)
        head.bias.copy_(bias)
    return head


def test_a_loop_is_found_after_decoding_and_stopped_early_on_request(session):
    from dsocr_workers.engine.loops import LOOP_MIN_TOKENS
    from dsocr_workers.engine.stopping import EOS_CHECK_INTERVAL

    original = session.model.lm_head
    session.model.lm_head = looping_head(session, 4242)
    try:
        no_ban = DecodeOptions(no_repeat_ngram_size=0)
        ran = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=100, infer=no_ban)
        stopped = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=100,
                                        infer=DecodeOptions(no_repeat_ngram_size=0, stop_on_repetition=True))
        banned = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=60,
                                       infer=DecodeOptions(stop_on_repetition=True))
    finally:
        session.model.lm_head = original
    assert ran.token_ids == [4242] * 100 and ran.stop_reason == "max_new_tokens"
    assert (ran.loop.start, ran.loop.period, ran.loop.wasted_steps) == (0, 1, 99)
    # Looked at every EOS_CHECK_INTERVAL steps: the first look with LOOP_MIN_TOKENS tokens written stops it.
    first_look = -(-(LOOP_MIN_TOKENS - 1) // EOS_CHECK_INTERVAL) * EOS_CHECK_INTERVAL
    assert stopped.stop_reason == "repetition" and len(stopped.token_ids) == first_look + 1
    assert (stopped.loop.start, stopped.loop.period, stopped.loop.wasted_steps) == (0, 1, first_look)
    assert len(stopped.timings.decode_step_ms) == first_look and stopped.wasted_steps == 0
    # The vendor's no-repeat 20-gram ban breaks the loop every 20 tokens: nothing repeats exactly.
    assert banned.stop_reason == "max_new_tokens" and len(banned.token_ids) == 60 and banned.loop is None


def test_stop_on_repetition_changes_nothing_without_a_loop(session):
    plain = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=40)
    watched = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=40,
                                    infer=DecodeOptions(stop_on_repetition=True))
    assert watched.token_ids == plain.token_ids and watched.stop_reason == plain.stop_reason == "max_new_tokens"
    assert watched.loop is None and plain.loop is None


def test_eos_wins_over_a_loop_and_is_not_searched(session):
    result = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=40,
                                   infer=DecodeOptions(stop_on_repetition=True), after_step=force_eos_at(3))
    assert result.stop_reason == "eos" and result.loop is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the watches' event-polled path")
def test_cuda_watches_stop_a_loop_and_find_eos_without_stalling():
    from dsocr_workers.engine.generate import EOS_LOOKAHEAD
    from dsocr_workers.engine.loops import LOOP_MIN_TOKENS
    from dsocr_workers.engine.stopping import EOS_CHECK_INTERVAL

    cuda = DeepSeekOCRSession.from_local("tiny", device="cuda")
    original = cuda.model.lm_head
    cuda.model.lm_head = looping_head(cuda, 4242).to(original.weight.device, original.weight.dtype)
    try:
        stopped = cuda.run_inference(page(600, 480), mode="tiny", max_new_tokens=200,
                                     infer=DecodeOptions(no_repeat_ngram_size=0, stop_on_repetition=True))
    finally:
        cuda.model.lm_head = original
    # A look is read once its copy has landed, at the latest EOS_LOOKAHEAD looks later: the loop is
    # stopped between the first look that holds LOOP_MIN_TOKENS tokens and that many looks after it.
    first_look = -(-(LOOP_MIN_TOKENS - 1) // EOS_CHECK_INTERVAL) * EOS_CHECK_INTERVAL
    steps = len(stopped.timings.decode_step_ms)
    assert stopped.stop_reason == "repetition" and stopped.token_ids == [4242] * (steps + 1)
    assert first_look <= steps <= first_look + EOS_LOOKAHEAD * EOS_CHECK_INTERVAL, steps
    assert stopped.timings.clock == "cuda_event" and stopped.loop is not None and stopped.loop.period == 1

    eos = cuda.run_inference(page(600, 480), mode="tiny", max_new_tokens=200,
                             after_step=force_eos_at(5))
    assert eos.stop_reason == "eos" and len(eos.token_ids) == 6 and eos.token_ids[-1] == EOS_TOKEN_ID
    assert 0 < eos.wasted_steps <= (EOS_LOOKAHEAD + 1) * EOS_CHECK_INTERVAL


def test_decode_progress_is_reported_at_the_watch_cadence(session):
    from dsocr_workers.engine.stopping import EOS_CHECK_INTERVAL

    seen: list[tuple[int, int]] = []
    result = session.run_inference(page(600, 480), mode="tiny", max_new_tokens=30,
                                   on_decode_progress=lambda steps, budget: seen.append((steps, budget)))
    assert len(result.token_ids) == 30
    assert seen == [(k, 30) for k in range(EOS_CHECK_INTERVAL, 30, EOS_CHECK_INTERVAL)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned memory and its copies")
def test_cuda_a_jobs_setup_copies_from_pinned_memory_only():
    """A page prepared for a CUDA job holds every tensor setup copies in pinned memory: a copy from
    pageable memory makes the host wait for the work queued before it, and the setup's clock that wait."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DeepSeekOCRSession.from_local("tiny", device="cuda")
    prepared = cuda.prepare_job(page(600, 480), mode="tiny")
    assert all(t.is_pinned() for t in (prepared.page.input_ids, prepared.page.image_positions,
                                       prepared.page.global_pixels))  # fmt: skip
    cuda.run_on_device(prepared.page, 4, clock=prepared.clock).finish()  # warm
    prepared = cuda.prepare_job(page(600, 480), mode="tiny")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cuda.run_on_device(prepared.page, 4, clock=prepared.clock).finish()
    copies = {e.name for e in prof.events() if "Memcpy HtoD" in e.name}
    assert copies and not any("Pageable" in name for name in copies), copies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fast engine compiles, and graphs decode")
def test_cuda_fast_engine_follows_eager_in_float32():
    """The fast engine as shipped (inductor, CUDA-graph decode, fused projections, the selected-experts
    kernels) picks eager's greedy tokens in float32, in the job that captures and in one that replays."""
    eager = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype="float32")
    fast = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype="float32", engine="fast")
    options = DecodeOptions(ignore_eos=True)
    reference = eager.run_inference(page(600, 480), mode="tiny", max_new_tokens=64, infer=options)
    for _ in range(3):
        result = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=64, infer=options)
        assert result.engine == "fast" and result.token_ids == reference.token_ids


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_fast_engine_on_a_second_gpu_runs_there():
    """A worker child on cuda:1 in a process whose current device was cuda:0: its warm-up captured CUDA
    graphs on a stream of cuda:0 while the kernels ran on cuda:1 and failed ("operation not permitted
    when stream is capturing"). The session makes its device current: the warm-up
    and a job run, the job's device times come from events on cuda:1, nothing lands on cuda:0."""
    torch.cuda.set_device(0)
    on_first = torch.cuda.memory_allocated(0)
    try:
        fast = DeepSeekOCRSession.from_local("tiny", device="cuda:1", dtype="bfloat16", engine="fast")
        assert torch.cuda.current_device() == 1
        options = DecodeOptions(ignore_eos=True)
        warm(fast, ["tiny"], max_new_tokens=8, infer=options)
        result = fast.run_inference(page(600, 480), mode="tiny", max_new_tokens=8, infer=options)
        assert result.engine == "fast" and len(result.token_ids) == 8 and not result.cold, result.cold_reasons
        assert result.timings.prefill_ms > 0 and result.timings.decode_ms > 0
        assert torch.cuda.memory_allocated(0) == on_first
    finally:
        torch.cuda.set_device(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fast engine's prefill graphs")
def test_cuda_prefill_graphs_replay_each_prompt_length_with_its_own_embeddings():
    """The LM prefill is captured once per padded prompt length and cache, and replayed with the
    embeddings copied in: each prompt gets the uncompiled prefill's logits and cache, a second prompt of
    a captured length its own, and the warm-up captures every length its modes' grids make."""
    fast = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype="float32", engine="fast")
    model, hidden = fast.model, fast.model.config.text.hidden_size
    with torch.inference_mode():
        for length, capacity, seed in ((53, 1024, 0), (81, 1024, 1), (97, 1024, 2), (97, 1024, 3), (97, 2048, 2)):
            embeds = torch.randn(1, length, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            ours, reference = fast.buffers_for(capacity - 8), generate.DecodeBuffers.allocate(model, capacity, fast.device)
            ours.cache.reset()
            logits = fast.runners.prefill(model, embeds, ours.cache)
            torch.testing.assert_close(logits, generate.prefill(model, embeds, reference.cache), rtol=1e-4, atol=1e-4)
            for mine, theirs in zip(ours.cache.layers, reference.cache.layers, strict=True):
                torch.testing.assert_close(mine.keys[:, :, :length], theirs.keys[:, :, :length], rtol=1e-4, atol=1e-4)
                assert int(mine.cumulative_length) == length
    # 64, 128 in the 1024 cache, 128 in the 2048 one
    assert fast.runners.prefill_graphs is not None and fast.runners.prefill_graphs.captured == 3
    report = warm(fast, ["tiny", "gundam"], max_new_tokens=8, max_crops=4)
    assert not report.still_cold, report.still_cold
    # Each pass's captures timed apart from its jobs, counted, and still adding up to the warm-up.
    assert report.prefill_graphs == fast.runners.prefill_graphs.captured - 3 > 0
    assert list(report.phases_ms)[1:3] == ["pass 1", "prefill graphs 1"]
    assert sum(report.phases_ms.values()) == pytest.approx(report.ms)
    job = fast.run_inference(page(1280, 1280), mode="gundam", max_new_tokens=8, max_crops=4)  # a 2x2 grid
    assert job.crop_grid == (2, 2) and not job.cold, job.cold_reasons
    # 1x4: 30 newlines more than the 4x1 strip the warm-up ran, a padded length of its own.
    tall = fast.run_inference(page(480, 1920), mode="gundam", max_new_tokens=8, max_crops=4)
    assert tall.crop_grid == (1, 4) and not tall.cold, tall.cold_reasons


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fast engine's vision graphs")
def test_cuda_vision_graphs_replay_each_page_shape_with_its_own_pixels():
    """Vision is captured once per page shape and replayed with the pixels copied in: every grid, and a
    second page of a shape already captured, gets eager's embeddings, not the first page's."""
    eager = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype="float32")
    fast = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype="float32", engine="fast")
    clock = StageClock(fast.device, nvtx_enabled=False, timing_enabled=False)

    def encode(on: DeepSeekOCRSession, image: Image.Image) -> torch.Tensor:
        prepared = on.prepare(image, None, "gundam", 9)
        with torch.inference_mode():
            return on.encode_image(on.upload(prepared), clock).clone()

    wide = page(1280, 640)
    images = [wide, page(1920, 640), page(1280, 1280), wide.transpose(Image.Transpose.FLIP_LEFT_RIGHT), wide]
    embeds = []
    for image in images:
        embeds.append(encode(fast, image))
        torch.testing.assert_close(embeds[-1], encode(eager, image), rtol=2e-3, atol=2e-3)
    assert not torch.equal(embeds[0], embeds[3])  # the flipped page: the replay saw its own pixels
    torch.testing.assert_close(embeds[4], embeds[0], rtol=0, atol=0)  # and a replay is deterministic


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph captures")
def test_cuda_a_capture_keeps_the_allocators_cache_and_replays_its_inputs():
    """A capture leaves the blocks the caching allocator holds (`torch.cuda.graph` empties its cache at
    every capture, and the next jobs then allocate anew), and its graph replays what its inputs hold."""
    source = torch.arange(1024, dtype=torch.float32, device="cuda")
    freed = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del freed  # back in the allocator's cache, not the driver's
    reserved = torch.cuda.memory_reserved()
    graph, (doubled,) = capture_graph(lambda: [source * 2], torch.cuda.graph_pool_handle())
    assert torch.cuda.memory_reserved() >= reserved
    source.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(doubled, torch.full_like(source, 6.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a division by a scalar multiplies there")
def test_cuda_pixels_are_the_cpus_bits():
    """A page's pixels uploaded to CUDA (global view and tiles) are the CPU's `normalize_pixels`, bit for
    bit: the vendor's true division, not CUDA's product with the reciprocal."""
    from dsocr_workers.model.preprocess import normalize_pixels

    gradient = Image.linear_gradient("L").convert("RGB").resize((1600, 2000))  # every byte value
    for dtype in ("bfloat16", "float32"):
        gpu = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype=dtype)
        prepared = gpu.prepare_job(gradient, mode="gundam").page
        with torch.inference_mode():
            uploaded = gpu.upload(prepared)
        assert len(uploaded.pixels) == 2
        for ours, raw in zip(uploaded.pixels, (prepared.global_pixels, prepared.tile_pixels), strict=True):
            assert torch.equal(ours.cpu(), normalize_pixels(raw, gpu.dtype)), dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_engine_is_fast():
    assert DeepSeekOCRSession.from_local("tiny", device="cuda", engine="auto").engine_name == "fast"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fast engine's graphs")
def test_cuda_fast_sessions_can_be_dropped_and_replaced():
    """A worker drops its session when a run asks for another model or dtype; the next one compiles
    and captures its own graphs. Nothing of the first may be replayed or freed under the second."""
    import gc

    for dtype in ("float32", "bfloat16", "float32"):
        fast = DeepSeekOCRSession.from_local("tiny", device="cuda", dtype=dtype, engine="fast")
        for width in (1280, 1920, 1280):
            result = fast.run_inference(page(width, 640), mode="gundam", max_new_tokens=12)
            assert result.engine == "fast" and result.token_ids
        del fast, result
        gc.collect()
        torch._dynamo.reset()  # as bench_fidelity does between its dtypes
        torch.cuda.synchronize()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_jobs_host_part_can_finish_after_the_next_job_ran_on_the_device(device, session):
    """`run_on_device` leaves the host's part to `DeviceRun.finish()`, which the farm runs on another
    thread while the device runs the next job: finishing a job after the next one ran (and on another
    thread) must give what finishing it at once gives. The pages differ so their outputs do."""
    engine = session if device == "cpu" else DeepSeekOCRSession.from_local("tiny", device=device)
    options = DecodeOptions(ignore_eos=True)
    images = [page(600, 480), page(480, 900)]
    at_once = [engine.run_on_device(engine.prepare_job(image, mode="tiny").page, 6, options).finish() for image in images]
    first, second = (engine.run_on_device(engine.prepare_job(image, mode="tiny").page, 6, options) for image in images)
    with ThreadPoolExecutor(max_workers=1) as other_thread:
        finished = [other_thread.submit(run.finish).result() for run in (first, second)]
    assert [r.token_ids for r in finished] == [r.token_ids for r in at_once]
    assert [r.text for r in finished] == [r.text for r in at_once]
    assert at_once[0].token_ids != at_once[1].token_ids
    for result in finished:
        timings = result.timings
        assert timings.postprocess_ms > 0 and timings.decode_ms > 0 and len(timings.decode_step_ms) == 5
        assert result.kv_length == result.prompt_tokens + 5


def test_the_hooks_run_once_the_first_token_and_once_the_decode_are_queued(session):
    """Where the farm lets its ledger writes go (after the prefill's first token, before any decode step)
    and where it waits for a job's claim (after the last decode step, before the readback)."""
    order: list[int | str] = []
    session.run_on_device(session.prepare_job(page(600, 480), mode="tiny").page, 4, DecodeOptions(ignore_eos=True),
                          after_step=lambda job, step: order.append(step),
                          before_decode=lambda: order.append("released"),
                          before_readback=lambda: order.append("claimed"))  # fmt: skip
    assert order == [0, "released", 1, 2, 3, "claimed"]
