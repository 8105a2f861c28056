"""Routed experts for a handful of tokens (decode: one), reading only the experts the router picked.

At batch 1 transformers' `grouped_mm` experts run about ten small kernels per layer (sort, histogram,
cumsum, unsort) around a grouped GEMM over all 64 experts' weights that reaches a small share of the
memory bandwidth (docs/benchmarks.md, "What limits decode"). Here two Triton GEMV kernels run one
program block per (pair, block of output rows) and read the picked expert's rows directly: gate+up with
the activation fused, then down with the routing weight fused. Longer prompts go to model/grouped_experts.py.

Numerics follow `grouped_mm`'s (float32 accumulation, projections rounded to the weights' dtype before
the activation and the routing weight, the top-k sum in float32). Wrapped as a `torch.library.triton_op`,
so torch.compile inlines them and a CUDA graph captures them; on a CPU they run only under Triton's
interpreter (`TRITON_INTERPRET=1` before triton is imported: the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from transformers.integrations.moe import ExpertsInterface, batched_mm_experts_forward

from dsocr_workers.model.grouped_experts import grouped_experts

SELECTED_EXPERTS = "dsocr_selected_experts"
MAX_PAIRS = 64  # (token, expert) pairs up to which the GEMV kernels beat a grouped GEMM


@dataclass(frozen=True)
class BlockConfig:
    """One program block: `rows` output rows, `k` inputs loaded per loop step, `warps` warps."""

    rows: int
    k: int
    warps: int


# The fastest of benchmarks/bench_decode.py's sweep at the full preset's shapes, batch 1: few rows per
# block, so many blocks are in flight, each streaming whole rows.
GATE_UP_BLOCKS = BlockConfig(rows=4, k=256, warps=4)
DOWN_BLOCKS = BlockConfig(rows=8, k=1024, warps=4)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, expert_ptr, out_ptr, top_k, hidden, inter, stride_we, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, n] = silu(x[token] · W[e, n]) * (x[token] · W[e, inter + n]); W is [E, 2·inter, hidden]."""
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(expert_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < inter
    gate_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    up_rows = gate_rows + inter * stride_wn
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < hidden
        x = tl.load(x_ptr + token * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
        mask = row_ok[:, None] & col_ok[None, :]
        gate += tl.sum(
            tl.load(gate_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :], 1
        )
        up += tl.sum(tl.load(up_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair * inter + rows, (activated * up).to(dtype), mask=row_ok)


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, expert_ptr, weight_ptr, out_ptr, hidden, inter, stride_we, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, h] = routing_weight[pair] · round(a[pair] · W[e, h]); W is [E, hidden, inter], out
    float32."""
    pair = tl.program_id(0)
    expert = tl.load(expert_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    w_rows = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < inter
        a = tl.load(a_ptr + pair * inter + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], 1)
    projected = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + pair * hidden + rows, projected * tl.load(weight_ptr + pair), mask=row_ok)


def launch_selected_experts(
    hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up_blocks: BlockConfig = GATE_UP_BLOCKS, down_blocks: BlockConfig = DOWN_BLOCKS,
) -> torch.Tensor:
    """hidden_states [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; top_k_* [T, k] → [T, H].
    The block configurations are arguments for the benchmark's sweep (benchmarks/bench_decode.py)."""
    tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[1]
    inter = down_proj.shape[2]
    pairs = tokens * top_k
    experts = top_k_index.reshape(-1).contiguous()
    weights = top_k_weights.reshape(-1).to(torch.float32).contiguous()
    activated = torch.empty(pairs, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    wrap_triton(_gate_up_kernel)[(pairs, triton.cdiv(inter, gate_up_blocks.rows))](
        hidden_states.contiguous(), gate_up_proj, experts, activated, top_k, hidden, inter,
        gate_up_proj.stride(0), gate_up_proj.stride(1),
        BLOCK_N=gate_up_blocks.rows, BLOCK_K=gate_up_blocks.k, num_warps=gate_up_blocks.warps,
    )
    weighted = torch.empty(pairs, hidden, dtype=torch.float32, device=hidden_states.device)
    wrap_triton(_down_kernel)[(pairs, triton.cdiv(hidden, down_blocks.rows))](
        activated, down_proj, experts, weights, weighted, hidden, inter,
        down_proj.stride(0), down_proj.stride(1),
        BLOCK_N=down_blocks.rows, BLOCK_K=down_blocks.k, num_warps=down_blocks.warps,
    )
    return weighted.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


@triton_op("dsocr::selected_experts", mutates_args=())
def selected_experts(
    hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """`launch_selected_experts` as an operator torch.compile traces into its graph."""
    return launch_selected_experts(
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, GATE_UP_BLOCKS, DOWN_BLOCKS
    )


def selected_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts implementation: the GEMV kernels for a few tokens, the grouped GEMM kernels
    (model/grouped_experts.py) for a prompt; transformers' batched GEMMs for experts the kernels do not
    cover. The token count is static in a compiled graph (or guarded on), so each graph holds one path."""
    kernels_fit = (
        self.has_gate and not self.has_bias and not self.is_transposed and self.config.hidden_act == "silu"
    )
    if not kernels_fit:
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if top_k_index.numel() <= MAX_PAIRS:
        return selected_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)
    return grouped_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)


ExpertsInterface.register(SELECTED_EXPERTS, selected_experts_forward)
