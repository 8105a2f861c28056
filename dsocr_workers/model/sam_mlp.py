"""The fast engine's SAM MLP: the first projection's bias and GELU in cuBLASLt's GEMM epilogue (16-bit).

SAM's MLP is lin1 (768 → 3072), GELU, lin2; the exact GELU was a pass of its own over the wide hidden
states, which the epilogue removes (docs/benchmarks.md, SAM). cuBLASLt's GELU is the tanh approximation,
within 5e-4 of the exact one: a rounding-level change in 16-bit dtypes. In float32, where the fast and
eager engines' greedy tokens are checked for equality, the engine keeps the exact GELU. The eager
engine, the numerical reference, keeps transformers' module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import (
    DeepseekOcr2SamMLPBlock,
    DeepseekOcr2SamVisionEncoder,
)

EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)


@torch.library.custom_op("dsocr::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(F.linear(x, weight, bias)) for x [..., inputs] as one cuBLASLt GEMM with a bias + GELU
    epilogue; an operator of its own so that inductor keeps it whole instead of compiling an activation
    pass after the GEMM."""
    flat = x.reshape(-1, x.shape[-1])
    return torch._addmm_activation(bias, flat, weight.t(), use_gelu=True).reshape(
        *x.shape[:-1], weight.shape[0]
    )


@linear_gelu_tanh.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class FusedGeluMLP(nn.Module):
    """transformers' SAM MLP block (lin1, lin2 reused) with lin1, its bias and the GELU one GEMM on a
    GPU in 16-bit dtypes; elsewhere the exact GELU after lin1."""

    def __init__(self, mlp: DeepseekOcr2SamMLPBlock) -> None:
        super().__init__()
        self.lin1 = mlp.lin1
        self.lin2 = mlp.lin2

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda and hidden_states.dtype in EPILOGUE_DTYPES:
            hidden = linear_gelu_tanh(hidden_states, self.lin1.weight, self.lin1.bias)
        else:
            hidden = F.gelu(self.lin1(hidden_states))
        return self.lin2(hidden)


def fuse_gelu_into_lin1(sam: DeepseekOcr2SamVisionEncoder) -> None:
    """Swap every SAM block's MLP for FusedGeluMLP (SAM's activation is the exact GELU)."""
    if sam.config.hidden_act != "gelu":
        raise ValueError(f"the fused SAM MLP replaces the exact GELU, not {sam.config.hidden_act!r}")
    for layer in sam.layers:
        if isinstance(layer.mlp, DeepseekOcr2SamMLPBlock):
            layer.mlp = FusedGeluMLP(layer.mlp)
