"""Our state-dict names ↔ DeepSeek-OCR-2's two checkpoint layouts.

- The remote code's (`model.safetensors` of deepseek-ai/DeepSeek-OCR-2, 2707 tensors):
  `model.sam_model.*` (`net_2`/`net_3`), `model.qwen2_model.model.model.{layers.N.*,norm.weight}`,
  `model.qwen2_model.query_{768,1024}.weight`, `model.projector.layers.*`, `model.view_seperator`,
  and v1's language-model keys with one tensor per routed expert.
- transformers' `DeepseekOcr2ForConditionalGeneration` module names: `model.vision_tower.*`,
  `model.multi_modal_projector.*`, `model.view_separator`, `model.language_model.*` with the experts
  fused as ours are, `lm_head.weight`.
The SAM renames and the expert (un)stacking are v1's (model/checkpoint.py): the same SAM and decoder.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsocr_workers.model.checkpoint import (
    _OUR_EXPERTS,
    _VENDOR_EXPERT,
    _rename_to_ours,
    _rename_to_vendor,
)
from dsocr_workers.model.checkpoint import to_vendor_state as _v1_to_vendor_state
from dsocr_workers.model.deepseek_ocr2.config import OCR2Config
from dsocr_workers.model.deepseek_ocr2.modeling import DeepSeekOCR2

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
    return _swap_prefix(ours, _VENDOR_PREFIXES) or _rename_to_vendor(ours)


def our_key(vendor: str) -> str:
    """A vendor name of any tensor but a routed expert's → ours (`from_vendor_state` stacks those)."""
    return _swap_prefix(vendor, _VENDOR_PREFIXES, reverse=True) or _rename_to_ours(vendor)


def to_vendor_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict → the vendor's 2707-key layout (experts unstacked, as v1's)."""
    vendor = {}
    for key, tensor in state.items():
        if _OUR_EXPERTS.fullmatch(key):
            vendor.update(_v1_to_vendor_state({key: tensor}))
        else:
            vendor[vendor_key(key)] = tensor
    return vendor


def from_vendor_state(vendor: Mapping[str, torch.Tensor], config: OCR2Config) -> dict[str, torch.Tensor]:
    """The vendor's tensors → our state dict, the routed experts stacked into the fused tensors."""
    count = config.text.n_routed_experts
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in vendor.items():
        match = _VENDOR_EXPERT.fullmatch(key)
        if match is None:
            state[our_key(key)] = tensor
            continue
        layer, expert, kind = match.groups()
        experts.setdefault(f"{layer}.{kind}", {})[int(expert)] = tensor
    layers = sorted({name.split(".")[0] for name in experts}, key=int)
    for layer in layers:
        prefix = f"language_model.layers.{layer}.mlp.experts"
        gate, up, down = (experts[f"{layer}.{kind}"] for kind in ("gate", "up", "down"))
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]) for e in range(count)])
        state[f"{prefix}.down_proj"] = torch.stack([down[e] for e in range(count)])
    return state


def transformers_key(ours: str) -> str:
    """Our name → transformers' `DeepseekOcr2ForConditionalGeneration` name (experts fused in both)."""
    return _swap_prefix(ours, _TRANSFORMERS_PREFIXES) or ours  # lm_head.weight is the same


def from_transformers_key(theirs: str) -> str:
    return _swap_prefix(theirs, _TRANSFORMERS_PREFIXES, reverse=True) or theirs


def to_transformers_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {transformers_key(key): tensor for key, tensor in state.items()}


def from_transformers_state(theirs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {from_transformers_key(key): tensor for key, tensor in theirs.items()}


def our_shapes(config: OCR2Config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = DeepSeekOCR2(config)
    return {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}


def expected_vendor_shapes(config: OCR2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of a vendor-layout checkpoint of `config` (what a loader checks
    from the safetensors headers before reading any data)."""
    with torch.device("meta"):
        state = DeepSeekOCR2(config).state_dict()
    return {key: tuple(tensor.shape) for key, tensor in to_vendor_state(state).items()}
