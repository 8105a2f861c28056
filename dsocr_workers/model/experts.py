"""The vendor's routed-expert dispatch, registered as a transformers experts implementation.

transformers' own "eager" experts loop reads a data-dependent index per expert (one host sync per
selected expert: 6 per layer and token at decode), while the vendor's DeepSeek-V2 `moe_infer` syncs
once per layer: it sorts the (token, expert) pairs by expert, reads the per-expert counts to the host
once, runs each non-empty expert on a contiguous slice, and sums the top-k outputs in float32 with the
(un-renormalised) routing weights. The `eager` engine uses this, so its cost and its numerics follow the
vendor path; the `fast` engine uses its own GEMVs over the selected experts (model/selected_experts.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface

VENDOR_LOOP = "dsocr_vendor_loop"


def vendor_loop_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """hidden_states (T, H); top_k_index, top_k_weights (T, k). `self` is transformers' experts module
    (fused `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], `act_fn`)."""
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync per layer
    rows = hidden_states[order // top_k]
    outputs = []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chunk = rows[start: start + count]
        gate, up = F.linear(chunk, self.gate_up_proj[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[expert]))
        start += count
    expert_out = torch.cat(outputs)
    unsorted = torch.empty_like(expert_out)
    unsorted[order] = expert_out
    weighted = unsorted.view(tokens, top_k, -1).to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


ExpertsInterface.register(VENDOR_LOOP, vendor_loop_experts_forward)
