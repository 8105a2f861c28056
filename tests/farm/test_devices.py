"""`--gpus` names only GPUs that are there, checked in the worker's parent without torch; a child whose
device does not open takes no job and stops the worker with one line (exit 2). Real `python -m
dsocr_workers worker` processes on Redis and SQLite. This machine's GPUs are what `nvidia-smi` says; a
host where nvidia-smi lists a GPU that torch cannot open (a CPU-only torch, a broken driver) is made by
putting a `nvidia-smi` that lists one first on PATH, the one thing here that is not the real program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsocr_workers.errors import InputError
from dsocr_workers.farm.devices import count_gpus, parse_devices
from dsocr_workers.store import ledger
from dsocr_workers.store.db import open_database


def dsocr(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def listed_gpus(tmp_path) -> dict[str, str]:
    """PATH with an `nvidia-smi` that lists two GPUs this machine cannot open (it has no GPU or CUDA)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine's GPUs open: the case needs a listed GPU that torch cannot open")
    folder = tmp_path / "bin"
    folder.mkdir()
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'GPU 0: Listed (UUID: GPU-0)'\necho 'GPU 1: Listed (UUID: GPU-1)'\n")
    tool.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_gpus_auto_falls_back_to_the_cpu_and_indices_must_be_there():
    count = count_gpus()
    assert parse_devices("auto") == ([f"cuda:{i}" for i in range(count)] if count else ["cpu"])
    assert parse_devices(",".join(str(i) for i in range(count)) or "cpu") == (
        [f"cuda:{i}" for i in range(count)] or ["cpu"]
    )
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]  # two lanes on the CPU
    with pytest.raises(InputError):
        parse_devices("cpu,0")  # a GPU is named once, beside no CPU lane


def test_cuda_visible_devices_narrows_what_gpus_may_name(listed_gpus):
    environ = {**os.environ, **listed_gpus}
    assert parse_devices("all", environ) == ["cuda:0", "cuda:1"]
    assert parse_devices("1", environ) == ["cuda:1"]
    narrowed = {**environ, "CUDA_VISIBLE_DEVICES": "1"}
    assert parse_devices("auto", narrowed) == ["cuda:0"]
    with pytest.raises(Exception, match=r"no GPU 1 on this host \(nvidia-smi finds 1 that CUDA_VISIBLE_DEVICES='1' "
                                        r"leaves: 0\)"):  # fmt: skip
        parse_devices("0,1", narrowed)


@pytest.mark.parametrize("command", ["worker", "run"])
def test_a_gpu_that_is_not_there_is_refused_at_once_without_torch(command, tmp_path, subprocess_env, broker_env):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": url}
    absent = count_gpus() + 1  # one past this machine's last GPU
    args = ["worker"] if command == "worker" else ["run", "list.txt"]
    refused = dsocr("-X", "importtime", "-m", "dsocr_workers", *args, "--gpus", str(absent), env=env, timeout=60)
    assert refused.returncode == 2, refused.stderr
    # -X importtime writes one line per import on stderr; the rest is ours: one line, and torch never
    # imported (the parent counts GPUs with nvidia-smi; CUDA belongs to the children).
    imports = [line for line in refused.stderr.splitlines() if line.startswith("import time:")]
    ours = [line for line in refused.stderr.splitlines() if not line.startswith("import time:")]
    assert len(ours) == 1, ours
    assert ours[0].startswith(f"error: --gpus {absent}: no GPU {absent} on this host (nvidia-smi finds ")
    assert ours[0].endswith("); name GPUs that are there, or use --gpus cpu")
    assert not any(line.split("|")[-1].strip() == "torch" for line in imports)
    assert "ready" not in refused.stdout + refused.stderr


@pytest.mark.redis
def test_a_child_whose_gpu_does_not_open_takes_no_job_and_stops_the_worker(
    listed_gpus, make_png, tmp_path, subprocess_env, broker_env
):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    env = {**subprocess_env, **broker_env, **listed_gpus, "DSOCR_DATABASE_URL": url}
    make_png("p.png", folder=tmp_path / "pages")
    (tmp_path / "pages" / "list.txt").write_text("p.png\n")
    assert dsocr("-m", "dsocr_workers", "db", "upgrade", env=env).returncode == 0
    submitted = dsocr("-m", "dsocr_workers", "submit", str(tmp_path / "pages" / "list.txt"), "--mode", "tiny",
                      "--max-new-tokens", "2", env=env)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip().splitlines()[-1]

    stopped = dsocr("-m", "dsocr_workers", "worker", "--gpus", "0", "--warmup", "none", env=env, timeout=150)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        "error: child 0 on cuda:0: cuda:0 does not open in this process: this torch is built without CUDA"
    )
    db = open_database(url)
    try:
        with db.transaction() as session:
            counts = ledger.job_counts(session, run_id)
            assert dict(counts) == {"queued": 1}  # not failed, not claimed: a working worker takes it
    finally:
        db.dispose()
    assert Path(tmp_path / "d.db").is_file()
