"""The imports a worker child needs before it opens a model: torch, transformers' DeepSeek-OCR-2 modules
(which bring torch.distributed.tensor, sympy and torch._dynamo with them), the engine, its variants, the
start-up warm-up and the Celery task module. `dsocr worker`'s parent takes them once, before it forks
its lanes, so every lane and every Celery child (billiard forks, it does not spawn) starts with them
done; a child takes them again only where they are missing (`import_for_jobs`), and records what that
cost in its first worker session (`import_ms`: 0 when it inherited them).

Importing them initialises no CUDA: each child chooses its GPU after fork (farm/devices.py).
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import dataclass

from dsocr_workers.engine.variants import REGISTRY
from dsocr_workers.model.families import FAMILIES

START_IMPORTS = (
    "dsocr_workers.farm.celery.tasks",
    "dsocr_workers.engine.session",
    "dsocr_workers.engine.coldstart.warmup",
    "dsocr_workers.engine.batched",
    *(target.partition(":")[0] for target in REGISTRY.values()),
    # every family's torch side (`ModelFamily.code`): a child may open any model
    *(
        f"dsocr_workers.model.{f.package}.{module}"
        for f in FAMILIES.values()
        for module in ("modeling", "preprocess", "keys")
    ),
)


@dataclass(frozen=True)
class Imported:
    """What `import_for_jobs` took: how many modules it added to this process and how long that took
    (0 and 0.0 when every one was there already)."""

    modules: int
    ms: float


def import_for_jobs() -> Imported:
    """Import `START_IMPORTS` where this process has not yet."""
    before, began = len(sys.modules), time.perf_counter()
    for name in START_IMPORTS:
        importlib.import_module(name)
    if (modules := len(sys.modules) - before) == 0:
        return Imported(0, 0.0)
    return Imported(modules, (time.perf_counter() - began) * 1e3)
