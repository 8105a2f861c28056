"""A run's options are read back from its row in one place (`RunOptions.from_parameters`)."""

from __future__ import annotations

import pytest

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.errors import InputError
from dsocr_workers.farm.run_options import ModelKey, RunOptions


def test_options_survive_the_row() -> None:
    options = RunOptions(model="tiny", mode="base", max_new_tokens=7, engine="eager", dtype="float32", seed=3,
                         no_repeat_ngram_size=4, ngram_window=90, stop_on_repetition=True)  # fmt: skip
    assert RunOptions.from_parameters("tiny", options.parameters) == options
    assert options.model_key == ModelKey("tiny", "eager", "float32", 3)
    assert options.ngram == (4, 90)
    assert options.decode_options == DecodeOptions(stop_on_repetition=True, no_repeat_ngram_size=4, ngram_window=90)


def test_an_older_run_keeps_the_defaults_and_unknown_keys_are_left_out() -> None:
    read = RunOptions.from_parameters("tiny", {"mode": "small", "retired_option": 1})
    # What it did not record keeps the default, but for the one a run before it did otherwise: its
    # batched engine prefilled whole.
    assert read == RunOptions(model="tiny", mode="small", prefill="whole")
    assert read.model_key == ModelKey("tiny")  # one engine default: the same as a new run's


def test_a_stored_option_is_checked_again() -> None:
    with pytest.raises(InputError, match="unknown engine"):
        RunOptions.from_parameters("tiny", {"engine": "warp"})


def test_every_nth_job_is_profiled_and_a_bad_n_is_refused() -> None:
    options = RunOptions(profile_every=3)
    assert [n for n in range(1, 10) if options.profiles(n)] == [3, 6, 9]
    assert not any(RunOptions().profiles(n) for n in range(1, 10))
    # A batched run's jobs are not profiled: its engine samples its steps (engine/profiling.py StepSample).
    assert not any(RunOptions(profile_every=3, concurrency=2).profiles(n) for n in range(1, 10))
    assert RunOptions.from_parameters("tiny", options.parameters).profile_every == 3
    with pytest.raises(InputError, match="--profile must be at least 1"):
        RunOptions(profile_every=0)
