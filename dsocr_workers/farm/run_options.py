"""A run's options: what every job of the run computes. Written into the run row by `dsocr submit` /
`dsocr run` (`RunOptions.parameters`) and read back, by the worker and the warm-up planner, in one place
(`RunOptions.from_parameters`), with one default per option."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants import AUTO, check_name
from dsocr_workers.errors import InputError
from dsocr_workers.model.config import DTYPES
from dsocr_workers.model.families import all_modes, run_mode

# A run's no-repeat n-gram ban as the compiled decode step sees it: (size, window).
NGram = tuple[int, int | None]


@dataclass(frozen=True)
class ModelKey:
    """The settings that make one loaded model (a worker process holds one at a time)."""

    model: str
    engine: str = AUTO
    dtype: str | None = None
    seed: int = 0


# How the batched engine prefills a joining page (`RunOptions.prefill`).
PREFILLS = ("split", "whole")


def recorded_prefill(parameters: Mapping[str, Any]) -> str:
    """A stored run's `prefill`: a run recorded before the option prefilled whole."""
    return str(parameters.get("prefill", "whole"))


@dataclass(frozen=True)
class RunOptions:
    """What every job of a run computes; stored in the run row and read back by the worker."""

    model: str = "tiny"
    # None: the model family's default; `dsocr submit`/`run` set it, checked against the model's family
    # (farm/submit.py `prepare_run`), before anything is recorded.
    mode: str | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None
    ignore_eos: bool = False
    engine: str = AUTO
    dtype: str | None = None
    repeats: int = 1
    seed: int = 0
    stop_on_repetition: bool = False
    # The no-repeat n-gram ban: the vendor's HF default, or off (0), or windowed as in its vLLM path.
    no_repeat_ngram_size: int = DecodeOptions.no_repeat_ngram_size
    ngram_window: int | None = None
    # Kernel-level profiles (engine/profiling.py): every N-th job of the run, in file-list order (line,
    # then repeat), runs under torch.profiler; at a concurrency above 1, every N-th batch step of each kind
    # (`StepSample`); None: none.
    profile_every: int | None = None
    # Jobs of the run a worker keeps in flight per GPU, decoded together by the batched engine
    # (engine/batched/, farm/job/batched.py); 1: one at a time, the batch-1 path.
    concurrency: int = 1
    # The batched engine's prefills: "split", a page joining while more decode than wait is prefilled in
    # two steps (engine/batched/scheduler.py); "whole", every prefill in one launch.
    prefill: str = "split"

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in all_modes():
            raise InputError(f"unknown mode {self.mode!r}; modes: {', '.join(all_modes())}")
        check_name(self.engine)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; dtypes: {', '.join(DTYPES)}")
        if self.repeats < 1:
            raise InputError("--repeats must be at least 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError("--max-new-tokens must be at least 1")
        if self.no_repeat_ngram_size < 0:
            raise InputError("--no-repeat-ngram-size must be 0 (off) or more")
        if self.ngram_window is not None and self.ngram_window < 1:
            raise InputError("--ngram-window must be at least 1")
        if self.profile_every is not None and self.profile_every < 1:
            raise InputError("--profile must be at least 1 (every N-th job)")
        if self.concurrency < 1:
            raise InputError("--concurrency must be at least 1")
        if self.prefill not in PREFILLS:
            raise InputError(f"unknown prefill {self.prefill!r}; choices: {', '.join(PREFILLS)}")

    def profiles(self, ordinal: int) -> bool:
        """Whether the run's `ordinal`-th job (from 1, in file-list order) is profiled: the N-th, 2N-th,
        ... so that a run's first job, the one most likely to meet a cold path, is profiled only at N = 1,
        and with N = --repeats, one repeat of each page (its last). A batched run's jobs are not: its
        engine samples its steps instead."""
        return self.profile_every is not None and self.concurrency == 1 and ordinal % self.profile_every == 0

    @property
    def parameters(self) -> dict[str, Any]:
        """What the run row stores (its model has a column of its own)."""
        return {k: v for k, v in asdict(self).items() if k != "model"}

    @classmethod
    def from_parameters(cls, model: str, parameters: Mapping[str, Any]) -> RunOptions:
        """A run's options read back from its row: what an older run did not record keeps this class's
        default, and what it recorded that this version no longer knows is left out."""
        known = {f.name for f in fields(cls)}
        recorded = {k: v for k, v in parameters.items() if k in known and k != "model"}
        return cls(model=model, **{**recorded, "prefill": recorded_prefill(parameters)})

    @property
    def mode_name(self) -> str:
        """The run's mode: as `dsocr submit`/`run` recorded it, else its model family's default."""
        return self.mode if self.mode is not None else run_mode(self.model, None)

    @property
    def model_key(self) -> ModelKey:
        return ModelKey(self.model, self.engine, self.dtype, self.seed)

    @property
    def split_prefill(self) -> bool:
        return self.prefill == "split"

    @property
    def ngram(self) -> NGram:
        return (self.no_repeat_ngram_size, self.ngram_window)

    @property
    def decode_options(self) -> DecodeOptions:
        """The run's decode policy, as the engine takes it."""
        return DecodeOptions(
            ignore_eos=self.ignore_eos,
            stop_on_repetition=self.stop_on_repetition,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            ngram_window=self.ngram_window,
        )
