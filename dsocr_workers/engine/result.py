"""Typed results of one inference: what the engine hands to the farm, the CLI and the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

StopReason = Literal["eos", "max_new_tokens", "max_positions"]
Clock = Literal["cuda_event", "perf_counter"]


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
            return f"preset:{self.name} (random weights, seed {self.seed})"
        return f"checkpoint:{self.name}"


@dataclass(frozen=True)
class StageTimings:
    """Milliseconds per stage. On CUDA every GPU stage is timed with CUDA events; on CPU with
    perf_counter. `prefill_ms` contains the vision stages and `lm_prefill_ms`."""

    clock: Clock
    preprocess_ms: float
    prefill_ms: float
    vision_ms: float
    sam_ms: float
    clip_ms: float
    projector_ms: float
    lm_prefill_ms: float
    decode_ms: float
    # One entry per decode step (each step produces one token after the first, which comes from
    # the prefill logits).
    decode_step_ms: list[float] = field(default_factory=list)
    ttft_ms: float = 0.0  # preprocess + prefill + first-token selection
    e2e_ms: float = 0.0


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
    peak_memory_bytes: int | None  # CUDA peak allocated during the job; None on CPU
    engine: str  # the engine that actually ran ("eager" or "fast")
    device: str
    dtype: str
    model: ModelSource
    kv_length: int = 0  # cache length after the last step (prompt + tokens fed back)
    vision_calls: int = 0  # how many times the vision stages ran for this job

    @property
    def decode_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
