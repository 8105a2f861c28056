"""The engines a session can run, by name: the registry, and the one place `auto` is decided.

An engine is an object behind one interface (`variants/base.py Engine`): the kernels the model is loaded
with, its module swaps after loading, the runners of a job's vision, LM prefill and decode step, and what
it compiles. `eager` (variants/eager.py) is plain PyTorch and the numerical reference; `fast`
(variants/fast.py) the compiled engine. Adding an engine is one module and one line in `REGISTRY`.

The names are importable without torch (`dsocr --help`, the farm's parent process, `dsocr submit`): the
registry maps each name to "module:Class", imported when an engine is made.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dsocr_workers.errors import InputError

if TYPE_CHECKING:
    from dsocr_workers.engine.variants.base import Engine

REGISTRY: dict[str, str] = {
    "eager": "dsocr_workers.engine.variants.eager:EagerEngine",
    "fast": "dsocr_workers.engine.variants.fast:FastEngine",
}
ENGINES = tuple(REGISTRY)
# A run's default: the fast engine where the job runs on a GPU, eager (the reference) on a CPU
# (`resolve`). Each result records the engine that ran.
AUTO = "auto"
ENGINE_CHOICES = (AUTO, *ENGINES)
# What an engine that needs CUDA runs instead on a CPU.
CPU_FALLBACK = "eager"


def check_name(name: str) -> str:
    if name not in ENGINE_CHOICES:
        raise InputError(f"unknown engine {name!r}; engines: {', '.join(ENGINE_CHOICES)}")
    return name


def engine_class(name: str) -> type[Engine]:
    module, _, attribute = REGISTRY[check_name(name)].partition(":")
    return getattr(importlib.import_module(module), attribute)  # type: ignore[no-any-return]


def resolve(name: str, device_type: str) -> tuple[str, str]:
    """The engine that runs for `name` on a device of `device_type` ("cuda", "cpu"), and a note when it is
    not the one asked for: `auto` is fast on CUDA and eager elsewhere; an engine that needs CUDA runs
    eager on a CPU, and says so."""
    check_name(name)
    if name == AUTO:
        return ("fast" if device_type == "cuda" else CPU_FALLBACK), ""
    needs = engine_class(name).needs_cuda
    if needs and device_type != "cuda":
        return (
            CPU_FALLBACK,
            f"the {name} engine needs CUDA ({needs}); running the {CPU_FALLBACK} engine on the CPU",
        )
    return name, ""


def make_engine(name: str, device_type: str) -> tuple[Engine, str]:
    """The engine object for `name` on `device_type` (`resolve`), with its note."""
    resolved, note = resolve(name, device_type)
    return engine_class(resolved)(), note
