"""`DeepSeekOCRSession`: a loaded model on one device plus the split inference loop with stage timings.

    session = DeepSeekOCRSession.from_local("tiny" | "full" | "/path/to/DeepSeek-OCR", device="cuda:0")
    result = session.run_inference("page.png", mode="gundam", max_new_tokens=512)

A job is one sequence of steps, written once here: `start_job` (setup: cache bucket, inputs to the
device, n-gram state) → `prefill` (vision, LM prefill, first token) → `decode` → `read_output`.
`run_inference` times and reports them; `dsocr verify` and the benchmarks call the same steps, with a
hook between decode steps where they read the cache or force the next token.

Engines: `eager` is plain PyTorch — the vendor's attention (fp32 softmax) and the vendor's expert
dispatch — and the numerical reference. `fast` uses SDPA, fused q/k/v and gate/up projections, Triton
GEMVs over the selected experts at decode (grouped GEMMs for a prompt), vision encoders compiled block
by block, a compiled LM prefill and a compiled decode step replayed as a CUDA graph; on a CPU it says so
and runs eager.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from dsocr_workers import settings
from dsocr_workers.engine.compile_cache import use_compile_cache
from dsocr_workers.engine.generate import (
    EOS_CHECK_INTERVAL,
    DecodeBuffers,
    EosWatch,
    RepetitionWatch,
    cache_bucket,
    choose_token,
    decode_one_token,
    prefill,
)
from dsocr_workers.engine.loops import find_loop
from dsocr_workers.engine.precompile import (
    PROCESSES_ENV,
    CompileHelpers,
    CompilePlan,
    PrecompileReport,
    helper_processes,
    warm_marker,
)
from dsocr_workers.engine.regions import (
    PREFILL_BUCKET,
    GraphedPrefill,
    GraphedVision,
    RegionalPrefill,
    RegionalVision,
    configure_dynamo,
    padded_length,
)
from dsocr_workers.engine.result import DecodeOptions, InferenceResult, JobMemory, ModelSource, StopReason
from dsocr_workers.engine.sampling import NGramBan, validate_options
from dsocr_workers.engine.stages import StageClock
from dsocr_workers.errors import InputError
from dsocr_workers.model import postprocess, preprocess
from dsocr_workers.model.checkpoint import LoadedModel, build_preset, load_checkpoint
from dsocr_workers.model.config import AUTO_ENGINE, ENGINE_CHOICES, EOS_TOKEN_ID, PRESETS, get_mode
from dsocr_workers.model.experts import VENDOR_LOOP
from dsocr_workers.model.fused import fuse_projections
from dsocr_workers.model.modeling import DeepSeekOCR
from dsocr_workers.model.sam_attention import fold_relative_positions
from dsocr_workers.model.sam_mlp import fuse_gelu_into_lin1
from dsocr_workers.model.sam_patches import embed_patches_by_matmul
from dsocr_workers.model.tokenizer import OCRTokenizer

log = logging.getLogger(__name__)

WARMUP_MAX_PASSES = 4

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"unknown device {device!r}: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} asked for, but CUDA is not available here")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def make_current(device: torch.device) -> None:
    """A session's process drives one GPU (a worker child, `dsocr infer`): its device becomes the current
    one, so that what runs on the current device (a CUDA graph's capture stream, CUDA events, the
    default stream, a synchronisation) runs on it. Otherwise a worker child on cuda:1 captured its
    graphs on a stream of cuda:0 while its kernels ran on cuda:1 (its warm-up failed, "operation not
    permitted when stream is capturing": 2 × H200, docs/benchmarks.md), its events would time cuda:0's
    stream, and it kept a context on cuda:0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def set_numerics(device: torch.device, dtype: torch.dtype) -> None:
    """float32 means float32: cuDNN runs float32 convolutions in TF32 unless told not to (matmuls are
    full float32 by default), which set the eager reference's SAM convolutions ~2e-3 away from the fast
    engine's patch-embedding GEMM on an H200. bf16 sessions are unaffected."""
    if device.type == "cuda" and dtype == torch.float32:
        torch.backends.cudnn.allow_tf32 = False


def engine_kernels(engine: str) -> dict[str, str]:
    """The attention and routed-expert implementations an engine loads the model with (the fast engine
    also swaps modules after loading: `fast_modules`)."""
    if engine == "fast":
        # Imported here: Triton comes with CUDA builds of torch, and only the fast engine needs it.
        from dsocr_workers.model.selected_experts import SELECTED_EXPERTS

        return {"attn_implementation": "sdpa", "experts_implementation": SELECTED_EXPERTS}
    return {"attn_implementation": "eager", "experts_implementation": VENDOR_LOOP}


def fast_modules(model: DeepSeekOCR) -> None:
    """The fast engine's module swaps after loading (checkpoints keep the vendor layout): fused decoder
    projections (`model.fused`), then SAM's (`fast_vision_modules`)."""
    fuse_projections(model.language_model)
    fast_vision_modules(model)


def fast_vision_modules(model: DeepSeekOCR) -> None:
    """SAM's swaps: relative positions as query/key channels (`model.sam_attention`), the MLP's GELU in
    the first GEMM (`model.sam_mlp`) and the patch embedding as a GEMM (`model.sam_patches`). Also what
    a vision compile helper builds (engine/compile_helper.py)."""
    fold_relative_positions(model.sam)
    fuse_gelu_into_lin1(model.sam)
    embed_patches_by_matmul(model.sam)


@dataclass(frozen=True)
class FastCompile:
    """What the fast engine compiles, and with which backend. The defaults are the engine: inductor
    compiles the vision encoders, the LM prefill and the decode step, which it replays as a CUDA graph.
    A CPU test traces the decode step alone (`decode_only`) with a backend that generates no code
    ("aot_eager"): the same single graph, while inductor's build of the rest takes minutes on a CPU."""

    backend: str = "inductor"
    decode_only: bool = False
    # One graph per vision block kind for every tile count (engine/regions.py); False: a graph per count,
    # as before (benchmarks/bench_coldstart.py compares the two).
    dynamic_tiles: bool = True
    # On CUDA, vision replayed as a CUDA graph per page shape and the LM prefill per padded prompt length
    # (engine/regions.py GraphedVision, GraphedPrefill); False: the compiled blocks called one by one.
    cuda_graphs: bool = True

    @property
    def decode_mode(self) -> str | None:
        return "reduce-overhead" if self.backend == "inductor" else None


@dataclass
class _Vision:
    """The vision stages over a page's view groups (the global view, then the tiles if any): plain
    methods (eager), compiled block by block (fast), replayed as CUDA graphs (fast on CUDA)."""

    sam: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    clip: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @classmethod
    def per_group(cls, sam: Callable[[torch.Tensor], torch.Tensor], clip: Callable[[torch.Tensor], torch.Tensor],
                  project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> _Vision:  # fmt: skip
        return cls(lambda groups: [sam(g) for g in groups], lambda features: [clip(f) for f in features], project)


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
    ran: `run_on_device(prepared.page, clock=prepared.clock).finish()` runs the rest of the job. Made on any
    thread (host work only: the page reaches the device in the job's setup), e.g. while another job
    has the device."""

    page: preprocess.PreparedPage
    clock: StageClock


@dataclass
class Job:
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


@dataclass(frozen=True)
class WarmupReport:
    ms: float
    shapes: list[str]  # "mode" or "mode:colsxrows", in the order they ran
    passes: int  # over all shapes, until one met no cold path
    # What the last pass still met, per shape ("mode:grid: reason"): empty when it came clean, so
    # the first jobs will not be cold either.
    still_cold: tuple[str, ...] = ()
    # The prompt lengths (the warm-up's prompt) whose LM prefill is ready: from its shortest page to the
    # longest prompt any crop grid of its modes makes, which its `n x 1` strips do not reach.
    prompt_lengths: tuple[int, int] = (0, 0)
    # The compile helpers (engine/precompile.py), when they ran; `precompile_skipped` says why not.
    precompile: PrecompileReport | None = None
    precompile_skipped: str = ""
    # Where `ms` went, in order; the parts add up to it: "prepare" (the pages' preprocessing, once for
    # every pass); with helpers, "vision helpers" (waiting for them), "vision" (each page's vision
    # stages: their graphs traced and loaded from the cache, captured), "prefill helper", "prefill"
    # (each page's LM prefill and the prefill captures, likewise), "decode helper"; then "pass 1",
    # "pass 2", ... (each with its prefill captures).
    phases_ms: dict[str, float] = field(default_factory=dict)


def warmup_pages(modes: Sequence[str], max_crops: int = 9) -> list[tuple[str, Image.Image]]:
    """Synthetic pages that reach every compiled vision shape of `modes`: one page per fixed mode;
    for crop modes one page without tiles and one per tile count (a `n x 1` strip of 640-px tiles)."""
    pages = []
    for name in modes:
        mode = get_mode(name)
        if not mode.crop_mode:
            pages.append((name, Image.new("RGB", (mode.image_size, mode.image_size), "white")))
            continue
        side = preprocess.TILE_SIZE
        pages.append((name, Image.new("RGB", (side, side), "white")))
        pages.extend((name, Image.new("RGB", (side * n, side), "white")) for n in range(2, max_crops + 1))
    return pages


def _warm_options(infer: DecodeOptions | None) -> DecodeOptions:
    """A warm-up's decode options: the jobs' (`infer`), with EOS forced early: decode only has to be
    compiled and captured, in the bucket jobs will use; the EOS watch runs too (a job that ignores EOS
    runs the same compiled step, without it). Passes repeat until one meets no cold path: CUDA graph
    trees run a new graph once before they capture it, at its second call (measured: the capture grows
    the allocator by ~1 GiB)."""
    return replace(infer or DecodeOptions(), force_eos_at_step=2, ignore_eos=False)


def compile_plan(
    source: str, device: torch.device, dtype: torch.dtype, kernels: dict[str, str], fast_compile: FastCompile,
    modes: Sequence[str], max_new_tokens: int | None, infer: DecodeOptions | None, max_crops: int = 9,
) -> CompilePlan | None:  # fmt: skip
    """What a fast warm-up's graphs depend on (engine/precompile.py), or None when inductor compiles none.
    `kernels`: the model's attention and expert implementations (`engine_kernels`)."""
    if fast_compile.decode_only or fast_compile.backend != "inductor" or not modes:
        return None
    return CompilePlan(
        source=source, device=str(device), dtype=str(dtype).removeprefix("torch."), **kernels,
        backend=fast_compile.backend, dynamic_tiles=fast_compile.dynamic_tiles, cuda_graphs=fast_compile.cuda_graphs,
        max_crops=max_crops, modes=tuple(modes), max_new_tokens=max_new_tokens, options=infer or DecodeOptions(),
    )  # fmt: skip


def start_compile_helpers(
    source: str | os.PathLike, device: str, dtype: str | None, engine: str, modes: Sequence[str],
    max_new_tokens: int | None = None, infer: DecodeOptions | None = None, max_crops: int = 9,
    fast_compile: FastCompile = FastCompile(),
) -> CompileHelpers | None:  # fmt: skip
    """Fork the compile helpers of a warm-up before its model is loaded: call after the imports, before
    anything initialises CUDA or starts a thread in this process; hand them to `warmup(helpers=...)`.
    They begin compiling at once, with the imports done, while this process loads its checkpoint
    (engine/precompile.py). None where nothing would be compiled, no helper is wanted
    (DSOCR_COMPILE_PROCESSES=0), or CUDA is initialised here already (the warm-up then spawns them if
    the cache is cold). A helper that finds the compile cache warm for this plan exits at once."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", 0)  # as resolve_device names it; asking CUDA here would initialise it
    if engine == AUTO_ENGINE:
        engine = "fast" if resolved.type == "cuda" else "eager"
    if engine != "fast" or resolved.type != "cuda":  # the fast engine runs eager on a CPU (from_local)
        return None
    name = os.fspath(source)
    name = name if name in PRESETS else str(Path(name).resolve())  # as from_local names a checkpoint
    plan = compile_plan(name, resolved, resolve_dtype(dtype, resolved), engine_kernels(engine), fast_compile, modes,
                        max_new_tokens, infer, max_crops)  # fmt: skip
    processes = helper_processes()
    if plan is None or processes == 0 or torch.cuda.is_initialized():
        return None
    return CompileHelpers.start(plan, processes, fork=True)


@dataclass
class _ColdProbe:
    """What a job can find changed when it meets a cold path: counted before, compared after."""

    graphs: int
    prefill_graphs: int
    reserved_bytes: int


@dataclass(frozen=True)
class DeviceRun:
    """A job whose device part is done (`DeepSeekOCRSession.run_on_device`): its tokens are on the host.
    `finish()` is the host's part (decoding and parsing the text, the timings resolved from the job's
    CUDA events, the loop analysis); it reads nothing the device's next job changes."""

    session: DeepSeekOCRSession
    page: preprocess.PreparedPage
    job: Job
    clock: StageClock
    generated: list[int]
    stop_reason: StopReason
    memory: JobMemory | None
    cold_reasons: tuple[str, ...]
    return_text: bool = True

    def finish(self) -> InferenceResult:
        session, page, clock, generated = self.session, self.page, self.clock, self.generated
        with clock.stage("postprocess"):
            text = session.decode_text(generated) if self.return_text else ""
            parsed = postprocess.parse_markup(text, *page.original.size)
        clock.finish()
        # Analysis, not inference: outside the stages, so it is no part of the job's timings.
        loop = None if self.stop_reason == "eos" else find_loop(generated)
        return InferenceResult(
            text=text,
            token_ids=generated,
            stop_reason=self.stop_reason,
            prompt_tokens=page.prompt_tokens,
            image_tokens=page.image_tokens,
            crop_grid=page.crop_grid,
            mode=page.mode.name,
            image_size=page.original.size,
            timings=clock.stage_timings(kept_steps=len(generated) - 1),
            boxes=postprocess.boxes_json(parsed),
            skipped_spans=parsed.skipped_spans,
            memory=self.memory,
            engine=session.engine,
            device=str(session.device),
            dtype=str(session.dtype).removeprefix("torch."),
            model=session.source,
            kv_length=self.job.kv_length,
            vision_calls=self.job.vision_calls,
            wasted_steps=self.job.steps + 1 - len(generated),
            cold_reasons=self.cold_reasons,
            loop=loop,
            device_span=clock.device_span(),
        )


@dataclass
class DeepSeekOCRSession:
    loaded: LoadedModel
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    engine: str
    engine_note: str = ""
    fast_compile: FastCompile = FastCompile()
    # NVTX ranges and stage timings for its jobs' clocks (`new_clock`); off only to measure what they cost.
    instrumented: bool = True
    _vision: _Vision = field(init=False)
    _prefill: Callable = field(init=False)
    _decode_step: Callable = field(init=False)
    _prefill_graphs: GraphedPrefill | None = field(init=False, default=None)
    _buffers: dict[int, DecodeBuffers] = field(init=False, default_factory=dict)
    _new_buckets: list[int] = field(init=False, default_factory=list)  # allocated since the last job began
    _jobs_run: int = field(init=False, default=0)
    weights_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        model = self.loaded.model
        make_current(self.device)
        set_numerics(self.device, self.dtype)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        self._vision = _Vision.per_group(model.encode_sam, model.encode_clip, model.project)
        self._prefill = prefill
        self._decode_step = decode_one_token
        if self.engine != "fast":
            return
        # Vision: SAM and CLIP compiled block by block (engine/regions.py), per view size and kind of
        # block, dynamic in the tile count, and on CUDA replayed as a CUDA graph per page shape. The
        # projector (a concatenation and one linear layer) stays eager: on an H200 it ran in 0.22 ms
        # eager and 0.48 ms compiled (docs/benchmarks.md, vendor side by side). LM prefill: compiled layer
        # by layer (engine/regions.py), one graph per kind of layer, dynamic in the prompt length.
        # Decode: one graph per cache bucket (fullgraph: a break would be a host round trip per
        # token), replayed as a CUDA graph.
        configure_dynamo()
        cache = use_compile_cache()
        if cache is not None:
            log.info("compiled kernels persist in %s", cache)
        backend = self.fast_compile.backend
        if not self.fast_compile.decode_only:
            regions = RegionalVision(model, backend, self.fast_compile.dynamic_tiles)
            if self.device.type == "cuda" and self.fast_compile.cuda_graphs:
                graphed = GraphedVision(regions)
                self._vision = _Vision(graphed.sam, graphed.clip, model.project)
                self._prefill = self._prefill_graphs = GraphedPrefill(RegionalPrefill(backend))
            else:
                self._vision = _Vision(regions.encode_sam, regions.encode_clip, model.project)
                self._prefill = RegionalPrefill(backend)
        self._decode_step = torch.compile(decode_one_token, backend=backend, mode=self.fast_compile.decode_mode,
                                          fullgraph=True)

    @classmethod
    def from_local(
        cls,
        source: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        engine: str = "eager",
        seed: int = 0,
        fast_compile: FastCompile = FastCompile(),
        instrumented: bool | None = None,
    ) -> DeepSeekOCRSession:
        """Load a preset (`tiny`, `full`: seeded random weights) or a vendor checkpoint directory.
        `instrumented`: None reads `DSOCR_INSTRUMENTATION`, here and only here."""
        if engine not in ENGINE_CHOICES:
            raise InputError(f"unknown engine {engine!r}; engines: {', '.join(ENGINE_CHOICES)}")
        resolved = resolve_device(device)
        make_current(resolved)  # before loading: nothing of this process lands on another GPU
        if engine == AUTO_ENGINE:
            engine = "fast" if resolved.type == "cuda" else "eager"
        torch_dtype = resolve_dtype(dtype, resolved)
        note = ""
        if engine == "fast" and resolved.type != "cuda":
            note = "the fast engine needs CUDA (compiled CUDA-graph decode); running the eager engine on the CPU"
            log.warning(note)
            engine = "eager"
        kernels = engine_kernels(engine)
        name = os.fspath(source)
        with torch.inference_mode():
            if name in PRESETS:
                loaded = build_preset(name, seed=seed, device=resolved, dtype=torch_dtype, **kernels)
                model_source = ModelSource("preset", name, random_weights=True, seed=seed,
                                           fingerprint=loaded.fingerprint)
            else:
                loaded = load_checkpoint(Path(name), device=resolved, dtype=torch_dtype, **kernels)
                # A preset saved with `dsocr model save-preset` stays labelled as random weights.
                model_source = ModelSource("checkpoint", str(Path(name).resolve()),
                                           random_weights=loaded.preset is not None, seed=loaded.seed,
                                           fingerprint=loaded.fingerprint)
        if engine == "fast":
            fast_modules(loaded.model)
        instrumented = settings.read(settings.INSTRUMENTATION) if instrumented is None else instrumented
        return cls(loaded, model_source, resolved, torch_dtype, engine, note, fast_compile, instrumented)

    @property
    def model(self) -> DeepSeekOCR:
        return self.loaded.model

    @property
    def tokenizer(self) -> OCRTokenizer:
        return self.loaded.tokenizer

    @property
    def max_positions(self) -> int:
        return self.loaded.config.text.max_position_embeddings

    def buffers_for(self, needed: int) -> DecodeBuffers:
        """The static decode state (KV cache, token buffer) of the bucket that holds `needed` positions."""
        capacity = cache_bucket(needed, self.max_positions)
        if capacity not in self._buffers:
            self._buffers[capacity] = DecodeBuffers.allocate(self.model, capacity, self.device)
            self._new_buckets.append(capacity)
        return self._buffers[capacity]

    # --- one job ------------------------------------------------------------------------------------

    def new_clock(self, job_id: str | None = None) -> StageClock:
        """A job's clock, instrumented as this session is."""
        return StageClock(self.device, job_id=job_id, nvtx_enabled=self.instrumented, timing_enabled=self.instrumented)

    def prepare(
        self, image: str | os.PathLike | bytes | Image.Image, prompt: str | None, mode: str, max_crops: int
    ) -> preprocess.PreparedPage:
        return preprocess.prepare_page(image, self.tokenizer.encode, mode=mode, prompt=prompt, max_crops=max_crops)

    def prepare_job(
        self, image: str | os.PathLike | bytes | Image.Image, prompt: str | None = None, mode: str = "gundam",
        job_id: str | None = None, max_crops: int = 9, clock: StageClock | None = None,
    ) -> PreparedJob:  # fmt: skip
        """A job's `preprocess` stage, on `clock` (None: a new one for `job_id`): the first step of
        `run_inference`."""
        clock = clock or self.new_clock(job_id)
        with torch.inference_mode(), clock.stage("preprocess"):
            page = self.prepare(image, prompt, mode, max_crops)
        return PreparedJob(page, clock)

    def upload(self, page: preprocess.PreparedPage) -> DevicePage:
        """The page's inputs to the device, asynchronously. Bytes cross as uint8 and are normalised
        there (eager ops: bit-identical to the CPU)."""
        groups = [page.global_pixels] if page.tile_pixels is None else [page.global_pixels, page.tile_pixels]
        return DevicePage(
            page,
            page.input_ids.to(self.device, non_blocking=True),
            [preprocess.normalize_pixels(g.to(self.device, non_blocking=True), self.dtype) for g in groups],
            # Placeholder positions come from the host copy of the mask: a boolean index on the device
            # would sync (nonzero) and stall the GPU between vision and LM.
            page.images_seq_mask.nonzero().squeeze(1).to(self.device, non_blocking=True),
        )

    def encode_image(self, inputs: DevicePage, clock: StageClock) -> torch.Tensor:
        """Vision stages → the (N, hidden) image embeddings in the vendor's layout."""
        # The global view first, then the tiles (if any) as one batch: one call per view group.
        with clock.stage("vision/sam"):
            sam = self._vision.sam(inputs.pixels)
        with clock.stage("vision/clip"):
            clip = self._vision.clip(sam)
        with clock.stage("vision/projector"):
            tokens = [self._vision.project(c, s) for c, s in zip(clip, sam, strict=True)]
            global_tokens, local_tokens = tokens[0][0], (tokens[1] if len(tokens) > 1 else None)
            return self.model.layout(global_tokens, local_tokens, inputs.page.crop_grid)

    def start_job(
        self, page: preprocess.PreparedPage, options: DecodeOptions, max_new_tokens: int | None, clock: StageClock
    ) -> Job:
        """Setup: the job's token budget, its cache bucket (reset), the page's inputs to the device and
        the n-gram state. Call this and the next steps under `torch.inference_mode()`."""
        validate_options(options)
        budget, ceiling = self._budget(page.prompt_tokens, max_new_tokens)
        with clock.stage("setup"):
            buffers = self.buffers_for(page.prompt_tokens + budget)
            if options.seed is not None:
                torch.manual_seed(options.seed)
            inputs = self.upload(page)
            ban = buffers.start(inputs.input_ids, options)
        return Job(inputs, buffers, ban, options, budget, ceiling)

    def prefill(self, job: Job, clock: StageClock) -> torch.Tensor:
        """Vision + LM prefill, then the first token, chosen from the last position's logits (returned,
        for checks)."""
        inputs = job.inputs
        injects_image = inputs.page.injects_image
        with clock.stage("prefill"):
            image_embeds = self.encode_image(inputs, clock) if injects_image else None
            with clock.stage("lm_prefill"):
                logits = self.lm_prefill(job, image_embeds)
        job.vision_calls = int(injects_image)
        with clock.stage("first_token"):
            choose_token(logits, job.ban, job.options)
            self._force_eos(job, 0)
        return logits

    def lm_prefill(self, job: Job, image_embeds: torch.Tensor | None) -> torch.Tensor:
        """The prompt's embeddings with the image's placed at its placeholders, through the language
        model into the job's cache; returns the last position's logits."""
        inputs = job.inputs
        embeds = self.model.embed(inputs.input_ids).unsqueeze(0)
        if image_embeds is not None:
            embeds[0].index_copy_(0, inputs.image_positions, image_embeds.to(embeds.dtype))
        return self._prefill(self.model, embeds, job.buffers.cache)

    def decode(
        self, job: Job, clock: StageClock, after_step: Callable[[int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Run decode steps (compiled and graphed in `fast`) until the budget is spent, EOS was seen
        (EosWatch: no stall of the device) or, when asked, the output ends in a repetition loop
        (RepetitionWatch, the same way). Sets `job.steps`, including any that ran past EOS, and
        `job.repeating`. `after_step(steps)` runs after each step, for checks (it may read the cache
        or force the next token: a sync a timed job would not have); `on_progress(steps, budget)` at
        the watches' cadence."""
        buffers, ban, options, budget = job.buffers, job.ban, job.options, job.budget
        model, step = self.model, self._decode_step
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
                self._force_eos(job, steps)
                clock.mark_step()
                if after_step is not None:
                    after_step(steps)
                if on_progress is not None and steps % EOS_CHECK_INTERVAL == 0:
                    on_progress(steps, budget)
        job.steps = steps

    def read_output(self, job: Job, clock: StageClock) -> tuple[list[int], StopReason]:
        """Read the output back (waits for the device), trim what was computed past EOS and name the
        reason decoding stopped (EOS first: a loop seen after an EOS already written is past the end
        of the output)."""
        with clock.stage("readback"):
            written = job.buffers.read_tokens(job.prompt_tokens, job.prompt_tokens + 1 + job.steps)
        if not job.options.ignore_eos and EOS_TOKEN_ID in written:
            return written[: written.index(EOS_TOKEN_ID) + 1], "eos"
        if job.repeating:
            return written, "repetition"
        return written, "max_positions" if job.budget == job.ceiling else "max_new_tokens"

    def warmup(
        self, modes: Sequence[str], max_new_tokens: int | None = None, max_crops: int = 9,
        infer: DecodeOptions | None = None, helpers: CompileHelpers | None = None,
    ) -> WarmupReport:  # fmt: skip
        """Run every shape `modes` can produce until warm, so that jobs meet no compilation, no graph capture
        and no first use of a cache bucket (`max_new_tokens` sizes the buckets, as jobs will). `infer`:
        the jobs' decode options (default: the vendor's), since the compiled decode step is specialised on
        how tokens are chosen (the n-gram ban's size and window, sampling or greedy). Eager compiles
        nothing but runs every shape too: the allocator's pools grow to the largest page now.
        `helpers`: compile helpers started for this warm-up before the model was loaded
        (`start_compile_helpers`); otherwise a fast warm-up with an empty cache starts them now."""
        began = time.perf_counter()
        pages = warmup_pages(modes, max_crops)
        options = _warm_options(infer)
        plan, marker, skipped = self._plan_helpers(modes, max_new_tokens, max_crops, infer)
        if helpers is not None:
            skipped = ""
            if helpers.plan != plan:  # their graphs may not be this warm-up's: what they miss compiles here
                log.warning("compile helpers were started for another warm-up (%s); this one is %s", helpers.plan, plan)
        elif plan is not None and not skipped:
            helpers = CompileHelpers.start(plan, helper_processes())
        phases: dict[str, float] = {}
        mark = began

        def phase_ends(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[name], mark = (now - mark) * 1e3, now

        try:
            with torch.inference_mode():  # as run_inference prepares a page
                prepared = [(name, self.prepare(image, None, name, max_crops)) for name, image in pages]
            phase_ends("prepare")
            if helpers is not None:
                # Each part traced (its graphs loaded from the cache) and captured as soon as its helpers
                # are done, while the others still compile: the vision stages of every page, then the
                # LM prefills, then the passes once the decode step's helper is done too.
                helpers.wait("vision")
                phase_ends("vision helpers")
                with torch.inference_mode():
                    for _, page in prepared:
                        self.encode_image(self.upload(page), self.new_clock())
                self._synchronize()
                phase_ends("vision")
                helpers.wait("prefill")
                phase_ends("prefill helper")
                self._warm_pass(prepared, max_new_tokens, options, max_crops, decode=False)
                phase_ends("prefill")
                helpers.wait()
                phase_ends("decode helper")
        except BaseException:
            if helpers is not None:
                helpers.stop()  # none outlives a failed warm-up
            raise
        precompiled = helpers.report() if helpers is not None else None
        if precompiled is not None:
            log.info("compile helpers (%s): %d in %.1f s, %d graphs compiled, %d failed", precompiled.how,
                     precompiled.processes, precompiled.seconds, sum(r.graphs for r in precompiled.results),
                     len(precompiled.failures))  # fmt: skip
        passes = 0
        still_cold: list[str] = []
        shapes: list[str] = []
        shortest = longest = 0
        while passes < WARMUP_MAX_PASSES:
            passes += 1
            shapes, still_cold, (shortest, longest) = self._warm_pass(prepared, max_new_tokens, options, max_crops)
            phase_ends(f"pass {passes}")
            if not still_cold:
                break
        if marker is not None and not still_cold:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps({"modes": list(modes), "source": self.source.label}) + "\n")
            except OSError as exc:  # the next start runs the helpers again, nothing worse
                log.warning("could not mark the compile cache warm (%s): %s", marker, exc)
        return WarmupReport((mark - began) * 1e3, shapes, passes, tuple(still_cold), (shortest, longest),
                            precompiled, skipped, phases)  # fmt: skip

    def warm_language(
        self, modes: Sequence[str], max_new_tokens: int | None, max_crops: int = 9,
        infer: DecodeOptions | None = None, decode: bool = True,
    ) -> None:  # fmt: skip
        """One warm-up pass over the pages of `modes` without their images: the language model's graphs
        as `warmup` meets them (the LM prefill's layers and captures; the decode step per cache bucket),
        in the same order. `decode=False`: the prefills only. What the language compile helpers run
        (engine/compile_helper.py): one the prefill, one the decode step of a session that compiles only
        that (`FastCompile.decode_only`)."""
        with torch.inference_mode():
            prepared = [(name, self.prepare(image, None, name, max_crops)) for name, image in warmup_pages(modes, max_crops)]
        self._warm_pass(prepared, max_new_tokens, _warm_options(infer), max_crops, images=False, decode=decode)

    def _warm_pass(
        self, prepared: list[tuple[str, preprocess.PreparedPage]], max_new_tokens: int | None,
        options: DecodeOptions, max_crops: int, images: bool = True, decode: bool = True,
    ) -> tuple[list[str], list[str], tuple[int, int]]:  # fmt: skip
        """Every prepared page's job once (without its image, or its decode, when asked), then the
        prefill captures: the shapes met, the cold paths met, and the prompt lengths whose prefill is
        captured."""
        shapes: list[str] = []
        still_cold: list[str] = []
        shortest, longest = self.max_positions, 0
        for name, page in prepared:
            page = page if images else replace(page, injects_image=False)
            cols, rows = page.crop_grid
            shape = name if (cols, rows) == (1, 1) else f"{name}:{cols}x{rows}"
            shapes += [shape] if shape not in shapes else []
            if decode:
                result = self.run_on_device(page, max_new_tokens, options, return_text=False).finish()
                still_cold += [f"{shape}: {reason}" for reason in result.cold_reasons]
            else:
                with torch.inference_mode():
                    clock = self.new_clock()
                    self.prefill(self.start_job(page, options, max_new_tokens, clock), clock)
            shortest = min(shortest, page.prompt_tokens)
            text = page.prompt_tokens - page.image_tokens
            longest = max(longest, text + preprocess.most_image_tokens(get_mode(name), max_crops))
        self._capture_prefills(shortest, longest, max_new_tokens)
        self._synchronize()
        return shapes, still_cold, (shortest, longest)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _plan_helpers(
        self, modes: Sequence[str], max_new_tokens: int | None, max_crops: int, infer: DecodeOptions | None
    ) -> tuple[CompilePlan | None, Path | None, str]:
        """The compile plan of this warm-up (None when inductor compiles nothing for it), the marker to
        leave once warm, and why no helper should start now (empty: they should)."""
        text = self.model.language_model.config
        kernels = {"attn_implementation": text._attn_implementation, "experts_implementation": text._experts_implementation}
        plan = None
        if self.engine == "fast":
            plan = compile_plan(self.source.name, self.device, self.dtype, kernels, self.fast_compile, modes,
                                max_new_tokens, infer, max_crops)  # fmt: skip
        if plan is None:
            return None, None, "no mode to warm" if not modes else "nothing compiled by inductor"
        marker = warm_marker(plan, self.loaded.config)
        if marker.exists():
            return plan, marker, f"the compile cache is warm for this warm-up ({marker})"
        if helper_processes() == 0:
            return plan, marker, f"{PROCESSES_ENV}=0"
        if self._jobs_run:
            return plan, marker, "this session has compiled already"
        return plan, marker, ""

    def _capture_prefills(self, shortest: int, longest: int, max_new_tokens: int | None) -> None:
        """Capture the LM prefill graph of every padded prompt length from `shortest` to `longest`, in
        the cache bucket a prompt of that length will use. A grid's prompt length depends on its rows (a
        newline per row of tiles), not only on the tile count the warm-up's pages meet: every length
        between, not only theirs."""
        if self._prefill_graphs is None:
            return
        with torch.inference_mode():  # as jobs run: a compiled layer guards on it
            for padded in range(padded_length(shortest, self.max_positions), longest + PREFILL_BUCKET, PREFILL_BUCKET):
                # The bucket's shortest and longest prompts: their cache buckets may differ.
                for length in {max(shortest, padded - PREFILL_BUCKET + 1), min(longest, padded)}:
                    buffers = self.buffers_for(length + self._budget(length, max_new_tokens)[0])
                    self._prefill_graphs.capture(self.model, length, buffers.cache)

    def run_inference(
        self,
        image: str | os.PathLike | bytes | Image.Image,
        prompt: str | None = None,
        mode: str = "gundam",
        max_new_tokens: int | None = None,
        infer: DecodeOptions | None = None,
        job_id: str | None = None,
        return_text: bool = True,
        max_crops: int = 9,
        clock: StageClock | None = None,
        on_decode_progress: Callable[[int, int], None] | None = None,
    ) -> InferenceResult:
        """preprocess → setup → prefill (vision + LM) → first token → decode → readback → postprocess.
        Every part is timed (StageTimings says how they add up to end-to-end). `on_decode_progress(steps,
        budget)` is called at the EOS watch's cadence (every EOS_CHECK_INTERVAL steps, host side: on CUDA
        the steps launched, which the device finishes shortly after), for a progress display."""
        prepared = self.prepare_job(image, prompt, mode, job_id, max_crops, clock)
        return self.run_on_device(prepared.page, max_new_tokens, infer, clock=prepared.clock, return_text=return_text,
                                  on_decode_progress=on_decode_progress).finish()  # fmt: skip

    def run_on_device(
        self,
        page: preprocess.PreparedPage,
        max_new_tokens: int | None = None,
        infer: DecodeOptions | None = None,
        clock: StageClock | None = None,
        job_id: str | None = None,
        return_text: bool = True,
        on_decode_progress: Callable[[int, int], None] | None = None,
        after_prefill: Callable[[], None] | None = None,
    ) -> DeviceRun:
        """`run_inference` from setup on, for a page prepared already: the job's part on the device, up
        to its output read back (and what must be read before the device's next job: its peak memory,
        its cold paths); `DeviceRun.finish()` does the rest on the host, on any thread, while the
        device runs the next job. `clock` holds its `preprocess` stage where that was timed
        (`prepare_job`: a page prepared ahead, e.g. while the previous job ran; the time it waited since
        is `page_wait_ms`, outside e2e); on a fresh clock the job's timings start at setup. `after_prefill()` is called once the prefill and the first token are queued on the
        device: the place for host work that must not delay the job's start on the device but may
        share its time there (the farm starts preparing the next page, and waits for the job's claim)."""
        options = infer or DecodeOptions()
        clock = clock or self.new_clock(job_id)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # this job's peak, not the process's
        before = self._cold_probe()
        self._new_buckets.clear()
        with torch.inference_mode():
            job = self.start_job(page, options, max_new_tokens, clock)
            resident = torch.cuda.memory_allocated(self.device) if cuda else 0
            self.prefill(job, clock)
            if after_prefill is not None:
                after_prefill()
            self.decode(job, clock, on_progress=on_decode_progress)
            generated, stop_reason = self.read_output(job, clock)
            memory = None
            if cuda:
                peak = torch.cuda.max_memory_allocated(self.device)
                memory = JobMemory(peak, self.weights_bytes, job.buffers.cache_bytes, peak - resident)
        self._jobs_run += 1
        return DeviceRun(self, page, job, clock, generated, stop_reason, memory, self._cold_reasons(before),
                         return_text)  # fmt: skip

    def _budget(self, prompt_tokens: int, max_new_tokens: int | None) -> tuple[int, int]:
        """The job's token budget and the most the model's positions allow."""
        ceiling = self.max_positions - prompt_tokens
        if ceiling < 1:
            raise InputError(f"the prompt takes {prompt_tokens} positions; the model has {self.max_positions}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return min(ceiling if max_new_tokens is None else max_new_tokens, ceiling), ceiling

    def _cold_probe(self) -> _ColdProbe:
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        prefill_graphs = self._prefill_graphs.captured if self._prefill_graphs is not None else 0
        return _ColdProbe(torch._dynamo.utils.counters["stats"]["unique_graphs"], prefill_graphs, reserved)

    def _cold_reasons(self, before: _ColdProbe) -> tuple[str, ...]:
        """Why this job met a cold path, if it did: read from counters, never from timings."""
        after = self._cold_probe()
        reasons = []
        if self._jobs_run == 1:
            reasons.append("first job of this model in its process (not warmed up)")
        reasons.extend(f"first use of the {capacity}-position KV cache bucket" for capacity in self._new_buckets)
        if after.graphs > before.graphs:
            reasons.append(f"compiled {after.graphs - before.graphs} new graph(s)")
        if after.prefill_graphs > before.prefill_graphs:
            reasons.append("captured the LM prefill graph of a new prompt length")
        if after.reserved_bytes > before.reserved_bytes:
            grown = (after.reserved_bytes - before.reserved_bytes) / 2**20
            reasons.append(f"the CUDA allocator reserved {grown:.0f} MiB more")
        return tuple(reasons)

    @staticmethod
    def _force_eos(job: Job, step: int) -> None:
        """The benchmark and test hook: EOS overwrites the token of decode step `force_eos_at_step`
        (a device write, no sync; the compiled step is the same with or without it)."""
        if job.options.force_eos_at_step == step:
            job.write_token(step, EOS_TOKEN_ID)

    def decode_text(self, token_ids: list[int]) -> str:
        """The vendor's output text: special tokens kept, a trailing EOS removed, stripped."""
        text = self.tokenizer.decode(token_ids)
        text = text.removesuffix(self.tokenizer.decode([EOS_TOKEN_ID]))
        return text.strip()
