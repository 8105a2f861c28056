"""DSOCR_COMPILE_CACHE_DIR: a fast session points torch's compile cache there, and a second process
finds what the first one compiled (inductor on the CPU, a small function: the mechanism, not the model);
where the installation ships no Python bytecode and may not write it, the bytecode is kept there too."""

from __future__ import annotations

import fcntl
import json
import os
import py_compile
import subprocess
import sys

from dsocr_workers import settings
from dsocr_workers.engine.compile_cache import (
    BYTECODE_DIR,
    BYTECODE_LOCK,
    BYTECODE_WRITTEN,
    use_bytecode_cache,
    use_compile_cache,
)

# A fast session on the CPU (decode step traced by aot_eager), then one inductor compilation.
PROCESS = """
import json, os, torch
from dsocr_workers.engine.result import ModelSource
from dsocr_workers.engine.session import DeepSeekOCRSession, FastCompile
from dsocr_workers.model.checkpoint import build_preset

loaded = build_preset("tiny", device=torch.device("cpu"), dtype=torch.float32)
DeepSeekOCRSession(loaded, ModelSource("preset", "tiny", random_weights=True, seed=0), torch.device("cpu"),
                   torch.float32, "fast", fast_compile=FastCompile("aot_eager", decode_only=True))
step = torch.compile(lambda x: torch.sin(x) * 2 + 1)
step(torch.randn(64))
counters = torch._dynamo.utils.counters["inductor"]
print(json.dumps({"torch_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                  "hits": counters["fxgraph_cache_hit"], "misses": counters["fxgraph_cache_miss"]}))
"""


def run(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path, subprocess_env):
    cache = tmp_path / "compile-cache"
    env = {**subprocess_env, settings.COMPILE_CACHE_DIR.name: str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    first = run(env)
    assert first["torch_cache"] == str(cache.resolve())
    assert (first["hits"], first["misses"]) == (0, 1)
    assert any(cache.rglob("*.py")), "nothing was written to the cache directory"
    second = run(env)
    assert (second["hits"], second["misses"]) == (1, 0)


def test_no_variable_keeps_torch_default():
    environ: dict[str, str] = {}
    assert use_compile_cache(environ) is None and environ == {}


def test_a_directory_that_cannot_be_made_is_a_warning_and_the_default(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    environ = {settings.COMPILE_CACHE_DIR.name: str(blocker / "cache")}
    assert use_compile_cache(environ) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in environ
    assert f"{settings.COMPILE_CACHE_DIR.name}={blocker / 'cache'} cannot be created" in caplog.text


# A process started as `dsocr` starts: the bytecode decision first, then the import it is about, then,
# once "ready", the writer of what it compiled in memory (waited for here).
BYTECODE_PROCESS = """
import os, sys
from dsocr_workers.engine.compile_cache import use_bytecode_cache, write_bytecode
print(use_bytecode_cache(probe="probe_module"))
import probe_module
print(os.environ.get("PYTHONPYCACHEPREFIX"), os.environ.get("PYTHONDONTWRITEBYTECODE"))
writer = write_bytecode([probe_module])
print(writer and writer.wait())
print(write_bytecode([probe_module]))  # a later warm-up of the same process: nothing new to write
"""


def run_bytecode_process(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", BYTECODE_PROCESS], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_bytecode_that_may_not_be_written_beside_the_sources_is_kept_in_the_compile_cache(tmp_path, subprocess_env):
    """PYTHONDONTWRITEBYTECODE and no bytecode shipped (a container image's usual state): every process
    compiled every source again, ~5 s of a worker's imports on the H100 host. The first start changes
    nothing for its imports, then, once ready, has a writer process write what it compiled in memory
    (unless another worker child's writer is at work); the next starts read it (and tell the processes
    they start), with nothing left to write."""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "probe_module.py").write_text("VALUE = 1\n")
    cache = tmp_path / "cache"
    env = {**subprocess_env, settings.COMPILE_CACHE_DIR.name: str(cache), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(sources), subprocess_env["PYTHONPATH"]])}  # fmt: skip
    env.pop("PYTHONPYCACHEPREFIX", None)
    bytecode = cache.resolve() / BYTECODE_DIR
    # Another worker child's writer at work (it holds the lock): this one leaves the writing to it.
    bytecode.mkdir(parents=True)
    with open(bytecode / BYTECODE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert run_bytecode_process(env) == [str(bytecode), "None 1", "0", "None"]
    assert not list(bytecode.rglob("*.pyc")) and not (bytecode / BYTECODE_WRITTEN).exists()
    assert run_bytecode_process(env) == [str(bytecode), "None 1", "0", "None"]
    written = list(bytecode.rglob("probe_module.*.pyc"))
    assert len(written) == 1 and (bytecode / BYTECODE_WRITTEN).exists()
    assert not (sources / "__pycache__").exists()
    assert run_bytecode_process(env) == [str(bytecode), f"{bytecode} 1", "None", "None"]
    # A process started by one that reads from there: its environment says so; it writes nothing.
    assert run_bytecode_process({**env, "PYTHONPYCACHEPREFIX": str(bytecode)}) == ["None", f"{bytecode} 1", "None", "None"]
    # An edited source is written again.
    (sources / "probe_module.py").write_text("VALUE = 2\n")
    os.utime(sources / "probe_module.py", (written[0].stat().st_mtime + 5,) * 2)
    assert run_bytecode_process(env)[2] == "0"
    # Without the variable, Python's own behaviour: nothing read or written anywhere.
    del env[settings.COMPILE_CACHE_DIR.name]
    assert run_bytecode_process(env) == ["None", "None 1", "None", "None"]
    assert not (sources / "__pycache__").exists()


def test_bytecode_present_or_writable_or_placed_by_the_user_is_left_alone(tmp_path, monkeypatch):
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "shipped_module.py").write_text("VALUE = 1\n")
    py_compile.compile(str(sources / "shipped_module.py"))  # bytecode beside the source, as pip leaves it
    (sources / "writable_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(sources))
    environ = {settings.COMPILE_CACHE_DIR.name: str(tmp_path / "cache")}
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert use_bytecode_cache(environ, probe="shipped_module") is None
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert use_bytecode_cache(environ, probe="writable_module") is None
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert use_bytecode_cache({**environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}, probe="writable_module") is None
    assert environ == {settings.COMPILE_CACHE_DIR.name: str(tmp_path / "cache")} and not (tmp_path / "cache").exists()
    assert sys.pycache_prefix is None
