"""Which devices a host's worker runs jobs on (`--gpus`), and how a child sees its own.

The worker's parent never touches CUDA: GPUs are counted with `nvidia-smi`."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

from dsocr_workers.errors import InputError
from dsocr_workers.settings import VISIBLE_GPUS, read


def count_gpus(environ: Mapping[str, str] = os.environ) -> int:
    """The GPUs this process may use: those `nvidia-smi` lists, narrowed to `CUDA_VISIBLE_DEVICES` where
    it is set (the indices of `--gpus` count those, as CUDA does: see_only_this_gpu)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True, env=dict(environ)
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    if "CUDA_VISIBLE_DEVICES" in environ:
        count = min(count, len(_visible_entries(environ)))
    return count


def _visible_entries(environ: Mapping[str, str]) -> list[str]:
    return [entry.strip() for entry in (read(VISIBLE_GPUS, environ) or "").split(",") if entry.strip()]


def parse_devices(gpus: str, environ: Mapping[str, str] = os.environ) -> list[str]:
    """`auto` → every GPU, or the CPU where there is none; `all` → every GPU (none found: an error);
    `0,1` → those GPUs, each of which must be there (a worker told to use a GPU it cannot see would
    otherwise say it is ready and fail every job); `cpu` → the CPU, `cpu,cpu` → two lanes on it (a
    CPU is shared; a GPU is named once)."""
    text = gpus.strip().lower()
    lanes = [part.strip() for part in text.split(",") if part.strip()]
    if lanes and set(lanes) == {"cpu"}:
        return lanes
    if text == "auto":
        count = count_gpus(environ)
        return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]
    if text == "all":
        count = count_gpus(environ)
        if count == 0:
            raise InputError(f"--gpus all: {_gpus_seen(0, environ)}; use --gpus cpu on a machine without one")
        return [f"cuda:{i}" for i in range(count)]
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--gpus {gpus!r}: expected auto, all, cpu (cpu,cpu: two lanes), or GPU indices like 0,1") from None
    if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
        raise InputError(f"--gpus {gpus!r}: expected distinct GPU indices like 0,1")
    count = count_gpus(environ)
    if max(indices) >= count:
        missing = ", ".join(str(i) for i in indices if i >= count)
        raise InputError(
            f"--gpus {gpus}: no GPU {missing} on this host ({_gpus_seen(count, environ)}); "
            "name GPUs that are there, or use --gpus cpu"
        )
    return [f"cuda:{i}" for i in indices]


def _gpus_seen(count: int, environ: Mapping[str, str]) -> str:
    narrowed = ""
    if "CUDA_VISIBLE_DEVICES" in environ:
        narrowed = f" that CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} leaves"
    if count == 0:
        return f"nvidia-smi finds no GPU{narrowed}"
    return f"nvidia-smi finds {count}{narrowed}: " + (f"0 to {count - 1}" if count > 1 else "0")


def see_only_this_gpu(device: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The device a Celery child runs on once it sees only its own GPU (`CUDA_VISIBLE_DEVICES`): `cuda:0`
    in every child, whichever GPU it has: inductor's compiled graphs name their device's index, so one
    compile cache then serves every child. Call before CUDA is initialised in this process; otherwise,
    or for a device that is not one GPU, `device` as it is."""
    import torch

    if not device.startswith("cuda:") or torch.cuda.is_initialized():
        return device
    index = int(device.removeprefix("cuda:"))
    visible = _visible_entries(environ)
    if "CUDA_VISIBLE_DEVICES" in environ and index >= len(visible):
        return device  # not there: open_device says so in the child
    environ["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    return "cuda:0"


def open_device(device: str) -> None:
    """Put a tensor on `device` (as this process sees it), or raise an InputError saying why it cannot:
    a worker child checks its GPU this way before it takes a message, rather than fail every job it is
    given (a CPU-only torch, a GPU that nvidia-smi lists but CUDA cannot open)."""
    import torch

    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "CUDA finds no usable GPU"
        raise InputError(f"{device} does not open in this process: {why}")
    try:
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)  # the session makes it current too: no context on another GPU
        torch.empty(1, device=resolved)
    except Exception as exc:  # torch says why in its own words: an invalid ordinal, a busy GPU, …
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # CUDA's advice follows it
        raise InputError(f"{device} does not open in this process: {first_line}") from exc
