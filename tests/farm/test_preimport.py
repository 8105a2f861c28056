"""`dsocr worker`'s parent imports what its children need before it forks them (farm/celery/preimport.py):
in a fresh interpreter, as the parent does, the imports leave CUDA uninitialised, no Python thread
running and the garbage collector on again, a second call (a forked child's) imports nothing, opening a model of any family on any engine
imports nothing more, and on a GPU host a child forked afterwards chooses its GPU and opens it. A lane
starts its Celery worker without Celery's command line and its plugins. That a real worker's children
inherit the imports is checked by their recorded `import_ms` (tests/farm/test_workers.py). The scorer is
not among them: a child scores in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PARENT = """
import gc, importlib.util, json, os, sys, threading
from dsocr_workers.farm.celery.preimport import LEFT_OUT, import_for_jobs
from dsocr_workers.farm.devices import count_gpus, open_device, see_only_this_gpu
installed = [name for name in LEFT_OUT if importlib.util.find_spec(name) is not None]
first = import_for_jobs()
second = import_for_jobs()
import torch
seen = {
    "first": [first.modules, first.ms], "second": [second.modules, second.ms],
    "cuda_initialized": torch.cuda.is_initialized(), "python_threads": threading.active_count(),
    "transformers_model": "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2" in sys.modules,
    "scorer": "dsocr_workers.quality.scoring" in sys.modules,
    "collecting": gc.isenabled(),
    "left_out": {name: [name in installed, importlib.util.find_spec(name) is None] for name in LEFT_OUT},
}
import transformers.utils
seen["transformers_sees"] = [transformers.utils.is_sklearn_available(), transformers.utils.is_scipy_available()]
if count_gpus():  # counted as the worker's parent counts them: nvidia-smi, not CUDA
    pid = os.fork()
    if pid == 0:  # as a Celery child does (farm/celery/tasks.py)
        open_device(see_only_this_gpu("cuda:0"))
        os._exit(0)
    seen["forked_child_opened_its_gpu"] = os.waitpid(pid, 0)[1] == 0
print(json.dumps(seen))
"""


def test_the_parents_imports_leave_cuda_alone_and_a_child_has_none_left(subprocess_env, tmp_path):
    # Each left-out package installed, as a package that says so if it is ever imported.
    for name in ("sklearn", "scipy", "torchvision", "torchaudio"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"print('imported {name}')\n")
    env = {**subprocess_env, "PYTHONPATH": f"{subprocess_env['PYTHONPATH']}{os.pathsep}{tmp_path}"}
    done = subprocess.run([sys.executable, "-c", PARENT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    modules, ms = seen["first"]
    assert modules > 1000 and ms > 0 and seen["transformers_model"]
    assert not seen["scorer"]  # a child scores in its scoring process (farm/job/scoring_process.py)
    assert seen["second"] == [0, 0.0]
    # Installed, yet not imported and not found by transformers' checks after the parent's imports.
    assert seen["left_out"] == {name: [True, True] for name in ("sklearn", "scipy", "torchvision", "torchaudio")}
    assert seen["transformers_sees"] == [False, False] and "imported" not in done.stdout
    assert seen["collecting"]  # the collector, off during the imports, is on again
    # torch maps the CUDA libraries (and numpy's BLAS may start OS threads) at import; what a fork must
    # not carry is CUDA's state or a Python thread in the middle of something.
    assert not seen["cuda_initialized"] and seen["python_threads"] == 1, seen
    assert seen.get("forked_child_opened_its_gpu", True), seen


OPEN = """
import json, sys
from dsocr_workers.engine.variants import ENGINES, engine_class
from dsocr_workers.farm.celery.preimport import import_for_jobs
from dsocr_workers.model.families import FAMILIES
import_for_jobs()
before = set(sys.modules)
from dsocr_workers.engine.session import DeepSeekOCRSession
for engine in ENGINES:  # made directly: `fast` by name runs eager on a CPU
    for family in FAMILIES.values():
        smallest = next(name for name in family.presets if "tiny" in name)
        DeepSeekOCRSession.from_local(smallest, engine=engine_class(engine)())
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_opening_a_model_after_the_parents_imports_imports_nothing_more(subprocess_env):
    # A module a child imports only as it loads its model (an engine's kernels) is imported by every child
    # after fork, on its way to ready.
    done = subprocess.run(
        [sys.executable, "-c", OPEN], env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


LANE = """
import json, os, signal, sys
from celery.signals import celeryd_init, worker_ready
from dsocr_workers.farm.celery.worker import start_worker
from dsocr_workers.settings import Settings
before = set()

@celeryd_init.connect
def _lane_starts(**_):
    before.update(sys.modules)

@worker_ready.connect
def _ready(**_):
    print("lane imported", json.dumps(sorted(set(sys.modules) - before)), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # a warm shutdown

start_worker(Settings.from_env(), ["cpu"], warmup="none")
"""


def test_a_lane_starts_its_celery_worker_on_the_parents_imports(subprocess_env, broker_env, sqlite_url):
    # What a lane imports as its Celery worker starts is imported after the fork, by every lane, and
    # is missing from `dsocr precompile`'s bytecode: Celery's command line and its plugins are not used.
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": sqlite_url}
    done = subprocess.run([sys.executable, "-c", LANE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [imported] = [
        line.removeprefix("lane imported ") for line in done.stdout.splitlines() if "lane imported" in line
    ]
    assert json.loads(imported) == [], imported


def test_a_process_that_imported_transformers_first_keeps_every_package(subprocess_env, tmp_path):
    # Its availability checks have run: leaving a package out then would only make it unimportable.
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("")
    env = {**subprocess_env, "PYTHONPATH": f"{subprocess_env['PYTHONPATH']}{os.pathsep}{tmp_path}"}
    code = (
        "import sys, transformers\n"
        "from dsocr_workers.farm.celery.preimport import LEFT_OUT, import_for_jobs\n"
        "import_for_jobs()\n"
        "import sklearn\n"
        "print([name for name in LEFT_OUT if name in sys.modules and sys.modules[name] is None])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
