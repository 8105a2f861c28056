"""The fast engine's SAM attention: the relative positions folded into the query and key channels.

transformers' SAM attention (its SDPA variant) adds the decomposed relative-position term as an attention
bias: a (batch, heads, N, N) tensor built and read again in every block, 400 MB per global block of one
1024-px view in bf16, and a bias keeps the flash kernels out. The term is a sum of two lookups,
rel_h[q, row(k)] + rel_w[q, col(k)]: the dot product of q's (rel_h[q, ·], rel_w[q, ·]) with k's one-hot
row and column. Appended to the query and key as extra channels it becomes part of q·k, and attention
runs without a bias. The function is the same (the one-hots are exact in any dtype; the lookups are the
same einsum products); the query and key head dimension grows from 64 to 64 + H + W, H and W each padded
to a multiple of 8: 96 in the 14×14 windows, 144 for 640-px views, 192 for 1024-px views, within the fused
kernels' 256. The value keeps 64.
The eager engine, the numerical reference, keeps transformers' module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import (
    DeepseekOcr2SamVisionAttention,
    DeepseekOcr2SamVisionEncoder,
)

CHANNEL_MULTIPLE = 8  # head dims the fused attention kernels take


class FoldedRelPosAttention(nn.Module):
    """transformers' SAM attention (qkv, proj and relative-position tables reused) with the relative
    positions as extra query/key channels instead of an attention bias."""

    def __init__(self, attention: DeepseekOcr2SamVisionAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states: torch.Tensor, output_attentions: bool = False) -> tuple[torch.Tensor, None]:
        inner = self.attention
        batch, height, width, _ = hidden_states.shape
        heads = inner.num_attention_heads
        qkv = inner.qkv(hidden_states).reshape(batch, height * width, 3, heads, -1).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)  # (batch, heads, N, head_dim)
        channels = query.shape[-1]

        # The lookup tables padded to a multiple of 8 positions (zero rows: the padded one-hot columns
        # below never match), so the einsums' outputs and the concatenated head dim stay aligned.
        rel_h = _pad_positions(inner.get_rel_pos(height, height, inner.rel_pos_h).to(query.dtype))  # (H, H8, d)
        rel_w = _pad_positions(inner.get_rel_pos(width, width, inner.rel_pos_w).to(query.dtype))  # (W, W8, d)
        grid = query.reshape(batch, heads, height, width, channels)
        by_row = torch.einsum("bnhwc,hkc->bnhwk", grid, rel_h).reshape(batch, heads, height * width, -1)
        by_col = torch.einsum("bnhwc,wkc->bnhwk", grid, rel_w).reshape(batch, heads, height * width, -1)
        # One-hots by comparison: F.one_hot checks its input's range, a device sync outside a compiled graph.
        positions = torch.arange(height * width, device=query.device)[:, None]
        rows = (positions // width == torch.arange(rel_h.shape[1], device=query.device)).to(query.dtype)
        cols = (positions % width == torch.arange(rel_w.shape[1], device=query.device)).to(query.dtype)
        rows, cols = rows.expand(batch, heads, -1, -1), cols.expand(batch, heads, -1, -1)

        pad = -(channels + rel_h.shape[1] + rel_w.shape[1]) % CHANNEL_MULTIPLE
        query = F.pad(torch.cat([query * inner.scale, by_row, by_col], dim=-1), (0, pad))
        key = F.pad(torch.cat([key, rows, cols], dim=-1), (0, pad))
        # The value keeps its head dim: cuDNN's attention takes a narrower value than query and key (on
        # an H200 0.18 ms instead of 0.22 for a 1024-px view's global block with the value padded).
        out = F.scaled_dot_product_attention(query, key, value, scale=1.0)
        out = out.reshape(batch, heads, height, width, channels).permute(0, 2, 3, 1, 4).reshape(batch, height, width, -1)
        return inner.proj(out), None


def _pad_positions(table: torch.Tensor) -> torch.Tensor:
    """(positions, positions, d) → (positions, positions rounded up to CHANNEL_MULTIPLE, d), zeros added."""
    return F.pad(table, (0, 0, 0, -table.shape[1] % CHANNEL_MULTIPLE))


def fold_relative_positions(sam: DeepseekOcr2SamVisionEncoder) -> None:
    """Swap every SAM block's attention for FoldedRelPosAttention (blocks without relative positions keep
    theirs)."""
    for layer in sam.layers:
        attention = layer.attn
        if isinstance(attention, DeepseekOcr2SamVisionAttention) and attention.use_rel_pos:
            layer.attn = FoldedRelPosAttention(attention)
