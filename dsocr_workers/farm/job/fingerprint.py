"""The environment a result was measured in: host, device, driver and library versions, code version, model.

Collected once per loaded model in the worker child (it touches CUDA, so never in the parent). The id is
a hash of the content: the same environment always maps to the same `workers` row.
"""

from __future__ import annotations

import hashlib
import json
import platform
import socket
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

from dsocr_workers import __version__, settings
from dsocr_workers.engine.result import ModelSource

REPO_DIR = Path(__file__).resolve().parents[3]


@cache
def git_sha() -> str | None:
    """The checkout's commit; DSOCR_GIT_SHA where there is no checkout (container images set it at build)."""
    if sha := settings.read(settings.GIT_SHA):
        return sha[:40]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_DIR), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()[:40] or None


@cache
def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.stdout.strip() else None


def environment_fingerprint(device: str, source: ModelSource, runs_on: str = "") -> dict[str, Any]:
    """Column values of a `workers` row (including its content-hash `id`). `device` as the ledger names
    it; `runs_on`: as this process sees it, where that differs (farm/devices.py see_only_this_gpu)."""
    import torch
    import transformers

    gpu_name = gpu_uuid = None
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(runs_on or device))
        gpu_name = properties.name
        gpu_uuid = str(getattr(properties, "uuid", "")) or None
    values: dict[str, Any] = {
        "host": socket.gethostname(),
        "device": device,
        "gpu_name": gpu_name,
        "gpu_uuid": gpu_uuid,
        "driver": nvidia_driver() if gpu_name else None,
        "cuda": torch.version.cuda if gpu_name else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "project_version": __version__,
        "git_sha": git_sha(),
        "model_label": source.label,
        "model_fingerprint": source.fingerprint,
        "random_weights": source.random_weights,
    }
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    return {"id": digest[:32], **values}
