"""The MoE router in one kernel: float32 logits, softmax, greedy top-k and the routed scaling.

transformers' router runs a float32 GEMM (cuBLAS, with a split-K reduction at a batched decode step's
shape), the softmax and a top-k as separate kernels, several microseconds each at 128 tokens: over a
step's 11 MoE layers a few percent of it (docs/benchmarks.md, the step kernel by kernel). One Triton
program here takes a block of tokens through all of them.

The logits are a `tl.dot` of the hidden states and the weights in their own 16-bit dtype, accumulated in
float32: the product of two bfloat16 numbers is exact in float32, so this equals transformers' float32
GEMM of the upcast operands up to the order of the sums, on the tensor cores (a float32 `tl.dot` runs on
the CUDA cores, several times slower than the kernels it replaces).

Numerics follow transformers' router: logits in float32 without TF32, the softmax in float32, the top-k
weights scaled by `routed_scaling_factor`; the k experts of a token come in expert order, as the CUDA
top-k without sorting returns them, so the experts' top-k sum adds in the same order. On a CPU the kernel
runs only under Triton's interpreter (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2TextTopkRouter


@dataclass(frozen=True)
class RouteBlocks:
    """One program: `tokens` tokens (at least 16, `tl.dot`'s rows) against every expert, `k` hidden inputs
    per loop step."""

    tokens: int
    k: int
    warps: int


ROUTE_BLOCKS = RouteBlocks(tokens=16, k=128, warps=4)


@triton.jit
def _route_kernel(
    x_ptr, w_ptr, weight_ptr, index_ptr, tokens, hidden, num_experts, scale,
    TOP_K: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """For each token t of this block: scores = softmax(x[t] · Wᵀ) over the experts (x and W [E, hidden]
    of one dtype, the sums in float32); index[t] = its top-k experts in expert order, weight[t] = their
    scores × scale."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    experts = tl.arange(0, EXPERTS)
    expert_ok = experts < num_experts
    logits = tl.zeros([BLOCK_T, EXPERTS], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * hidden + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + experts[None, :] * hidden + ks[:, None],
                    mask=k_ok[:, None] & expert_ok[None, :], other=0.0)
        logits = tl.dot(x, w, logits, input_precision=PRECISION)
    logits = tl.where(expert_ok[None, :], logits, float("-inf"))
    exps = tl.exp(logits - tl.max(logits, 1)[:, None])
    scores = exps / tl.sum(exps, 1)[:, None]
    remaining = tl.where(expert_ok[None, :], scores, -1.0)
    chosen = tl.zeros([BLOCK_T, EXPERTS], dtype=tl.int32)
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(remaining, 1)
        hit = experts[None, :] == best[:, None]
        chosen = tl.where(hit, 1, chosen)
        remaining = tl.where(hit, -2.0, remaining)
    slot = rows[:, None].to(tl.int64) * TOP_K + (tl.cumsum(chosen, 1) - 1)
    keep = (chosen == 1) & row_ok[:, None]
    tl.store(index_ptr + slot, tl.broadcast_to(experts[None, :], [BLOCK_T, EXPERTS]).to(tl.int64), mask=keep)
    tl.store(weight_ptr + slot, scores * scale, mask=keep)


def launch_route(
    hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, scale: float,
    blocks: RouteBlocks = ROUTE_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden_states [T, hidden]; weight [E, hidden], both read in their dtype where it is the same, else
    as float32 → (weights [T, k] float32, index [T, k] int64). `blocks`: an argument for the probe's sweep
    (benchmarks/probe_router.py)."""
    tokens, hidden = hidden_states.shape
    num_experts = weight.shape[0]
    if weight.dtype != hidden_states.dtype:
        hidden_states, weight = hidden_states.float(), weight.float()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=hidden_states.device)
    index = torch.empty(tokens, top_k, dtype=torch.int64, device=hidden_states.device)
    wrap_triton(_route_kernel)[(triton.cdiv(tokens, blocks.tokens),)](
        hidden_states.contiguous(), weight.contiguous(), weights, index, tokens, hidden, num_experts, scale,
        TOP_K=top_k, EXPERTS=max(16, triton.next_power_of_2(num_experts)), BLOCK_T=blocks.tokens,
        BLOCK_K=blocks.k, PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",  # tf32: unused by 16-bit
        num_warps=blocks.warps,
    )
    return weights, index


@triton_op("dsocr::route", mutates_args=())
def route(
    hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch_route` as an operator torch.compile traces into its graph."""
    return launch_route(hidden_states, weight, top_k, scale)


class FusedRouter(nn.Module):
    """transformers' greedy top-k router as one kernel (`route`); the same `weight` parameter. It returns
    no logits: the MoE layer reads only the weights and the experts."""

    def __init__(self, router: DeepseekOcr2TextTopkRouter) -> None:
        super().__init__()
        if router.topk_method != "greedy":
            raise ValueError(f"the fused router is greedy only, not {router.topk_method!r}")
        self.weight = router.weight
        self.top_k = router.top_k
        self.routed_scaling_factor = float(router.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        weights, index = route(
            hidden_states.reshape(-1, self.weight.shape[1]), self.weight, self.top_k, self.routed_scaling_factor
        )
        return None, weights, index
