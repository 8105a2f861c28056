"""The device and dtype a session runs on: names resolved (with a clear error for one that is not
here), the device made current, float32 kept float32."""

from __future__ import annotations

import torch

from dsocr_workers.errors import InputError

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"unknown device {device!r}: {exc}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} asked for, but CUDA is not available here")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def make_current(device: torch.device) -> None:
    """A session's process drives one GPU: its device becomes the current one, so that CUDA graph
    capture streams, events and synchronisations run on it rather than on cuda:0 (a worker child on
    cuda:1 otherwise fails to capture its graphs)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def set_numerics(device: torch.device, dtype: torch.dtype) -> None:
    """float32 means float32: cuDNN runs float32 convolutions in TF32 unless told not to, which moves
    the eager reference's SAM convolutions away from the fast engine's patch-embedding GEMM."""
    if device.type == "cuda" and dtype == torch.float32:
        torch.backends.cudnn.allow_tf32 = False
