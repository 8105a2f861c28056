"""What the benchmark scripts' tests share: a script loaded from its file."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], ModuleType]:
    """`load_script("bench_scaling")`: benchmarks/bench_scaling.py as a module. Loaded from its file, as
    `benchmarks` is also the name of this test folder; the repository root on sys.path, for the scripts'
    imports of each other."""

    def load(name: str) -> ModuleType:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
