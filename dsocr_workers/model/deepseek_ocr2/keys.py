"""Our state-dict names ↔ DeepSeek-OCR-2's two checkpoint layouts.

- The remote code's (`model.safetensors` of deepseek-ai/DeepSeek-OCR-2, 2707 tensors):
  `model.sam_model.*` (`net_2`/`net_3`), `model.qwen2_model.model.model.{layers.N.*,norm.weight}`,
  `model.qwen2_model.query_{768,1024}.weight`, `model.projector.layers.*`, `model.view_seperator`,
  and v1's language-model keys with one tensor per routed expert.
- transformers' `DeepseekOcr2ForConditionalGeneration` module names: `model.vision_tower.*`,
  `model.multi_modal_projector.*`, `model.view_separator`, `model.language_model.*` with the experts
  fused as ours are, `lm_head.weight`.
The SAM renames and the expert (un)stacking are shared (model/keys.py): the same SAM and decoder; the
checkpoint reader (model/checkpoint.py) stacks the vendor's experts as it streams them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsocr_workers.model.deepseek_ocr2.config import OCR2Config
from dsocr_workers.model.deepseek_ocr2.modeling import DeepSeekOCR2
from dsocr_workers.model.keys import (
    decoder_to_ours,
    decoder_to_vendor,
    sam_to_ours,
    sam_to_vendor,
    unstack_experts,
)

LAYOUTS = ("vendor", "transformers")  # the checkpoint layouts this family reads

_ENCODER = "model.qwen2_model.model.model."
# Our prefix → the vendor's, for the parts that are OCR-2's own (first match wins).
_VENDOR_PREFIXES = (
    ("encoder.", _ENCODER),
    ("query_768.", "model.qwen2_model.query_768."),
    ("query_1024.", "model.qwen2_model.query_1024."),
)
_TRANSFORMERS_PREFIXES = (
    ("sam.", "model.vision_tower.sam_encoder."),
    ("encoder.", "model.vision_tower.vision_encoder."),
    ("query_768.", "model.vision_tower.query_768_resolution."),
    ("query_1024.", "model.vision_tower.query_1024_resolution."),
    ("projector.", "model.multi_modal_projector."),
    ("view_seperator", "model.view_separator"),
    ("language_model.", "model.language_model."),
)


def _swap_prefix(key: str, pairs: tuple[tuple[str, str], ...], reverse: bool = False) -> str | None:
    for ours, theirs in pairs:
        old, new = (theirs, ours) if reverse else (ours, theirs)
        if key.startswith(old):
            return new + key[len(old):]
    return None


def vendor_key(ours: str) -> str:
    """Our name of any tensor but the stacked experts → the vendor's (`to_vendor_state` splits those)."""
    return _swap_prefix(ours, _VENDOR_PREFIXES) or sam_to_vendor(ours) or _projector_and_vectors(ours)


def _projector_and_vectors(ours: str) -> str:
    if ours.startswith("projector."):
        return "model.projector.layers." + ours.removeprefix("projector.")
    if ours == "view_seperator":
        return "model.view_seperator"
    return decoder_to_vendor(ours)


def our_key(vendor: str) -> str:
    """A vendor name of any tensor but a routed expert's → ours (the reader stacks those)."""
    found = _swap_prefix(vendor, _VENDOR_PREFIXES, reverse=True) or sam_to_ours(vendor)
    if found is not None:
        return found
    if vendor.startswith("model.projector.layers."):
        return "projector." + vendor.removeprefix("model.projector.layers.")
    if vendor == "model.view_seperator":
        return "view_seperator"
    return decoder_to_ours(vendor)


def to_ours(key: str, layout: str) -> str:
    """Our state-dict name of a checkpoint key in `layout` ("vendor" or "transformers")."""
    return our_key(key) if layout == "vendor" else from_transformers_key(key)


def to_vendor_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict → the vendor's 2707-key layout (experts unstacked, as v1's)."""
    vendor: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        experts = unstack_experts(key, tensor)
        vendor.update(experts if experts is not None else {vendor_key(key): tensor})
    return vendor


def transformers_key(ours: str) -> str:
    """Our name → transformers' `DeepseekOcr2ForConditionalGeneration` name (experts fused in both)."""
    return _swap_prefix(ours, _TRANSFORMERS_PREFIXES) or ours  # lm_head.weight is the same


def from_transformers_key(theirs: str) -> str:
    return _swap_prefix(theirs, _TRANSFORMERS_PREFIXES, reverse=True) or theirs


def expected_shapes(config: OCR2Config, layout: str = "vendor") -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a checkpoint of `config` in `layout` (what the reader checks from
    the safetensors headers before reading any data)."""
    with torch.device("meta"):
        state = DeepSeekOCR2(config).state_dict()
    if layout == "transformers":
        return {transformers_key(key): tuple(tensor.shape) for key, tensor in state.items()}
    return {key: tuple(tensor.shape) for key, tensor in to_vendor_state(state).items()}
