"""`DeepSeekOCRSession`: a loaded model on one device and the one job sequence, timed by stage.

    session = DeepSeekOCRSession.from_local("tiny" | "full" | "/path/to/DeepSeek-OCR", device="cuda:0")
    result = session.run_inference("page.png", mode="gundam", max_new_tokens=512)

A job: `prepare_job` (preprocess, any thread) → `run_on_device` (setup, prefill into a cache and the
first token, decode, readback and the stop rule; hooks where the farm waits for its claim and where checks
read or force a token) → `DeviceRun.finish` (the one result assembly, on any thread). The farm, `dsocr
infer`/`verify`, the warm-up and the benchmarks all run it. The batched engine prefills through
`lm_prefill`; its pages' results are assembled by the same `finish` (`DeviceRun.batched`).
How the model runs is its engine's (engine/variants/), how a process gets warm the cold start's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from transformers import StaticCache

from dsocr_workers import settings
from dsocr_workers.engine.clock import STEP_CAPACITY, StageClock
from dsocr_workers.engine.device import make_current, resolve_device, resolve_dtype, set_numerics
from dsocr_workers.engine.generate import DecodeBuffers, EosWatch, RepetitionWatch, cache_bucket, choose_token
from dsocr_workers.engine.loops import find_loop
from dsocr_workers.engine.profiling import JobProfiler
from dsocr_workers.engine.regions import Compiler, dynamo_graphs
from dsocr_workers.engine.result import (
    DecodeOptions,
    DeviceSpan,
    InferenceResult,
    JobMemory,
    ModelSource,
    StopReason,
)
from dsocr_workers.engine.sampling import NGramBan, validate_options
from dsocr_workers.engine.stopping import EOS_CHECK_INTERVAL, stop_reason, trim_at_eos
from dsocr_workers.engine.variants import AUTO, make_engine
from dsocr_workers.engine.variants.base import Engine, Runners
from dsocr_workers.errors import InputError
from dsocr_workers.model import postprocess, preprocess
from dsocr_workers.model.checkpoint import LoadedModel, build_preset, load_checkpoint
from dsocr_workers.model.config import EOS_TOKEN_ID, dtype_name
from dsocr_workers.model.families import FamilyCode, ModelFamily, all_presets
from dsocr_workers.model.interface import OCRModel
from dsocr_workers.model.tokenizer import OCRTokenizer
from dsocr_workers.stages import TIMINGS, StageTimings, model_stages

if TYPE_CHECKING:  # the batched engine (its runner) imports this module
    from dsocr_workers.engine.batched.metrics import SequenceMetrics
    from dsocr_workers.engine.batched.scheduler import BatchedOutput

log = logging.getLogger(__name__)


FIRST_JOB = "first job of this model in its process (not warmed up)"
NEW_BUCKET = "first use of the {}-position KV cache bucket"


def met_once(reason: str) -> bool:
    """A cold path that running a job once resolves for good (the process's first job, a KV cache
    bucket's first use): a warm-up pass that met no other needs no next pass."""
    prefix, _, suffix = NEW_BUCKET.partition("{}")
    return reason == FIRST_JOB or (reason.startswith(prefix) and reason.endswith(suffix))


@dataclass(frozen=True)
class DevicePage:
    """A prepared page's inputs on the device: ids, normalised pixel groups (the global view, then the
    tiles if any) and the placeholder positions the image embeddings go to."""

    page: preprocess.PreparedPage
    input_ids: torch.Tensor
    pixels: list[torch.Tensor]
    image_positions: torch.Tensor


@dataclass(frozen=True)
class PreparedJob:
    """A job's page, preprocessed, and the job's clock holding that `preprocess` stage, timed where it
    ran (any thread: host work only), e.g. while another job has the device."""

    page: preprocess.PreparedPage
    clock: StageClock


@dataclass
class PageJob:
    """One job between the session's steps: its page on the device, its decode state and how far
    decoding went. `start_job` makes it; `prefill`, `decode` and `read_output` advance it."""

    inputs: DevicePage
    buffers: DecodeBuffers
    ban: NGramBan
    options: DecodeOptions
    budget: int  # tokens the job may produce
    ceiling: int  # tokens the model's positions leave after the prompt
    vision_calls: int = 0
    steps: int = 0  # decode steps run, those past EOS included (the first token comes from prefill)
    repeating: bool = False  # RepetitionWatch stopped decoding

    @property
    def page(self) -> preprocess.PreparedPage:
        return self.inputs.page

    @property
    def prompt_tokens(self) -> int:
        return self.inputs.page.prompt_tokens

    @property
    def kv_length(self) -> int:
        """Positions in the KV cache: the prompt, then one per token fed back (the last never is)."""
        return self.prompt_tokens + self.steps

    def token(self, index: int) -> int:
        """Output token `index` (0: the first token) read back: a host sync, for checks."""
        return int(self.buffers.tokens[self.prompt_tokens + index])

    def write_token(self, index: int, token: int) -> None:
        """Overwrite output token `index` on the device (no sync): the next decode step feeds it back."""
        self.buffers.tokens[self.prompt_tokens + index].fill_(token)


# Called with the job and its step (0: the first token, from the prefill; n: decode step n) once the
# step's token is chosen (queued on the device): `DeepSeekOCRSession.run_on_device(after_step=...)`.
StepHook = Callable[[PageJob, int], None]


def force_eos_at(step: int) -> StepHook:
    """A step hook that makes EOS the token of `step`, whatever the logits say (a device write, no sync;
    the compiled step is the same with or without it): the warm-up ends decode early with it, benchmarks
    and tests time the EOS path at a known length."""

    def hook(job: PageJob, at: int) -> None:
        if at == step:
            job.write_token(step, EOS_TOKEN_ID)

    return hook


@dataclass(frozen=True)
class _ColdProbe:
    """What a job can find changed when it meets a cold path: counted before, compared after."""

    graphs: int
    prefill_graphs: int
    decode_graphs: int
    reserved_bytes: int


# A batched page's figures the batch does not time per page: None. Its device stages but its prefill
# (whose vision it times whole), and the decode steps after EOS (steps it shares with other pages).
UNTIMED_IN_A_BATCH: dict[str, Any] = {
    t.column: None for t in TIMINGS if (t.stage is not None and not t.host and t.column != "prefill_ms")
} | {"wasted_decode_ms": None}


@dataclass(frozen=True)
class BatchFigures:
    """A page decoded in the batched engine: its serving figures, and where its TTFT starts (the
    farm's claim, on the same perf_counter clock as its tokens)."""

    metrics: SequenceMetrics
    ttft_from_s: float

    def timings(self, own: StageTimings, finished_s: float) -> StageTimings:
        """The page's own host stages (`own`: its clock timed no device stage) and what the batch timed
        of it: its prefill launches and the vision in them, its inter-token gaps for its decode steps and
        its serving figures. The device stages run inside those launches unsplit (vision's parts, LM
        prefill, first token, setup) or in steps other pages share (decode, readback) are None: not
        measured. TTFT and end-to-end both run from `ttft_from_s` (end-to-end to `finished_s`), so TTFT ≤
        e2e; the time in between that no measured part names is its host gap."""
        metrics = self.metrics
        e2e_ms = (finished_s - self.ttft_from_s) * 1e3
        timings = replace(
            own,
            **UNTIMED_IN_A_BATCH,
            prefill_ms=metrics.prefill_ms,
            vision_ms=metrics.vision_ms,
            decode_step_ms=metrics.itl_ms,
            ttft_ms=(metrics.token_s[0] - self.ttft_from_s) * 1e3,
            ttft_from_device_start_ms=metrics.prefill_to_first_token_ms,
            tpot_ms=metrics.tpot_ms or 0.0,
            queue_wait_ms=metrics.queue_wait_ms,
            e2e_ms=e2e_ms,
        )
        parts = timings.parts_ms
        del parts["host_gap"]
        return replace(timings, host_gap_ms=e2e_ms - sum(parts.values()))

    def span(self) -> DeviceSpan:
        metrics = self.metrics
        return DeviceSpan(metrics.prefill_started_s, metrics.token_s[0], metrics.token_s[-1])


@dataclass(frozen=True)
class DeviceRun:
    """A page whose device part is done: its tokens are on the host. `finish()` is the host's part and
    the one place a result is assembled (the text decoded and parsed, the timings resolved from the
    job's CUDA events, the loop analysis); it reads nothing the device's next job changes, so it runs
    on any thread while the device runs the next job."""

    session: DeepSeekOCRSession
    page: preprocess.PreparedPage
    clock: StageClock
    generated: list[int]
    stop_reason: StopReason
    kv_length: int
    vision_calls: int
    wasted_steps: int
    memory: JobMemory | None = None
    cold_reasons: tuple[str, ...] = ()
    return_text: bool = True
    batch: BatchFigures | None = None

    @classmethod
    def batched(
        cls, session: DeepSeekOCRSession, prepared: PreparedJob, output: BatchedOutput, ttft_from_s: float
    ) -> DeviceRun:
        """A page the batched engine finished (`output`), its TTFT counted from `ttft_from_s`."""
        return cls(
            session,
            prepared.page,
            prepared.clock,
            output.token_ids,
            output.stop_reason,
            kv_length=output.prompt_tokens + len(output.token_ids) - 1,
            vision_calls=1,
            wasted_steps=output.wasted_steps,
            batch=BatchFigures(output.metrics, ttft_from_s),
        )

    def finish(self) -> InferenceResult:
        session, page, clock, generated, batch = (
            self.session,
            self.page,
            self.clock,
            self.generated,
            self.batch,
        )
        with clock.stage("postprocess"):
            text = session.decode_text(generated) if self.return_text else ""
            parsed = postprocess.parse_markup(text, *page.image_size)
        clock.finish()
        # Analysis, not inference: outside the stages, so it is no part of the job's timings.
        loop = None if self.stop_reason == "eos" else find_loop(generated)
        profile = clock.profiler.collect(clock) if clock.profiler is not None else None
        timings = clock.stage_timings(kept_steps=len(generated) - 1 if batch is None else 0)
        return InferenceResult(
            text=text,
            token_ids=generated,
            stop_reason=self.stop_reason,
            prompt_tokens=page.prompt_tokens,
            image_tokens=page.image_tokens,
            crop_grid=page.crop_grid,
            mode=page.mode.name,
            image_size=page.image_size,
            timings=timings if batch is None else batch.timings(timings, clock.finished_s()),
            boxes=postprocess.boxes_json(parsed),
            skipped_spans=parsed.skipped_spans,
            memory=self.memory,
            engine=session.engine_name,
            device=str(session.device),
            dtype=dtype_name(session.dtype),
            model=session.source,
            kv_length=self.kv_length,
            vision_calls=self.vision_calls,
            wasted_steps=self.wasted_steps,
            batch_occupancy=None if batch is None else batch.metrics.mean_occupancy,
            cold_reasons=self.cold_reasons,
            loop=loop,
            device_span=clock.device_span() if batch is None else batch.span(),
            profile=profile,
        )


@dataclass
class DeepSeekOCRSession:
    """A loaded model on one device and its engine (engine/variants/: its `runners` are what a job's steps
    call; `engine_name` is what results record)."""

    loaded: LoadedModel
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    engine: Engine
    engine_note: str = ""  # why the engine that runs is not the one asked for
    # NVTX ranges and stage timings for its jobs' clocks (`new_clock`); off only to measure what they cost.
    instrumented: bool = True
    runners: Runners = field(init=False)
    # What makes its engine's regions, where not the engine's own (`use_compiler`); the batched engine's
    # step is made by it too.
    compiler: Compiler | None = field(init=False, default=None)
    jobs_run: int = field(init=False, default=0)
    weights_bytes: int = field(init=False, default=0)
    _buffers: dict[int, DecodeBuffers] = field(init=False, default_factory=dict)
    _new_buckets: list[int] = field(init=False, default_factory=list)  # allocated since the last job began
    _pixel_table: torch.Tensor | None = field(init=False, default=None)  # `upload`'s on CUDA, made once

    def __post_init__(self) -> None:
        model = self.loaded.model
        make_current(self.device)
        set_numerics(self.device, self.dtype)
        self.weights_bytes = sum(
            t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
        )
        self.runners = self.engine.runners(model, self.device)

    @classmethod
    def from_local(
        cls,
        source: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        engine: str | Engine = AUTO,
        seed: int = 0,
        instrumented: bool | None = None,
    ) -> DeepSeekOCRSession:
        """Load a preset (`tiny`, `ocr2-tiny`, ...: seeded random weights) or a checkpoint directory of
        any model family (model/families.py).
        `engine`: a registered name (engine/variants/: `auto` is fast on CUDA, eager on a CPU), or an
        engine object (a benchmark's or a test's settings). `instrumented`: None reads
        `DSOCR_INSTRUMENTATION`, here and only here."""
        resolved = resolve_device(device)
        make_current(resolved)  # before loading: nothing of this process lands on another GPU
        variant, note = (engine, "") if isinstance(engine, Engine) else make_engine(engine, resolved.type)
        if note:
            log.warning(note)
        torch_dtype = resolve_dtype(dtype, resolved)
        kernels = variant.kernels()
        name = os.fspath(source)
        with torch.inference_mode():
            if name in all_presets():
                loaded = build_preset(name, seed=seed, device=resolved, dtype=torch_dtype, **kernels)
                model_source = ModelSource(
                    "preset", name, random_weights=True, seed=seed, fingerprint=loaded.fingerprint
                )
            else:
                loaded = load_checkpoint(Path(name), device=resolved, dtype=torch_dtype, **kernels)
                # A preset saved with `dsocr model save-preset` stays labelled as random weights.
                model_source = ModelSource(
                    "checkpoint",
                    str(Path(name).resolve()),
                    random_weights=loaded.preset is not None,
                    seed=loaded.seed,
                    fingerprint=loaded.fingerprint,
                )
            variant.after_load(loaded.model)
        instrumented = settings.read(settings.INSTRUMENTATION) if instrumented is None else instrumented
        return cls(loaded, model_source, resolved, torch_dtype, variant, note, instrumented)

    @property
    def engine_name(self) -> str:
        """The engine's registered name, as results record it."""
        return self.engine.name

    @property
    def model(self) -> OCRModel:
        return self.loaded.model

    @property
    def family(self) -> ModelFamily:
        return self.loaded.family

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages of this session's model: its family's view encoder, no other family's."""
        return model_stages(self.family.encoder_stage)

    @property
    def code(self) -> FamilyCode:
        """The family's preprocessing and token schedule."""
        return self.loaded.family.code()

    @property
    def tokenizer(self) -> OCRTokenizer:
        return self.loaded.tokenizer

    @property
    def max_positions(self) -> int:
        return self.loaded.config.text.max_position_embeddings

    def use_compiler(self, compiler: Compiler) -> None:
        """Run the engine's compiled regions through `compiler` from now on (AOTInductor packages loaded by
        the cold start, engine/coldstart/): new runners, so graphs captured before are dropped."""
        self.compiler = compiler
        self.runners = self.engine.runners(self.model, self.device, compiler)

    def buffers_for(self, needed: int) -> DecodeBuffers:
        """The static decode state (KV cache, token buffer) of the bucket that holds `needed` positions."""
        capacity = cache_bucket(needed, self.max_positions)
        if capacity not in self._buffers:
            self._buffers[capacity] = DecodeBuffers.allocate(self.model, capacity, self.device)
            self._new_buckets.append(capacity)
        return self._buffers[capacity]

    # --- one job ------------------------------------------------------------------------------------

    def new_clock(self, job_id: str | None = None, *, marks_steps: bool = True) -> StageClock:
        """A job's clock, instrumented as this session is. `marks_steps` False: a page whose decode steps
        the batched engine times; step events made for each page would hold the GIL that the engine's
        thread needs to launch its steps."""
        return StageClock(
            self.device,
            job_id=job_id,
            nvtx_enabled=self.instrumented,
            timing_enabled=self.instrumented,
            step_capacity=STEP_CAPACITY if marks_steps else 0,
            stages=self.stages,
        )

    def prepare(
        self,
        image: str | os.PathLike | bytes | Image.Image,
        prompt: str | None,
        mode: str | None,
        max_crops: int | None = None,
    ) -> preprocess.PreparedPage:
        """The family's preprocessing of one page; None: the family's default mode, its own limit of
        tiles."""
        return self.family.prepare_page(image, self.tokenizer.encode, prompt, mode, max_crops)

    def max_crops(self, asked: int | None = None) -> int:
        """The most tiles a page is cut into: `asked` (checked against the family's limit), or the limit."""
        return self.family.crops(asked)

    def longest_prompt(self, mode: str | None, prompt: str | None, max_crops: int | None = None) -> int:
        """The most prompt tokens a page can make in `mode` with `prompt` (its largest tile grid)."""
        spec = self.family.mode(mode or self.family.default_mode)
        most = self.code.most_image_tokens(spec, self.max_crops(max_crops))
        return preprocess.longest_prompt(self.tokenizer.encode, prompt, most)

    def prepare_job(
        self,
        image: str | os.PathLike | bytes | Image.Image,
        prompt: str | None = None,
        mode: str | None = None,
        job_id: str | None = None,
        max_crops: int | None = None,
        clock: StageClock | None = None,
    ) -> PreparedJob:
        """A job's `preprocess` stage, on `clock` (None: a new one for `job_id`): the first step of
        `run_inference`. On CUDA the page's tensors are page-locked (`PreparedPage.pinned`): a pageable
        upload would wait for the work queued before it (the previous job, the batch's decode steps)."""
        clock = clock or self.new_clock(job_id)
        with torch.inference_mode(), clock.stage("preprocess"):
            page = self.prepare(image, prompt, mode, max_crops)
            if self.device.type == "cuda":
                page = page.pinned()
        return PreparedJob(page, clock)

    def upload(self, page: preprocess.PreparedPage, input_ids: torch.Tensor | None = None) -> DevicePage:
        """The page's inputs to the device, asynchronously (without waiting for the queued work only
        where the page is pinned); the ids into `input_ids` where given (a job's token buffer). Bytes
        cross as uint8 and are normalised there by `normalize_pixels`, or on CUDA by a table of the 256
        values it makes on the CPU: the vendor's bits, which CUDA's division by a scalar (a product with
        its reciprocal) does not give, in two launches per group instead of five."""
        groups = [page.global_pixels] if page.tile_pixels is None else [page.global_pixels, page.tile_pixels]
        # The pixels first: the device copies them while the host queues the rest.
        pixels = [g.to(self.device, non_blocking=True) for g in groups]
        if self.device.type == "cuda":
            if self._pixel_table is None:
                byte_values = torch.arange(256, dtype=torch.uint8)
                self._pixel_table = preprocess.normalize_pixels(byte_values, self.dtype).to(self.device)
            table = self._pixel_table
            pixels = [table.index_select(0, g.flatten().int()).view(g.shape) for g in pixels]
        else:  # no launches to save, and a gather costs the CPU more than the five operations
            pixels = [preprocess.normalize_pixels(g, self.dtype) for g in pixels]
        if input_ids is None:
            ids = page.input_ids.to(self.device, non_blocking=True)
        else:
            ids = input_ids.copy_(page.input_ids, non_blocking=True)
        # Placeholder positions made on the host with the page (pinned with it): a boolean index on the
        # device would sync (nonzero) and stall the GPU between vision and LM.
        positions = page.image_positions.to(self.device, non_blocking=True)
        return DevicePage(page, ids, pixels, positions)

    def encode_image(self, inputs: DevicePage, clock: StageClock) -> torch.Tensor:
        """Vision stages → the (N, hidden) image embeddings in the vendor's layout: `encode_sam`, then
        `encode_views`."""
        return self.encode_views(inputs, self.encode_sam(inputs, clock), clock)

    def encode_sam(self, inputs: DevicePage, clock: StageClock) -> list[torch.Tensor]:
        """SAM over the page's view groups (the global view, then the tiles if any, one call per group):
        the features `encode_views` takes. With CUDA graphs they live in the vision graphs' pool, valid
        until the next `encode_sam`."""
        with clock.stage("vision/sam"):
            return self.runners.vision.sam(inputs.pixels)

    def encode_views(self, inputs: DevicePage, sam: list[torch.Tensor], clock: StageClock) -> torch.Tensor:
        """The view encoder (timed as its family's stage, `vision/clip` or `vision/qwen2`) and the
        projector over `encode_sam`'s features → the (N, hidden) image embeddings, laid out."""
        with clock.stage(self.family.encoder_stage):
            encoded = self.runners.vision.views(sam)
        with clock.stage("vision/projector"):
            tokens = [self.runners.vision.project(e, s) for e, s in zip(encoded, sam, strict=True)]
            global_tokens, local_tokens = tokens[0][0], (tokens[1] if len(tokens) > 1 else None)
            return self.model.layout(global_tokens, local_tokens, inputs.page.crop_grid)

    def start_job(
        self,
        page: preprocess.PreparedPage,
        options: DecodeOptions,
        max_new_tokens: int | None,
        clock: StageClock,
    ) -> PageJob:
        """Setup: the job's token budget, its cache bucket, the page's inputs to the device (the ids
        straight into the bucket's token buffer) and the n-gram state: a few asynchronous copies and
        launches, no reset of the cache (`DecodeBuffers.start`). Call this and the next steps under
        `torch.inference_mode()`."""
        validate_options(options)
        budget, ceiling = self._budget(page.prompt_tokens, max_new_tokens)
        with clock.stage("setup"):
            buffers = self.buffers_for(page.prompt_tokens + budget)
            if options.seed is not None:
                torch.manual_seed(options.seed)
            inputs = self.upload(page, buffers.tokens[: page.prompt_tokens])
            ban = buffers.start(page.prompt_tokens, options)
        return PageJob(inputs, buffers, ban, options, budget, ceiling)

    def prefill(self, job: PageJob, clock: StageClock) -> torch.Tensor:
        """Vision + LM prefill, then the first token, chosen from the last position's logits (returned,
        for checks)."""
        inputs = job.inputs
        injects_image = inputs.page.injects_image
        with clock.stage("prefill"):
            image_embeds = self.encode_image(inputs, clock) if injects_image else None
            with clock.stage("lm_prefill"):
                logits = self.lm_prefill(inputs, image_embeds, job.buffers.cache)
        job.vision_calls = int(injects_image)
        with clock.stage("first_token"):
            choose_token(logits, job.ban, job.options)
        return logits

    def lm_prefill(
        self, inputs: DevicePage, image_embeds: torch.Tensor | None, cache: StaticCache
    ) -> torch.Tensor:
        """The prompt's embeddings (`prompt_embeds`) through the language model into `cache` (a batch-1
        job's, or the batched engine's scratch); the last position's logits."""
        return self.runners.prefill(self.model, self.prompt_embeds(inputs, image_embeds), cache)

    def prompt_embeds(self, inputs: DevicePage, image_embeds: torch.Tensor | None) -> torch.Tensor:
        """The prompt's embeddings with the image's placed at its placeholders, [1, L, hidden]: what the
        LM prefill takes."""
        embeds = self.model.embed(inputs.input_ids).unsqueeze(0)
        if image_embeds is not None:
            embeds[0].index_copy_(0, inputs.image_positions, image_embeds.to(embeds.dtype))
        return embeds

    def decode(
        self,
        job: PageJob,
        clock: StageClock,
        after_step: Callable[[int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Run decode steps (compiled and graphed in `fast`) until the budget is spent, EOS was seen
        (EosWatch: no stall of the device) or, when asked, the output ends in a repetition loop
        (RepetitionWatch, the same way). Sets `job.steps`, including any that ran past EOS, and
        `job.repeating`. `after_step(steps)` runs after each step, for checks (it may read the cache
        or force the next token: a sync a timed job would not have); `on_progress(steps, budget)` at
        the watches' cadence."""
        buffers, ban, options, budget = job.buffers, job.ban, job.options, job.budget
        model, step = self.model, self.runners.decode_step
        eos = EosWatch(buffers, job.prompt_tokens, enabled=not options.ignore_eos)
        loops = RepetitionWatch(buffers, job.prompt_tokens, enabled=options.stop_on_repetition)
        steps = 0
        with clock.stage("decode"):
            clock.mark_step()
            while steps < budget - 1 and not eos.seen(steps):
                if loops.seen(steps):
                    job.repeating = True
                    break
                step(model, buffers.cache, ban, options)
                steps += 1
                clock.mark_step()
                if after_step is not None:
                    after_step(steps)
                if on_progress is not None and steps % EOS_CHECK_INTERVAL == 0:
                    on_progress(steps, budget)
        job.steps = steps

    def read_output(self, job: PageJob, clock: StageClock) -> tuple[list[int], StopReason]:
        """Read the output back (waits for the device), trim what was computed past EOS and name the
        reason decoding stopped (EOS first: a loop seen after an EOS already written is past the end
        of the output)."""
        with clock.stage("readback"):
            written = job.buffers.read_tokens(job.prompt_tokens, job.prompt_tokens + 1 + job.steps)
        output = trim_at_eos(written, job.options)
        reason = stop_reason(output, job.budget, job.ceiling, job.options, repeating=job.repeating)
        assert reason is not None, "decode stops only at EOS, a loop or the budget"
        return output, reason

    def run_inference(
        self,
        image: str | os.PathLike | bytes | Image.Image,
        prompt: str | None = None,
        mode: str | None = None,
        max_new_tokens: int | None = None,
        infer: DecodeOptions | None = None,
        job_id: str | None = None,
        return_text: bool = True,
        max_crops: int | None = None,
        clock: StageClock | None = None,
        on_decode_progress: Callable[[int, int], None] | None = None,
        after_step: StepHook | None = None,
    ) -> InferenceResult:
        """preprocess → setup → prefill (vision + LM) → first token → decode → readback → postprocess.
        Every part is timed (StageTimings says how they add up to end-to-end). `on_decode_progress(steps,
        budget)` is called at the EOS watch's cadence (every EOS_CHECK_INTERVAL steps, host side: on CUDA
        the steps launched, which the device finishes shortly after), for a progress display. `after_step`:
        `run_on_device`'s."""
        prepared = self.prepare_job(image, prompt, mode, job_id, max_crops, clock)
        return self.run_on_device(
            prepared.page,
            max_new_tokens,
            infer,
            clock=prepared.clock,
            return_text=return_text,
            on_decode_progress=on_decode_progress,
            after_step=after_step,
        ).finish()

    def run_on_device(
        self,
        page: preprocess.PreparedPage,
        max_new_tokens: int | None = None,
        infer: DecodeOptions | None = None,
        clock: StageClock | None = None,
        job_id: str | None = None,
        return_text: bool = True,
        on_decode_progress: Callable[[int, int], None] | None = None,
        after_step: StepHook | None = None,
        before_decode: Callable[[], None] | None = None,
        before_readback: Callable[[], None] | None = None,
        profiler: JobProfiler | None = None,
    ) -> DeviceRun:
        """The one job sequence from setup on, for a page prepared already: setup → prefill → decode →
        readback and stop rule, with what must be read before the device's next job (its peak memory,
        its cold paths). `DeviceRun.finish()` does the rest on the host, on any thread, while the device
        runs the next job. `clock` holds its `preprocess` stage where that was timed (`prepare_job`: a
        page prepared ahead; the time it waited since is `page_wait_ms`, outside e2e); on a fresh clock
        the job's timings start at setup.
        Hooks: `before_decode()` once the prefill is queued (the farm lets its ledger writes go there);
        `before_readback()` once the decode is queued (the farm waits there for the job's claim; raising
        ends the job); `after_step(job, step)` after the first token (step 0) and each decode
        step, for the warm-up, checks and benchmarks (`force_eos_at`); `on_decode_progress(steps,
        budget)` at the EOS watch's cadence. `profiler`: the job runs under it (engine/profiling.py) from
        its setup to its readback; its trace and kernels come with the result."""
        clock = clock or self.new_clock(job_id)
        if profiler is not None:
            clock.profiler = profiler
            profiler.start()
        try:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # this job's peak, not the process's
            before = self._cold_probe()
            self._new_buckets.clear()
            with torch.inference_mode():
                job = self.start_job(page, infer or DecodeOptions(), max_new_tokens, clock)
                resident = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
                self.prefill(job, clock)
                if after_step is not None:
                    after_step(job, 0)
                if before_decode is not None:
                    before_decode()
                each_step = None if after_step is None else (lambda steps: after_step(job, steps))
                self.decode(job, clock, after_step=each_step, on_progress=on_decode_progress)
                if before_readback is not None:
                    before_readback()
                generated, stop = self.read_output(job, clock)
        finally:  # a profiled job that fails stops its profiler: the process's next job may be profiled too
            if profiler is not None:
                profiler.stop()
        memory = None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            memory = JobMemory(peak, self.weights_bytes, job.buffers.cache_bytes, peak - resident)
        self.jobs_run += 1
        return DeviceRun(
            self,
            page,
            clock,
            generated,
            stop,
            kv_length=job.kv_length,
            vision_calls=job.vision_calls,
            wasted_steps=job.steps + 1 - len(generated),
            memory=memory,
            cold_reasons=self._cold_reasons(before),
            return_text=return_text,
        )

    def capture_prefill(self, length: int, max_new_tokens: int | None) -> bool:
        """Capture the LM prefill graph of a `length`-token prompt in the cache bucket its job will use,
        where the engine replays its prefill as CUDA graphs (`Runners.prefill_graphs`): what a warm-up
        readies ahead of jobs. False where the engine has none."""
        graphs = self.runners.prefill_graphs
        if graphs is None:
            return False
        with torch.inference_mode():  # as jobs run: a compiled layer guards on it
            buffers = self.buffers_for(length + self._budget(length, max_new_tokens)[0])
            graphs.capture(self.model, length, buffers.cache)
        return True

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _budget(self, prompt_tokens: int, max_new_tokens: int | None) -> tuple[int, int]:
        """The job's token budget and the most the model's positions allow."""
        ceiling = self.max_positions - prompt_tokens
        if ceiling < 1:
            raise InputError(
                f"the prompt takes {prompt_tokens} positions; the model has {self.max_positions}"
            )
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return min(ceiling if max_new_tokens is None else max_new_tokens, ceiling), ceiling

    def _cold_probe(self) -> _ColdProbe:
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        graphs = self.runners.prefill_graphs
        prefill_graphs = graphs.captured if graphs is not None else 0
        decode_graphs = getattr(self.runners.decode_step, "captured", 0)  # GraphedDecode's
        return _ColdProbe(dynamo_graphs(), prefill_graphs, decode_graphs, reserved)

    def _cold_reasons(self, before: _ColdProbe) -> tuple[str, ...]:
        """Why this job met a cold path, if it did: read from counters, never from timings."""
        after = self._cold_probe()
        reasons = []
        if self.jobs_run == 1:
            reasons.append(FIRST_JOB)
        reasons.extend(NEW_BUCKET.format(capacity) for capacity in self._new_buckets)
        if after.graphs > before.graphs:
            reasons.append(f"compiled {after.graphs - before.graphs} new graph(s)")
        if after.prefill_graphs > before.prefill_graphs:
            reasons.append("captured the LM prefill graph of a new prompt length")
        if after.decode_graphs > before.decode_graphs:
            reasons.append("captured the decode step's graph for a new cache bucket or decode options")
        if after.reserved_bytes > before.reserved_bytes:
            grown = (after.reserved_bytes - before.reserved_bytes) / 2**20
            reasons.append(f"the CUDA allocator reserved {grown:.0f} MiB more")
        return tuple(reasons)

    def decode_text(self, token_ids: list[int]) -> str:
        """The vendor's output text: special tokens kept, a trailing EOS removed, stripped."""
        text = self.tokenizer.decode(token_ids)
        text = text.removesuffix(self.tokenizer.decode([EOS_TOKEN_ID]))
        return text.strip()
