"""The imports a worker child needs before it opens a model: torch, transformers' DeepSeek-OCR-2 modules
(which bring torch.distributed.tensor, sympy and torch._dynamo with them), the engine, its variants, the
start-up warm-up, the Celery task module and Celery's worker. `dsocr worker`'s parent takes them once,
before it forks its lanes, so every lane and every Celery child (billiard forks, it does not spawn)
starts with them done; a child takes them again only where they are missing (`import_for_jobs`), and
records what that cost in its first worker session (`import_ms`: 0 when it inherited them).

Importing them initialises no CUDA: each child chooses its GPU after fork (farm/devices.py).

Some packages transformers imports at module level wherever they are installed serve features no job
uses (scikit-learn for assisted decoding's ROC curve, SciPy for object detection's losses, torchvision's
and torchaudio's IO); in a process that has not imported transformers yet, those not imported either are
left out (`LEFT_OUT`), as if not installed. A child scores pages in a fresh interpreter of its own
(farm/job/scoring_process.py), which has SciPy.

The cyclic garbage collector is off while they import: each of its full collections walks every object
torch has made so far, and the imports allocate enough to set off several (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsocr_workers.engine.variants import REGISTRY
from dsocr_workers.model.families import FAMILIES

# What a lane's Celery worker imports as it starts (the app's amqp, events and control, the prefork pool,
# the consumer): taken once here rather than by each lane after the fork, and so in the bytecode that
# `dsocr precompile` writes (tests/farm/test_preimport.py says when Celery adds one).
LANE_IMPORTS = (
    "celery.apps.worker",
    "celery.app.amqp",
    "celery.app.control",
    "celery.app.events",
    "celery.app.log",
    "celery.app.routes",
    "celery.backends.base",
    "celery.events.dispatcher",
    "celery.events.receiver",
    "celery.concurrency.prefork",
    "celery.worker.autoscale",
    "celery.worker.components",
    "celery.worker.consumer",
    "celery.worker.consumer.delayed_delivery",
    "celery.worker.strategy",
    "billiard.popen_fork",
    "billiard.sharedctypes",
    "billiard.synchronize",
    "encodings.idna",  # the broker's host name
)

START_IMPORTS = (
    "torch",  # first: the longest, and what a start refused while it imports still pays
    "dsocr_workers.farm.celery.tasks",
    *LANE_IMPORTS,
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


# Packages left out of a worker's processes: with scipy and pandas under it, scikit-learn alone was over
# 1 s of a start's imports on a host that has it (docs/benchmarks.md, "Start-up and cold start").
LEFT_OUT = ("sklearn", "scipy", "torchvision", "torchaudio")


@dataclass(frozen=True)
class Imported:
    """What `import_for_jobs` took: how many modules it added to this process, how long that took (0 and
    0.0 when every one was there already) and when it began (the wall clock, `time.time()`)."""

    modules: int
    ms: float
    began_at: float


def import_for_jobs(stop: Callable[[], bool] = lambda: False) -> Imported:
    """Import `START_IMPORTS` where this process has not yet, leaving `LEFT_OUT` out; `stop()` is asked
    before each (true: the rest are not imported)."""
    if "transformers" not in sys.modules:  # once it is, its checks have run: leaving them out saves nothing
        for name in LEFT_OUT:
            # None in sys.modules: an import of it fails and `importlib.util.find_spec` (which transformers'
            # availability checks ask) finds nothing.
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    before, began, began_at = len(sys.modules), time.perf_counter(), time.time()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for name in START_IMPORTS:
            if stop():
                break
            importlib.import_module(name)
    finally:
        if collecting:
            gc.enable()
    if (modules := len(sys.modules) - before) == 0:
        return Imported(0, 0.0, began_at)
    return Imported(modules, (time.perf_counter() - began) * 1e3, began_at)
