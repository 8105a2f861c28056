"""The fast engine's SAM MLP: the first projection's bias and GELU applied in its GEMM's epilogue.

SAM's MLP is lin1 (768 → 3072), GELU, lin2. cuBLAS adds lin1's bias in its epilogue but has no exact GELU
(its GELU epilogue is the tanh approximation), so the activation was a pass of its own over the
3072-wide hidden states: on an H200 ~0.8 of a gundam page's 9.5 ms SAM, reading and writing ~120 MB per
block of six 640-px tiles (docs/benchmarks.md). Here a Triton GEMM applies bias and the exact GELU
(erf) to its float32 accumulator before the one rounding to the activations' dtype.
The eager engine, the numerical reference, keeps transformers' module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import (
    DeepseekOcr2SamMLPBlock,
    DeepseekOcr2SamVisionEncoder,
)


@dataclass(frozen=True)
class GemmBlocks:
    """One program's output tile (`m` × `n`), `k` inputs per loop step, `group` row tiles sharing a
    column sweep (L2 reuse of the weight tiles)."""

    m: int
    n: int
    k: int
    group: int
    warps: int
    stages: int


LINEAR_GELU_BLOCKS = GemmBlocks(m=128, n=128, k=64, group=8, warps=8, stages=3)


@triton.jit
def _linear_gelu_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, rows, cols, inputs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out = gelu(x · Wᵀ + bias): x [rows, inputs], W [cols, inputs] (nn.Linear's layout), out [rows, cols]."""
    program = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    col_tiles = tl.cdiv(cols, BLOCK_N)
    # Groups of GROUP_M row tiles walk the column tiles together, so a weight tile is read from L2.
    per_group = GROUP_M * col_tiles
    first_row_tile = (program // per_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
    row_tile = first_row_tile + (program % per_group) % group_rows
    col_tile = (program % per_group) // group_rows
    m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = n < cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inputs, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inputs
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * inputs + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * inputs + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    activated = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    tl.store(out_ptr + m[:, None].to(tl.int64) * cols + n[None, :], activated.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def launch_linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       blocks: GemmBlocks = LINEAR_GELU_BLOCKS) -> torch.Tensor:
    """gelu(F.linear(x, weight, bias)) for x [..., inputs]; the blocks are an argument for a benchmark's
    sweep."""
    inputs = x.shape[-1]
    flat = x.reshape(-1, inputs).contiguous()
    rows, cols = flat.shape[0], weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, blocks.m) * triton.cdiv(cols, blocks.n),)
    wrap_triton(_linear_gelu_kernel)[grid](
        flat, weight.contiguous(), bias, out, rows, cols, inputs,
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, GROUP_M=blocks.group,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32: not used by 16-bit inputs
        num_warps=blocks.warps, num_stages=blocks.stages,
    )
    return out.reshape(*x.shape[:-1], cols)


@triton_op("dsocr::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`launch_linear_gelu` as an operator torch.compile traces into its graph."""
    return launch_linear_gelu(x, weight, bias)


class FusedGeluMLP(nn.Module):
    """transformers' SAM MLP block (lin1, lin2 reused) with lin1, its bias and the GELU one kernel on a
    GPU; on a CPU (where the kernel runs only in Triton's interpreter) the three as torch operations."""

    def __init__(self, mlp: DeepseekOcr2SamMLPBlock) -> None:
        super().__init__()
        self.lin1 = mlp.lin1
        self.lin2 = mlp.lin2

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda:
            hidden = linear_gelu(hidden_states, self.lin1.weight, self.lin1.bias)
        else:
            hidden = F.gelu(self.lin1(hidden_states))
        return self.lin2(hidden)


def fuse_gelu_into_lin1(sam: DeepseekOcr2SamVisionEncoder) -> None:
    """Swap every SAM block's MLP for FusedGeluMLP; the kernel computes the exact GELU only."""
    if sam.config.hidden_act != "gelu":
        raise ValueError(f"the fused SAM MLP computes the exact GELU, not {sam.config.hidden_act!r}")
    for layer in sam.layers:
        if isinstance(layer.mlp, DeepseekOcr2SamMLPBlock):
            layer.mlp = FusedGeluMLP(layer.mlp)
