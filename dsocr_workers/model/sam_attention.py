"""The fast engine's SAM attention: the relative positions folded into the query and key channels.

transformers' SAM attention adds the decomposed relative-position term as an attention bias, a
(batch, heads, N, N) tensor built and read in every block, which also keeps the flash kernels out. The
term is rel_h[q, row(k)] + rel_w[q, col(k)]: the dot product of q's (rel_h[q, ·], rel_w[q, ·]) with k's
one-hot row and column. Appended to the query and key as extra channels it becomes part of q·k, and
attention runs without a bias: the same function, with the head dimension grown from 64 to 64 + H + W
rounded up to a multiple of 8 (within the fused kernels' 256). The value keeps 64.

One Triton kernel builds the three operands from the qkv projection (`_fold_kernel`), fewer kernels than
the torch ops that build the same tensors. The eager engine, the numerical reference, keeps
transformers' module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import (
    DeepseekOcr2SamVisionAttention,
    DeepseekOcr2SamVisionEncoder,
)

CHANNEL_MULTIPLE = 8  # head dims the fused attention kernels take
FOLD_WARPS = 4


@triton.jit
def _fold_kernel(
    qkv_ptr, table_h_ptr, table_w_ptr, query_ptr, key_ptr, value_ptr,
    heads, scale,
    HEIGHT: tl.constexpr, WIDTH: tl.constexpr, FOLDED: tl.constexpr, CHANNELS: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REL_W: tl.constexpr, BLOCK_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One row of one head's grid: qkv [B, H, W, 3, heads, C] → query and key [B, heads, H·W, FOLDED],
    value [B, heads, H·W, C].

    query = (q·scale, rel_h: q·T_h[h − r + H − 1] for key rows r, rel_w: q·T_w[w − s + W − 1] for key
    columns s, zeros); key = (k, one-hot of its row h, one-hot of its column w, zeros); T_h (2H − 1, C) and
    T_w (2W − 1, C) are the relative-position tables at this grid's size. The grid's sizes are compile-time
    constants: Triton then knows the column offsets' alignment and stores vectors, not elements."""
    batch_head = tl.program_id(0)
    h = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    dtype = query_ptr.dtype.element_ty
    w = tl.arange(0, BLOCK_W)
    w_ok = w < WIDTH
    c = tl.arange(0, CHANNELS)
    source = ((batch * HEIGHT + h) * WIDTH + w).to(tl.int64) * (3 * heads * CHANNELS) + head * CHANNELS
    q = tl.load(qkv_ptr + source[:, None] + c[None, :], mask=w_ok[:, None], other=0.0)
    k = tl.load(qkv_ptr + source[:, None] + heads * CHANNELS + c[None, :], mask=w_ok[:, None], other=0.0)
    v = tl.load(qkv_ptr + source[:, None] + 2 * heads * CHANNELS + c[None, :], mask=w_ok[:, None], other=0.0)

    # rel_h: the table's rows for this query row h against every key row r, one product.
    r = tl.arange(0, BLOCK_H)
    r_ok = r < HEIGHT
    table_h = tl.load(table_h_ptr + (h - r + HEIGHT - 1)[:, None] * CHANNELS + c[None, :], mask=r_ok[:, None],
                      other=0.0)
    rel_h = tl.dot(q, tl.trans(table_h), input_precision=PRECISION).to(dtype)
    # rel_w: each query column w needs its own table rows, so q against every distance d = w − s + W − 1
    # in one product, then each row's distances picked out.
    d = tl.arange(0, BLOCK_REL_W)
    table_w = tl.load(table_w_ptr + d[:, None] * CHANNELS + c[None, :], mask=(d < 2 * WIDTH - 1)[:, None],
                      other=0.0)
    by_distance = tl.dot(q, tl.trans(table_w), input_precision=PRECISION)
    s = tl.arange(0, BLOCK_W)
    distance = tl.minimum(tl.maximum(w[:, None] - s[None, :] + WIDTH - 1, 0), BLOCK_REL_W - 1)
    rel_w = tl.gather(by_distance, distance, axis=1).to(dtype)

    target = ((batch_head * HEIGHT + h) * WIDTH + w).to(tl.int64)
    rows = query_ptr + target[:, None] * FOLDED
    keys = key_ptr + target[:, None] * FOLDED
    tl.store(rows + c[None, :], (q.to(tl.float32) * scale).to(dtype), mask=w_ok[:, None])
    tl.store(keys + c[None, :], k, mask=w_ok[:, None])
    tl.store(value_ptr + target[:, None] * CHANNELS + c[None, :], v, mask=w_ok[:, None])
    row_mask = w_ok[:, None] & r_ok[None, :]
    tl.store(rows + CHANNELS + r[None, :], rel_h, mask=row_mask)
    tl.store(keys + CHANNELS + r[None, :], (r[None, :] == h).to(dtype) + tl.zeros_like(rel_h), mask=row_mask)
    col_mask = w_ok[:, None] & (s < WIDTH)[None, :]
    tl.store(rows + CHANNELS + HEIGHT + s[None, :], rel_w, mask=col_mask)
    tl.store(keys + CHANNELS + HEIGHT + s[None, :], (s[None, :] == w[:, None]).to(dtype), mask=col_mask)
    pad = tl.arange(0, BLOCK_PAD)
    pad_mask = w_ok[:, None] & (pad < FOLDED - CHANNELS - HEIGHT - WIDTH)[None, :]
    zeros = tl.zeros([BLOCK_W, BLOCK_PAD], dtype=dtype)
    tl.store(rows + CHANNELS + HEIGHT + WIDTH + pad[None, :], zeros, mask=pad_mask)
    tl.store(keys + CHANNELS + HEIGHT + WIDTH + pad[None, :], zeros, mask=pad_mask)


def launch_fold(qkv: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor, heads: int, scale: float,
                warps: int = FOLD_WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, H, W, 3·heads·C]; table_h [2H − 1, C], table_w [2W − 1, C] → query and key [B, heads, H·W,
    folded], value [B, heads, H·W, C] (`_fold_kernel`; the warps are an argument for a benchmark's sweep)."""
    batch, height, width, _ = qkv.shape
    channels = table_h.shape[1]
    folded = folded_channels(channels, height, width)
    query = torch.empty(batch, heads, height * width, folded, dtype=qkv.dtype, device=qkv.device)
    key = torch.empty_like(query)
    value = torch.empty(batch, heads, height * width, channels, dtype=qkv.dtype, device=qkv.device)
    # tl.dot takes blocks of at least 16 along each side.
    wrap_triton(_fold_kernel)[(batch * heads, height)](
        qkv.contiguous(), table_h.contiguous(), table_w.contiguous(), query, key, value,
        heads, scale, HEIGHT=height, WIDTH=width, FOLDED=folded, CHANNELS=channels,
        BLOCK_W=max(16, triton.next_power_of_2(width)), BLOCK_H=max(16, triton.next_power_of_2(height)),
        BLOCK_REL_W=max(16, triton.next_power_of_2(2 * width - 1)), BLOCK_PAD=CHANNEL_MULTIPLE,
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", num_warps=warps,
    )
    return query, key, value


@triton_op("dsocr::fold_relative_positions", mutates_args=())
def fold_on_gpu(qkv: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor, heads: int, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`launch_fold` as an operator torch.compile traces into its graph."""
    return launch_fold(qkv, table_h, table_w, heads, scale)


def fold_with_torch(qkv: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor, heads: int, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`launch_fold`'s result from torch operations: the CPU's path (a compiled graph cannot trace Triton's
    interpreter, the kernel's only way to run on a CPU) and the kernel's reference in the tests."""
    batch, height, width, _ = qkv.shape
    channels = table_h.shape[1]
    query, key, value = (
        qkv.reshape(batch, height * width, 3, heads, channels).permute(2, 0, 3, 1, 4).unbind(0)
    )
    by_row = _by_position(table_h, height)  # (H, H, C): [i, j] = T_h[i − j + H − 1]
    by_col = _by_position(table_w, width)
    grid = query.reshape(batch, heads, height, width, channels)
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", grid, by_row).reshape(batch, heads, height * width, height)
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", grid, by_col).reshape(batch, heads, height * width, width)
    # One-hots by comparison: F.one_hot checks its input's range, a device sync outside a compiled graph.
    positions = torch.arange(height * width, device=qkv.device)[:, None]
    rows = (positions // width == torch.arange(height, device=qkv.device)).to(qkv.dtype)
    cols = (positions % width == torch.arange(width, device=qkv.device)).to(qkv.dtype)
    rows, cols = rows.expand(batch, heads, -1, -1), cols.expand(batch, heads, -1, -1)
    pad = folded_channels(channels, height, width) - channels - height - width
    folded_query = F.pad(torch.cat([query * scale, rel_h, rel_w], dim=-1), (0, pad))
    folded_key = F.pad(torch.cat([key, rows, cols], dim=-1), (0, pad))
    return folded_query, folded_key, value.contiguous()


def _by_position(table: torch.Tensor, size: int) -> torch.Tensor:
    distances = torch.arange(size, device=table.device)
    return table[distances[:, None] - distances[None, :] + size - 1]


def folded_channels(channels: int, height: int, width: int) -> int:
    """The query and key head dim: C + H + W rounded up to CHANNEL_MULTIPLE."""
    return -(-(channels + height + width) // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE


class FoldedRelPosAttention(nn.Module):
    """transformers' SAM attention (qkv, proj and relative-position tables reused) with the relative
    positions as extra query/key channels instead of an attention bias."""

    def __init__(self, attention: DeepseekOcr2SamVisionAttention) -> None:
        super().__init__()
        channels = attention.rel_pos_h.shape[1]
        if channels < 16 or channels & (channels - 1):
            raise ValueError(
                f"the folded SAM attention takes a head dim that is a power of 2 from 16, not {channels}"
            )
        self.attention = attention

    def forward(
        self, hidden_states: torch.Tensor, output_attentions: bool = False
    ) -> tuple[torch.Tensor, None]:
        inner = self.attention
        batch, height, width, _ = hidden_states.shape
        table_h = _distance_table(inner.get_rel_pos(height, height, inner.rel_pos_h)).to(hidden_states.dtype)
        table_w = _distance_table(inner.get_rel_pos(width, width, inner.rel_pos_w)).to(hidden_states.dtype)
        fold = fold_on_gpu if hidden_states.is_cuda else fold_with_torch
        query, key, value = fold(
            inner.qkv(hidden_states), table_h, table_w, inner.num_attention_heads, inner.scale
        )
        # The value keeps its head dim: cuDNN's attention takes a narrower value than query and key,
        # faster than padding it.
        out = F.scaled_dot_product_attention(query, key, value, scale=1.0)
        out = out.reshape(batch, inner.num_attention_heads, height, width, -1).permute(0, 2, 3, 1, 4)
        return inner.proj(out.reshape(batch, height, width, -1)), None


def _distance_table(by_position: torch.Tensor) -> torch.Tensor:
    """transformers' (size, size, C) lookup, table[i − j + size − 1] at [i, j], back to the (2·size − 1, C)
    table it indexes: row 0 holds distances size − 1 … 0, column 0 the distances from size up."""
    return torch.cat([by_position[0].flip(0), by_position[1:, 0]])


def fold_relative_positions(sam: DeepseekOcr2SamVisionEncoder) -> None:
    """Swap every SAM block's attention for FoldedRelPosAttention (blocks without relative positions keep
    theirs)."""
    for layer in sam.layers:
        attention = layer.attn
        if isinstance(attention, DeepseekOcr2SamVisionAttention) and attention.use_rel_pos:
            layer.attn = FoldedRelPosAttention(attention)
