"""Checkpoint key names both families share: SAM's vendor module paths ↔ transformers' (spec §11), and
the decoder's vendor keys ↔ ours, whose routed experts the vendor stores one tensor per expert and we
hold stacked in transformers' fused tensors. A family's keys.py maps the rest of its tensors."""

from __future__ import annotations

import re

import torch

# SAM: vendor module path → transformers' (spec §11); block-internal norms are renamed separately.
SAM_PATHS = {
    "blocks": "layers",
    "patch_embed.proj": "patch_embed.projection",
    "neck.0": "neck.conv1",
    "neck.1": "neck.layer_norm1",
    "neck.2": "neck.conv2",
    "neck.3": "neck.layer_norm2",
    "net_2": "proj.conv1",
    "net_3": "proj.conv2",
}
_SAM_BLOCK_NORMS = {"norm1": "layer_norm1", "norm2": "layer_norm2"}
_VENDOR_SAM = "model.sam_model."

# A routed expert's weight in the vendor layout; the stacked experts in ours.
VENDOR_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
OUR_EXPERTS = re.compile(r"language_model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def _rename_sam(name: str, paths: dict[str, str], norms: dict[str, str]) -> str:
    for old, new in paths.items():
        if name == old or name.startswith(old + "."):
            name = new + name[len(old):]
            break
    parts = name.split(".")
    if parts[0] in ("layers", "blocks") and len(parts) > 2:
        parts[2] = norms.get(parts[2], parts[2])
    return ".".join(parts)


def sam_to_ours(vendor_key: str) -> str | None:
    """`sam.…` for a vendor SAM key (`model.sam_model.…`); None for any other key."""
    if not vendor_key.startswith(_VENDOR_SAM):
        return None
    return "sam." + _rename_sam(vendor_key.removeprefix(_VENDOR_SAM), SAM_PATHS, _SAM_BLOCK_NORMS)


def sam_to_vendor(key: str) -> str | None:
    """The vendor's name of our SAM key (`sam.…`); None for any other key."""
    if not key.startswith("sam."):
        return None
    inverse_paths = {new: old for old, new in SAM_PATHS.items()}
    inverse_norms = {new: old for old, new in _SAM_BLOCK_NORMS.items()}
    return _VENDOR_SAM + _rename_sam(key.removeprefix("sam."), inverse_paths, inverse_norms)


def decoder_to_ours(vendor_key: str) -> str:
    """The decoder's vendor keys (`model.layers.…`, `model.embed_tokens…`, `model.norm…`, `lm_head…`)."""
    return "language_model." + vendor_key.removeprefix("model.") if vendor_key.startswith("model.") else vendor_key


def decoder_to_vendor(key: str) -> str:
    return "model." + key.removeprefix("language_model.") if key.startswith("language_model.") else key


def unstack_experts(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Our stacked experts tensor `key` as the vendor's per-expert weights; None if `key` is no such
    tensor. transformers' `gate_up_proj` holds the gate rows first, then the up rows."""
    match = OUR_EXPERTS.fullmatch(key)
    if match is None:
        return None
    layer, kind = match.groups()
    prefix = f"model.layers.{layer}.mlp.experts"
    vendor: dict[str, torch.Tensor] = {}
    for expert, weight in enumerate(tensor.unbind(0)):
        if kind == "gate_up_proj":
            gate, up = weight.chunk(2, dim=0)
            vendor[f"{prefix}.{expert}.gate_proj.weight"] = gate
            vendor[f"{prefix}.{expert}.up_proj.weight"] = up
        else:
            vendor[f"{prefix}.{expert}.down_proj.weight"] = weight
    return vendor
