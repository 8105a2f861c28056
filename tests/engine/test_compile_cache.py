"""DSOCR_COMPILE_CACHE_DIR: a fast session points torch's compile cache there, and a second process
finds what the first one compiled (inductor on the CPU, a small function: the mechanism, not the model)."""

from __future__ import annotations

import json
import subprocess
import sys

from dsocr_workers.engine.compile_cache import COMPILE_CACHE_ENV, use_compile_cache

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
    env = {**subprocess_env, COMPILE_CACHE_ENV: str(cache)}
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
    environ = {COMPILE_CACHE_ENV: str(blocker / "cache")}
    assert use_compile_cache(environ) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in environ
    assert f"{COMPILE_CACHE_ENV}={blocker / 'cache'} cannot be created" in caplog.text
