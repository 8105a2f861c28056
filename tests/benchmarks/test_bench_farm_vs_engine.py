"""benchmarks/bench_farm_vs_engine.py's verdict: a farm run cut short by its budget gives no ratio."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def bench(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("bench_farm_vs_engine")


def engine_level(tokens_per_s: float) -> dict[str, Any]:
    spread = {"p50": 5.0, "p99": 6.0}
    return {"steady_output_tokens_per_s": tokens_per_s, "output_tokens_per_s": tokens_per_s,
            "tpot_ms": spread, "itl_ms": spread, "ttft_ms": spread}  # fmt: skip


def farm_run(status: str, tokens_per_s: float) -> dict[str, Any]:
    return {"status": status, "stats": {"serving": {"output_tokens_per_s": tokens_per_s}}}


ARGS = argparse.Namespace(concurrency=128, max_new_tokens=1024, filelist=Path("demo-18.txt"), mode="gundam",
                          admission="window,one-a-step", variants=8)  # fmt: skip


def test_a_complete_farm_run_is_set_against_each_engine_schedule(bench: ModuleType) -> None:
    engines = {"window": engine_level(20_000.0), "one-a-step": engine_level(18_000.0)}
    text = bench.table(engines, farm_run("complete", 19_800.0), ARGS, 1296)
    assert "Farm / engine alone (steady windows): **0.990** (target >= 0.97): PASS" in text
    assert "Farm / engine alone, one page joining a step (steady windows): **1.100**" in text


def test_a_farm_run_cut_short_by_its_budget_gives_no_ratio(bench: ModuleType) -> None:
    engines = {"window": engine_level(20_000.0), "one-a-step": engine_level(18_000.0)}
    status = "timed out after 80 s with 102/1296 final"
    text = bench.table(engines, farm_run(status, 19_800.0), ARGS, 1296)
    assert "**0.990**" not in text and "PASS" not in text and "FAIL" not in text
    assert f"Farm / engine alone: not measured (the farm's run: {status})" in text
    assert "| farm (K = 1), cut short |" in text
