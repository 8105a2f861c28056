"""The stage registry's own rules (dsocr_workers/stages.py): each can fail on a planted mistake, and the
registry stays importable where torch and SQLAlchemy are not (the store and the report read it)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from dsocr_workers.stages import (
    BY_COLUMN,
    HOST_STAGES,
    JOB_PARTS,
    PARTS,
    STAGES,
    TIMINGS,
    VISION_STAGES,
    StageTimings,
    Timing,
    breakdown_bars,
    check,
    depth,
)


def in_order(expected: tuple[str, ...] | list[str], actual: tuple[str, ...] | list[str]) -> bool:
    """`expected` appears in `actual` in this order (other names may lie between: a stage added later)."""
    names = iter(actual)
    return all(name in names for name in expected)


def test_the_registry_keeps_its_rules_and_the_measurement_contract():
    check(TIMINGS)
    # DESIGN §3: the stages the engine times, the host ones, the parts of e2e; a new stage may join them.
    assert in_order(("preprocess", "setup", "prefill", "vision/sam", "vision/clip", "vision/projector", "lm_prefill",
                     "first_token", "decode", "readback", "postprocess"), STAGES)  # fmt: skip
    assert {"preprocess", "postprocess"} <= HOST_STAGES and not HOST_STAGES & {"prefill", "decode"}
    assert in_order(("preprocess", "setup", "prefill", "first_token", "decode", "readback", "postprocess"), JOB_PARTS)
    assert in_order(("vision/sam", "vision/clip", "vision/projector"), VISION_STAGES)
    assert in_order(["preprocess_ms", "setup_ms", "prefill_ms", "first_token_ms", "decode_ms", "wasted_decode_ms",
                     "readback_ms", "postprocess_ms", "host_gap_ms"], [t.column for t in PARTS])  # fmt: skip
    assert "lm_prefill" not in JOB_PARTS and "vision/sam" not in JOB_PARTS  # nested in prefill
    assert depth(BY_COLUMN["sam_ms"]) == 2 and depth(BY_COLUMN["lm_prefill_ms"]) == 1 and depth(BY_COLUMN["e2e_ms"]) == 0


def test_parts_add_up_by_the_registry():
    timings = StageTimings("perf_counter", **{t.column: float(i + 1) for i, t in enumerate(TIMINGS)})
    assert list(timings.parts_ms) == [t.column.removesuffix("_ms") for t in PARTS]
    assert sum(timings.parts_ms.values()) == sum(float(TIMINGS.index(t) + 1) for t in PARTS)
    assert timings.columns() == {t.column: float(i + 1) for i, t in enumerate(TIMINGS)}


def test_bars_sum_their_columns_in_order():
    bars = breakdown_bars()
    assert in_order(["preprocess", "SAM", "CLIP", "projector", "LM prefill", "decode", "wasted decode", "postprocess"],
                    list(bars))  # fmt: skip
    assert bars["decode"] == ("first_token_ms", "decode_ms") and bars["postprocess"] == ("readback_ms", "postprocess_ms")
    assert [c for columns in bars.values() for c in columns] == [t.column for t in TIMINGS if t.bar is not None]


def planted(which: str, **changes) -> tuple[Timing, ...]:
    return tuple(replace(t, **changes) if t.column == which else t for t in TIMINGS)


@pytest.mark.parametrize(
    ("timings", "problem"),
    [
        (TIMINGS + (replace(TIMINGS[0], label="again"),), "ttft_ms twice"),
        (planted("setup_ms", stage="prefill"), "stage prefill twice"),
        (planted("setup_ms", column="setup"), "ends in _ms"),
        (planted("sam_ms", parent="nothing_ms"), "parent nothing_ms is no figure"),
        (planted("readback_ms", part=False), "part of e2e exactly when it is top level"),
        (planted("vision_ms", part=True), "nested figure cannot be a part"),
        (planted("host_gap_ms", host=True), "only a stage has a clock"),
        (planted("prefill_ms", bar="prefill"), "sam_ms: a bar adds a part or what is nested in one"),
        (planted("e2e_ms", bar="everything"), "e2e_ms: a bar adds a part or what is nested in one"),
        (planted("clip_ms", nullable=False), "clip_ms: a family stage is a stage whose column is nullable"),
    ],
)
def test_a_mistake_in_the_registry_is_refused(timings, problem):
    with pytest.raises(ValueError, match=problem):
        check(timings)


def test_the_registry_imports_nothing_heavy(subprocess_env):
    probe = ("import sys, dsocr_workers.stages; "
             "print(sorted({'torch', 'sqlalchemy', 'numpy', 'dsocr_workers.engine'} & set(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env=subprocess_env).stdout
    assert out.strip() == "[]"
