"""DSOCR_COMPILE_CACHE_DIR (engine/coldstart/cache.py): a process points torch's compile cache there,
and a second process finds what the first one compiled (inductor on the CPU, a small function: the
mechanism, not the model); where the installation ships no Python bytecode and may not write it, the
build step keeps the bytecode there too."""

from __future__ import annotations

import fcntl
import json
import os
import py_compile
import subprocess
import sys

import pytest

from dsocr_workers import settings
from dsocr_workers.engine.coldstart.cache import (
    BYTECODE_DIR,
    BYTECODE_LOCK,
    BYTECODE_WRITTEN,
    use_bytecode_cache,
    use_compile_cache,
)

# A process as `dsocr` starts one (the cache chosen before anything compiles), then one inductor compilation.
PROCESS = """
import json, os, torch
from dsocr_workers.engine.coldstart.cache import use_compile_cache

use_compile_cache()
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


# A process started as `dsocr` starts: the bytecode decision first, then the import it is about; with
# "build" (argv[1]), the build step's writing then (twice: the second finds nothing new to write).
BYTECODE_PROCESS = """
import os, sys
from dsocr_workers.engine.coldstart.cache import use_bytecode_cache, write_bytecode
print(use_bytecode_cache(probe="probe_module"))
import probe_module
print(os.environ.get("PYTHONPYCACHEPREFIX"), os.environ.get("PYTHONDONTWRITEBYTECODE"))
if sys.argv[1:] == ["build"]:
    print(write_bytecode([probe_module]), write_bytecode([probe_module]))
"""


def run_bytecode_process(env: dict[str, str], *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", BYTECODE_PROCESS, *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_bytecode_that_may_not_be_written_beside_the_sources_is_kept_in_the_compile_cache(tmp_path, subprocess_env):
    """PYTHONDONTWRITEBYTECODE and no bytecode shipped (a container image's usual state): every process
    compiled every source again, a large part of a worker's imports. Starts before a build
    change nothing; the build writes what it imported (after another build's writer, under its lock);
    the starts after it read it (and tell the processes they start)."""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "probe_module.py").write_text("VALUE = 1\n")
    cache = tmp_path / "cache"
    env = {**subprocess_env, settings.COMPILE_CACHE_DIR.name: str(cache), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(sources), subprocess_env["PYTHONPATH"]])}  # fmt: skip
    env.pop("PYTHONPYCACHEPREFIX", None)
    bytecode = cache.resolve() / BYTECODE_DIR
    assert run_bytecode_process(env) == [str(bytecode), "None 1"]
    assert not bytecode.exists() or not list(bytecode.rglob("*.pyc"))
    # Another build's writer at work (it holds the lock): this one waits for it, then writes.
    bytecode.mkdir(parents=True)
    with open(bytecode / BYTECODE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = subprocess.Popen([sys.executable, "-c", BYTECODE_PROCESS, "build"], env=env, stdout=subprocess.PIPE,
                                 text=True)  # fmt: skip
        with pytest.raises(subprocess.TimeoutExpired):
            build.wait(timeout=5)
    out, _ = build.communicate(timeout=60)
    assert build.returncode == 0 and out.strip().splitlines() == [str(bytecode), "None 1", "1 0"]
    written = list(bytecode.rglob("probe_module.*.pyc"))
    assert len(written) == 1 and (bytecode / BYTECODE_WRITTEN).exists()
    assert not (sources / "__pycache__").exists()
    assert run_bytecode_process(env) == [str(bytecode), f"{bytecode} 1"]
    # A process started by one that reads from there: its environment says so.
    assert run_bytecode_process({**env, "PYTHONPYCACHEPREFIX": str(bytecode)}) == ["None", f"{bytecode} 1"]
    # An edited source is written again by the next build.
    (sources / "probe_module.py").write_text("VALUE = 2\n")
    os.utime(sources / "probe_module.py", (written[0].stat().st_mtime + 5,) * 2)
    assert run_bytecode_process(env, "build")[2] == "1 0"
    # A reinstall or a copy changes the source's modification time, not its content: its bytecode stays
    # (checked by the source's hash), nothing is written again and an import reads it.
    os.utime(sources / "probe_module.py", (written[0].stat().st_mtime + 50,) * 2)
    assert run_bytecode_process(env, "build")[2] == "0 0"
    verbose = subprocess.run([sys.executable, "-v", "-c", BYTECODE_PROCESS], env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert f"code object from '{written[0]}'" in verbose.stderr
    # Without the variable, Python's own behaviour: nothing read or written anywhere.
    del env[settings.COMPILE_CACHE_DIR.name]
    assert run_bytecode_process(env, "build") == ["None", "None 1", "None None"]
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
