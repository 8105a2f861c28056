"""Which devices a host's worker runs jobs on (`--gpus`), and how a child sees its own.

The worker's parent never imports torch or touches CUDA: GPUs are counted with `nvidia-smi`."""

from __future__ import annotations

import os
import subprocess

from dsocr_workers.errors import InputError


def count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def parse_devices(gpus: str) -> list[str]:
    """`auto` → every GPU, or the CPU where there is none; `all` → every GPU (none found: an error);
    `0,1` → those GPUs; `cpu` → the CPU."""
    text = gpus.strip().lower()
    if text == "cpu":
        return ["cpu"]
    if text == "auto":
        count = count_gpus()
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    if text == "all":
        count = count_gpus()
        if count == 0:
            raise InputError("--gpus all: nvidia-smi finds no GPU; use --gpus cpu on a machine without one")
        return [f"cuda:{i}" for i in range(count)]
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--gpus {gpus!r}: expected auto, all, cpu, or GPU indices like 0,1") from None
    if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
        raise InputError(f"--gpus {gpus!r}: expected distinct GPU indices like 0,1")
    return [f"cuda:{i}" for i in indices]


def see_only_this_gpu(device: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The device a Celery child runs on once it sees only its own GPU (`CUDA_VISIBLE_DEVICES`): `cuda:0`
    in every child, whichever GPU it has. Inductor's compiled graphs name their device's index, so a
    compile cache filled on cuda:0 served only the children on cuda:0 (2 x H200: the child on cuda:1
    compiled 34 s of graphs the warm cache held for cuda:0, docs/benchmarks.md). Call before CUDA is
    initialised in this process; otherwise, or for a device that is not one GPU, `device` as it is."""
    import torch

    if not device.startswith("cuda:") or torch.cuda.is_initialized():
        return device
    index = int(device.removeprefix("cuda:"))
    visible = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    if "CUDA_VISIBLE_DEVICES" in environ and index >= len(visible):
        return device  # not there: torch's own error says so when the model loads
    environ["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    return "cuda:0"
