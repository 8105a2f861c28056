"""Typed results of one inference: what the engine hands to the farm, the CLI and the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from dsocr_workers.engine.loops import RepetitionLoop
from dsocr_workers.kernels import KernelSummary
from dsocr_workers.stages import StageTimings

# "repetition": stopped early by `stop_on_repetition` once the output ended in a loop (engine/loops.py).
StopReason = Literal["eos", "max_new_tokens", "max_positions", "repetition"]
STOP_REASONS: tuple[StopReason, ...] = ("eos", "max_new_tokens", "max_positions", "repetition")


@dataclass(frozen=True)
class ProfileCapture:
    """What torch.profiler left of a profiled job or of a batched engine's sampled step: its trace (Chrome
    trace JSON, gzip) and its kernels per stage."""

    trace_gz: bytes
    trace_bytes: int  # uncompressed
    summary: KernelSummary


@dataclass(frozen=True)
class DecodeOptions:
    """How tokens are chosen. The defaults are the vendor's `infer()`: greedy, no-repeat 20-grams over
    prompt + output, stop at EOS, at most the model's positions."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    no_repeat_ngram_size: int = 20
    # None: n-grams over the whole sequence (HF vendor path); an int: only the last `window` tokens
    # are searched (the vendor vLLM path's windowed variant).
    ngram_window: int | None = None
    # Token ids the no-repeat ban never bans (the vendor vLLM path: (128821, 128822) = <td>, </td>).
    ngram_whitelist: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Stop once the output ends in a repetition loop (stop reason "repetition"); off, the loop runs to
    # the budget and is only found afterwards. Checked with the EOS watch's cadence, on tokens read back
    # asynchronously: nothing is added to the decode loop when off.
    stop_on_repetition: bool = False


@dataclass(frozen=True)
class ModelSource:
    """Where the weights came from; random-weight presets are labelled as such everywhere."""

    kind: Literal["preset", "checkpoint"]
    name: str  # preset name or checkpoint directory
    random_weights: bool
    seed: int | None = None  # presets only
    fingerprint: str | None = None  # checkpoints: hash of config + index/safetensors headers

    @property
    def label(self) -> str:
        if self.kind == "preset":
            return f"preset:{self.name} (RANDOM WEIGHTS, seed {self.seed})"
        if self.random_weights:  # a preset saved as a checkpoint directory (`dsocr model save-preset`)
            return f"checkpoint:{self.name} (RANDOM WEIGHTS, seed {self.seed})"
        return f"checkpoint:{self.name}"


@dataclass(frozen=True)
class DeviceSpan:
    """When the device worked on the job, in seconds of this process's `time.perf_counter`: from the
    start of its setup to the end of its readback, and when its first token was chosen. On CUDA the
    times come from the job's events, anchored where the readback's wait for the device ended; on the
    CPU they are host readings. Between two jobs of one process the device idled from one's `finished_s`
    to the next one's `started_s`."""

    started_s: float
    first_token_s: float
    finished_s: float

    @property
    def ms(self) -> float:
        return (self.finished_s - self.started_s) * 1e3


@dataclass(frozen=True)
class JobMemory:
    """CUDA memory of one job (allocator statistics reset at its start). `peak` = what was resident when
    the job's compute began (weights, every cache bucket so far) + `activation_peak`."""

    peak_bytes: int
    weights_bytes: int
    kv_cache_bytes: int  # the cache bucket this job used
    activation_peak_bytes: int


@dataclass(frozen=True)
class InferenceResult:
    """One page through preprocess → prefill → decode (→ parse)."""

    text: str  # raw model markup: special tokens kept, trailing EOS removed, stripped
    token_ids: list[int]  # every generated id, the first one chosen from the prefill logits
    stop_reason: StopReason
    prompt_tokens: int
    image_tokens: int
    crop_grid: tuple[int, int]  # (columns, rows) of 640-px tiles; (1, 1) when there are none
    mode: str
    image_size: tuple[int, int]  # (width, height) of the EXIF-corrected original
    timings: StageTimings
    boxes: list[dict[str, Any]]  # parsed `<|ref|>/<|det|>` regions in pixels, see model.postprocess
    skipped_spans: int  # malformed or truncated markup spans the parser skipped
    memory: JobMemory | None  # CUDA only
    engine: str  # the engine that actually ran ("eager" or "fast")
    device: str
    dtype: str
    model: ModelSource
    kv_length: int = 0  # cache length after the last step (prompt + tokens fed back)
    vision_calls: int = 0  # how many times the vision stages ran for this job
    wasted_steps: int = 0  # decode steps computed after EOS and discarded
    batch_occupancy: float | None = None  # the batched engine's: pages per decode step it took part in, averaged
    # Why this job was not steady state (a compilation, a new cache bucket, allocator growth); empty
    # when warm. Cold timings are real, but reports leave them out of statistics unless asked.
    cold_reasons: tuple[str, ...] = ()
    # The repetition loop the output ends in, looked for unless decoding stopped at EOS.
    loop: RepetitionLoop | None = None
    device_span: DeviceSpan | None = None  # None when timing is off (`session.instrumented`)
    # A profiled job's trace and kernels per stage (engine/profiling.py); None for every other job.
    profile: ProfileCapture | None = None

    @property
    def cold(self) -> bool:
        return bool(self.cold_reasons)

    @property
    def decode_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def result_document(result: InferenceResult, files: list[str]) -> dict[str, Any]:
    """result.json: the InferenceResult, plus derived decode statistics and the files written."""
    document = result.to_dict()
    steps = result.timings.decode_step_ms
    document["model_label"] = result.model.label
    document["decode_tokens"] = result.decode_tokens
    document["decode_ms_per_token"] = result.timings.decode_step_percentiles
    document["tokens_per_s"] = 1e3 * len(steps) / sum(steps) if steps and sum(steps) > 0 else None
    document["files"] = files
    return document
