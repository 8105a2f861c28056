"""DeepSeek-OCR-2's random-weight presets (`ocr2-tiny`, `ocr2-full`): v1's recipe (model/checkpoint.py:
each weight a pure function of seed, tensor name and position, made on the target device) over this
family's tensors, and a preset written as a vendor-layout checkpoint directory. Random weights are
labelled as such wherever they go (`PRESET_METADATA_KEY` in the safetensors metadata)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsocr_workers.errors import InputError
from dsocr_workers.model.checkpoint import (
    INDEX_FILE,
    PRESET_METADATA_KEY,
    SAFETENSORS_FILE,
    _fill_random_,
    _init_std,
    _normal_quantiles,
)
from dsocr_workers.model.deepseek_ocr2.config import PRESETS, OCR2Config
from dsocr_workers.model.deepseek_ocr2.keys import our_shapes, to_vendor_state
from dsocr_workers.model.deepseek_ocr2.modeling import DeepSeekOCR2
from dsocr_workers.model.tokenizer import OCRTokenizer

_CPU = torch.device("cpu")


def preset_config(name: str) -> OCR2Config:
    if name not in PRESETS:
        raise InputError(f"unknown DeepSeek-OCR-2 preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_state(
    config: OCR2Config,
    seed: int,
    *,
    device: torch.device = _CPU,
    dtype: torch.dtype = torch.bfloat16,
    keys: Sequence[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights, tensor by tensor in state-dict order (or `keys`'), bfloat16 values
    whatever `dtype` (a saved preset reloads bit-identically), the same on every device."""
    shapes = our_shapes(config)
    stds = {key: _init_std(key, shapes[key]) for key in (shapes if keys is None else keys)}
    scales = sorted({std for std in stds.values() if std is not None})
    tables = (_normal_quantiles() * torch.tensor(scales, dtype=torch.float64)[:, None]).to(torch.bfloat16)
    tables = tables.to(dtype).to(device)
    for key, std in stds.items():
        if std is None:  # norms: weight 1, bias 0
            make = torch.ones if key.endswith("weight") else torch.zeros
            yield key, make(shapes[key], device=device, dtype=dtype)
            continue
        tensor = torch.empty(shapes[key], device=device, dtype=dtype)
        _fill_random_(tensor.view(-1), tables[scales.index(std)], seed, key)
        yield key, tensor


def materialize(
    config: OCR2Config,
    state: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> DeepSeekOCR2:
    """The module built on the meta device, `state` assigned (strict), then the non-persistent RoPE
    buffers (the encoder's and the decoder's) rebuilt on `device`."""
    with torch.device("meta"):
        model = DeepSeekOCR2(config, attn_implementation, experts_implementation)
    model.load_state_dict({k: t.to(device=device, dtype=dtype) for k, t in state.items()}, strict=True, assign=True)
    with torch.device(device):
        text, encoder = model.language_model, model.encoder
        text.rotary_emb = type(text.rotary_emb)(config=text.config)
        # transformers annotates the vision RoPE with the vision config; its encoder passes its own
        encoder.rotary_emb = type(encoder.rotary_emb)(config=encoder.config)  # type: ignore[arg-type]
    leftover = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if leftover:
        raise RuntimeError(f"buffers left on the meta device: {leftover}")
    return model.eval().requires_grad_(False)


def build_preset(
    name: str,
    *,
    seed: int = 0,
    device: torch.device = _CPU,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> DeepSeekOCR2:
    """A preset's model with its seeded random weights made on `device`."""
    config = preset_config(name)
    state = dict(preset_state(config, seed, device=device, dtype=dtype))
    return materialize(config, state, device, dtype, attn_implementation, experts_implementation)


def save_preset(name: str, directory: str | Path, *, seed: int = 0, device: torch.device = _CPU) -> Path:
    """A preset written as a vendor-layout checkpoint directory (config.json, one safetensors file and
    its index, the preset tokenizer), tagged `PRESET_METADATA_KEY = "<name>:seed<seed>"`."""
    config = preset_config(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = dict(preset_state(config, seed, device=device))
    vendor = {key: tensor.contiguous().cpu() for key, tensor in to_vendor_state(state).items()}
    del state
    save_file(
        vendor, str(directory / SAFETENSORS_FILE), metadata={"format": "pt", PRESET_METADATA_KEY: f"{name}:seed{seed}"}
    )
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in vendor.values())},
        "weight_map": {key: SAFETENSORS_FILE for key in sorted(vendor)},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config.to_vendor(), indent=2))
    OCRTokenizer.build_preset().save(directory)
    return directory
