"""`dsocr worker`'s parent imports what its children need before it forks them (farm/celery/preimport.py):
in a fresh interpreter, as the parent does, the imports leave CUDA untouched and the process with one
thread (fork-safe), and a second call (a forked child's) imports nothing. That a real worker's children
inherit them is checked by their recorded `import_ms` (tests/farm/test_workers.py)."""

from __future__ import annotations

import json
import subprocess
import sys

PARENT = """
import json, os, sys, threading
from dsocr_workers.farm.celery.preimport import import_for_jobs
first = import_for_jobs()
second = import_for_jobs()
import torch
maps = open("/proc/self/maps").read()
print(json.dumps({
    "first": [first.modules, first.ms], "second": [second.modules, second.ms],
    "cuda_initialized": torch.cuda.is_initialized(),
    "cuda_driver_loaded": "libcuda.so" in maps,
    "python_threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task")),
    "transformers_model": "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2" in sys.modules,
}))
"""


def test_the_parents_imports_leave_cuda_alone_and_a_child_has_none_left(subprocess_env):
    done = subprocess.run(
        [sys.executable, "-c", PARENT], env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    modules, ms = seen["first"]
    assert modules > 1000 and ms > 0 and seen["transformers_model"]
    assert seen["second"] == [0, 0.0]
    # Neither torch's CUDA state nor the driver: a child forked from here must still choose its GPU.
    assert not seen["cuda_initialized"] and not seen["cuda_driver_loaded"]
    assert seen["python_threads"] == 1 and seen["os_threads"] == 1, seen
