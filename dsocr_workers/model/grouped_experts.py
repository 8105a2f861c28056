"""Routed experts for a prompt: two Triton grouped GEMMs over the (token, expert) pairs sorted by expert.

Faster than transformers' `grouped_mm` experts, whose kernels around the GEMM (the gather of sorted rows,
the activation as its own pass, the unsort) cost as much as reading the weights (docs/benchmarks.md,
prefill). Each program block takes up to `m` pairs of one expert and `n` output columns: gate+up gathers
the pairs' token rows itself and applies the activation before it stores; down applies the routing
weight and stores each pair's row at its place in the token order. Block bookkeeping stays on the device
(a fixed grid of `pairs / m + experts` blocks, the surplus exiting at once), so a CUDA graph captures it.

Numerics follow `grouped_mm`'s (float32 accumulation, projections rounded to the weights' dtype before
the activation and the routing weight, the top-k sum in float32; float32 weights without TF32). On a
CPU the kernels run only under Triton's interpreter (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@dataclass(frozen=True)
class GroupedBlocks:
    """One program block: `m` pairs × `n` output columns, `k` inputs per loop step."""

    m: int
    n: int
    k: int
    warps: int
    stages: int


@dataclass(frozen=True)
class KernelBlocks:
    """The blocks of both kernels of one call: they walk the same blocks of pairs, so one `m`."""

    gate_up: GroupedBlocks
    down: GroupedBlocks

    def __post_init__(self) -> None:
        if self.gate_up.m != self.down.m:
            raise ValueError("both kernels walk the same blocks of pairs: equal m")


# The fastest of benchmarks/probe_grouped_experts.py's sweeps at the full preset's MoE shape, each in a
# CUDA graph (docs/benchmarks.md), by the experts' mean pairs: about 12 (a batched decode step of 128
# pages), 24 (256 pages), 48 (512 tokens) and 90 (a 960-token prompt). Smallest blocks first.
GROUPED_BLOCKS = (
    KernelBlocks(gate_up=GroupedBlocks(m=16, n=64, k=64, warps=4, stages=3),
                 down=GroupedBlocks(m=16, n=64, k=64, warps=4, stages=3)),
    KernelBlocks(gate_up=GroupedBlocks(m=32, n=64, k=128, warps=4, stages=3),
                 down=GroupedBlocks(m=32, n=64, k=128, warps=4, stages=3)),
    KernelBlocks(gate_up=GroupedBlocks(m=64, n=64, k=64, warps=4, stages=3),
                 down=GroupedBlocks(m=64, n=128, k=64, warps=4, stages=3)),
    KernelBlocks(gate_up=GroupedBlocks(m=128, n=64, k=64, warps=8, stages=3),
                 down=GroupedBlocks(m=128, n=128, k=64, warps=8, stages=3)),
)


def blocks_for(pairs: int, num_experts: int) -> KernelBlocks:
    """The smallest blocks that hold the experts' mean pairs (larger ones would compute mostly padding),
    else the largest."""
    for blocks in GROUPED_BLOCKS:
        if pairs <= blocks.gate_up.m * num_experts:
            return blocks
    return GROUPED_BLOCKS[-1]


def tokens_for(blocks: KernelBlocks, top_k: int, num_experts: int) -> tuple[int, int | None]:
    """The token counts whose pairs `blocks_for` gives `blocks`: [low, high], high None for the largest
    blocks (no bound)."""
    index = GROUPED_BLOCKS.index(blocks)
    low = GROUPED_BLOCKS[index - 1].gate_up.m * num_experts // top_k + 1 if index else 1
    high = blocks.gate_up.m * num_experts // top_k if index < len(GROUPED_BLOCKS) - 1 else None
    return low, high


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, out_ptr,
    top_k, hidden, inter, stride_we, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[s, n] = silu(x[token(s)] · W[e, n]) * (x[token(s)] · W[e, inter + n]) for the sorted pairs s of
    this block's expert e; W is [E, 2·inter, hidden], out [pairs, inter] in sorted order."""
    block = tl.program_id(0)
    start = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    if start >= end:  # past the last expert's blocks
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = (tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_w = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_w = gate_w + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * hidden + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(
            a, tl.load(gate_w + ks[:, None], mask=w_mask, other=0.0), gate, input_precision=PRECISION
        )
        up = tl.dot(a, tl.load(up_w + ks[:, None], mask=w_mask, other=0.0), up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * inter + cols[None, :], (activated * up).to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_down_kernel(
    a_ptr, w_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weight_ptr, out_ptr,
    hidden, inter, stride_we, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[pair(s), h] = routing_weight[pair(s)] · round(a[s] · W[e, h]) for the sorted pairs s of this
    block's expert e; W is [E, hidden, inter], out [pairs, hidden] float32 in pair order."""
    block = tl.program_id(0)
    start = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    if start >= end:
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(a, tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0), acc,
                     input_precision=PRECISION)
    projected = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    pairs = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    routing = tl.load(weight_ptr + pairs, mask=row_ok, other=0.0)
    tl.store(out_ptr + pairs[:, None] * hidden + cols[None, :], projected * routing[:, None],
             mask=row_ok[:, None] & col_ok[None, :])


def expert_blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The pairs in expert order and, per program block, its expert and its [start, end) in that order:
    (order, block_expert, block_start, block_end). Blocks past the last expert's have start = end = 0."""
    flat = top_k_index.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    # A counting sort instead of a stable argsort (a radix sort on the GPU, several kernels): a pair's
    # place is its expert's start plus its expert's pairs before it, prefix sums over a one-hot
    # [experts, pairs] (summed along its rows: a scan along the inner dimension runs in parallel).
    one_hot = (torch.arange(num_experts, device=flat.device).unsqueeze(1) == flat).to(torch.int32)
    counts = one_hot.sum(1, dtype=torch.int64)
    expert_start = torch.cumsum(counts, 0) - counts
    before = (torch.cumsum(one_hot, 1, dtype=torch.int32) - one_hot).gather(0, flat.unsqueeze(0)).squeeze(0)
    place = expert_start[flat] + before
    order = torch.empty(pairs, dtype=torch.int32, device=flat.device).scatter_(
        0, place, torch.arange(pairs, dtype=torch.int32, device=flat.device)
    )
    blocks = (counts + block_m - 1) // block_m
    blocks_end = torch.cumsum(blocks, 0)
    ids = torch.arange((pairs + block_m - 1) // block_m + num_experts, device=flat.device)
    expert = torch.searchsorted(blocks_end, ids, right=True)
    active = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    start = expert_start[expert] + (ids - (blocks_end[expert] - blocks[expert])) * block_m
    end = torch.minimum(start + block_m, expert_start[expert] + counts[expert])
    zero = torch.zeros_like(start)
    return (order, expert.to(torch.int32), torch.where(active, start, zero).to(torch.int32),
            torch.where(active, end, zero).to(torch.int32))


def launch_grouped_experts(
    hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, blocks: KernelBlocks | None = None,
) -> torch.Tensor:
    """hidden_states [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; top_k_* [T, k] → [T, H].
    `blocks` by default by the pair count (`blocks_for`); an argument for a benchmark's sweep."""
    tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[1]
    inter = down_proj.shape[2]
    pairs = tokens * top_k
    precision = "ieee" if hidden_states.dtype == torch.float32 else "tf32"  # tf32: not used by 16-bit inputs
    blocks = blocks or blocks_for(pairs, gate_up_proj.shape[0])
    gate_up_blocks, down_blocks = blocks.gate_up, blocks.down
    order, block_expert, block_start, block_end = expert_blocks(
        top_k_index, gate_up_proj.shape[0], gate_up_blocks.m
    )
    grid_blocks = block_expert.shape[0]
    activated = torch.empty(pairs, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    wrap_triton(_grouped_gate_up_kernel)[(grid_blocks, triton.cdiv(inter, gate_up_blocks.n))](
        hidden_states.contiguous(), gate_up_proj, order, block_expert, block_start, block_end, activated,
        top_k, hidden, inter, gate_up_proj.stride(0), gate_up_proj.stride(1),
        BLOCK_M=gate_up_blocks.m, BLOCK_N=gate_up_blocks.n, BLOCK_K=gate_up_blocks.k, PRECISION=precision,
        num_warps=gate_up_blocks.warps, num_stages=gate_up_blocks.stages,
    )
    weighted = torch.empty(pairs, hidden, dtype=torch.float32, device=hidden_states.device)
    wrap_triton(_grouped_down_kernel)[(grid_blocks, triton.cdiv(hidden, down_blocks.n))](
        activated, down_proj, order, block_expert, block_start, block_end,
        top_k_weights.reshape(-1).to(torch.float32).contiguous(), weighted,
        hidden, inter, down_proj.stride(0), down_proj.stride(1),
        BLOCK_M=down_blocks.m, BLOCK_N=down_blocks.n, BLOCK_K=down_blocks.k, PRECISION=precision,
        num_warps=down_blocks.warps, num_stages=down_blocks.stages,
    )
    return weighted.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


@triton_op("dsocr::grouped_experts", mutates_args=())
def grouped_experts(
    hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """`launch_grouped_experts` as an operator torch.compile traces into its graph."""
    return launch_grouped_experts(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)
