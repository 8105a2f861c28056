"""DeepSeek-OCR (v1)'s checkpoint keys: the vendor's names ↔ our module names. SAM and the decoder
follow the shared maps (model/keys.py); CLIP, the projector and the two learned vectors keep the vendor's
names under our prefixes."""

from __future__ import annotations

import torch

from dsocr_workers.model.deepseek_ocr.config import OCRConfig
from dsocr_workers.model.keys import (
    decoder_to_ours,
    decoder_to_vendor,
    sam_to_ours,
    sam_to_vendor,
    unstack_experts,
)

LAYOUTS = ("vendor",)  # the checkpoint layouts this family reads
_VECTORS = ("image_newline", "view_seperator")  # sic: the vendor's spelling


def to_ours(key: str, layout: str = "vendor") -> str:
    """Our state-dict name of a vendor key (a routed expert's weight is stacked by the reader)."""
    sam = sam_to_ours(key)
    if sam is not None:
        return sam
    if key.startswith("model.vision_model."):
        return "clip." + key.removeprefix("model.vision_model.")
    if key.startswith("model.projector.layers."):
        return "projector." + key.removeprefix("model.projector.layers.")
    if key in ("model.image_newline", "model.view_seperator"):
        return key.removeprefix("model.")
    return decoder_to_ours(key)


def to_vendor(key: str) -> str:
    sam = sam_to_vendor(key)
    if sam is not None:
        return sam
    if key.startswith("clip."):
        return "model.vision_model." + key.removeprefix("clip.")
    if key.startswith("projector."):
        return "model.projector.layers." + key.removeprefix("projector.")
    if key in _VECTORS:
        return "model." + key
    return decoder_to_vendor(key)


def to_vendor_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict → the vendor's 2,710-key layout (experts unstacked)."""
    vendor: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        experts = unstack_experts(key, tensor)
        vendor.update(experts if experts is not None else {to_vendor(key): tensor})
    return vendor


def expected_shapes(config: OCRConfig, layout: str = "vendor") -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` in `layout` holds, by its name there, with its shape."""
    from dsocr_workers.model.deepseek_ocr.modeling import DeepSeekOCR

    with torch.device("meta"):
        model = DeepSeekOCR(config)
    return {key: tuple(t.shape) for key, t in to_vendor_state(model.state_dict()).items()}
