"""SAM's two fast-engine kernels alone on one GPU (bf16, the `full` preset's SAM shapes, random inputs)
against what the engine compiled before them:

1. lin1 + bias + GELU over a 1024-px view's 4096 positions and six 640-px tiles' 9600, 768 → 3072:
   inductor's cuBLAS GEMM and exact-GELU pass against cuBLASLt's tanh-GELU epilogue
   (`torch._addmm_activation`, model/sam_mlp.py's operator). Largest difference from the float32 result.
   (A Triton GEMM with the exact GELU in its epilogue, swept over block configurations in the first run of
   this probe, was slower than the GEMM and pass: docs/benchmarks.md.)
2. The folded query/key/value built by the Triton kernel (model/sam_attention.py; 2, 4, 8 warps) against the same
   tensors from torch operations compiled by inductor, for the global view, the tiles and both groups'
   14×14 windows, and each followed by the attention itself.

    python benchmarks/probe_sam_fused.py > $OUT/sam-fused.txt

CUDA events around a CUDA graph's replay, median of 30 after 5; microseconds per call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.probe_grouped_experts import graph_us as replay_us  # noqa: E402
from dsocr_workers.model.sam_attention import fold_with_torch, launch_fold  # noqa: E402
from dsocr_workers.model.sam_mlp import linear_gelu_tanh  # noqa: E402

WIDTH, HIDDEN, HEADS, CHANNELS = 768, 3072, 12, 64


def graph_us(run: Callable[[], object]) -> float:
    """Microseconds per replay of `run` captured as a CUDA graph (probe_grouped_experts' timing)."""
    return replay_us(run)[0]


def linear_gelu_sweep() -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    weight = (torch.randn(HIDDEN, WIDTH, device=device) * WIDTH**-0.5).to(dtype)
    bias = (torch.randn(HIDDEN, device=device) * 0.02).to(dtype)
    compiled = torch.compile(lambda x: F.gelu(F.linear(x, weight, bias)))
    for rows in (4096, 9600):
        x = torch.randn(rows, WIDTH, device=device).to(dtype)
        exact = F.gelu(F.linear(x.float(), weight.float(), bias.float()))
        base = graph_us(lambda x=x: compiled(x))
        diff = (compiled(x).float() - exact).abs().max().item()
        print(f"{rows} rows: inductor (cuBLAS + GELU pass) {base:.1f} us, max|diff| {diff:.4f}")
        tanh = graph_us(lambda x=x: torch._addmm_activation(bias, x, weight.t(), use_gelu=True))
        diff = (torch._addmm_activation(bias, x, weight.t(), use_gelu=True).float() - exact).abs().max().item()
        print(f"{rows} rows: cuBLAS tanh-GELU epilogue {tanh:.1f} us, max|diff| {diff:.4f}")
        fused = graph_us(lambda x=x: linear_gelu_tanh(x, weight, bias))
        print(f"{rows} rows: dsocr::linear_gelu_tanh {fused:.1f} us")


def fold_side_by_side() -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    compiled = torch.compile(fold_with_torch)
    for name, batch, size in (("global 1024-px", 1, 64), ("global 6 tiles", 6, 40),
                              ("windows 1024-px", 25, 14), ("windows 6 tiles", 54, 14)):
        qkv = torch.randn(batch, size, size, 3 * HEADS * CHANNELS, device=device).to(dtype)
        table = torch.randn(2 * size - 1, CHANNELS, device=device).to(dtype) * 0.5
        got = launch_fold(qkv, table, table, HEADS, CHANNELS**-0.5)
        expected = compiled(qkv, table, table, HEADS, CHANNELS**-0.5)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected, strict=True))
        def kernel_run(qkv: torch.Tensor = qkv, table: torch.Tensor = table) -> tuple[torch.Tensor, ...]:
            return launch_fold(qkv, table, table, HEADS, CHANNELS**-0.5)

        def torch_run(qkv: torch.Tensor = qkv, table: torch.Tensor = table) -> tuple[torch.Tensor, ...]:
            return compiled(qkv, table, table, HEADS, CHANNELS**-0.5)

        for warps in (2, 4, 8):
            took = graph_us(lambda warps=warps, qkv=qkv, table=table: launch_fold(qkv, table, table, HEADS,
                                                                                  CHANNELS**-0.5, warps))
            print(f"fold {name}: kernel with {warps} warps {took:.1f} us")
        kernel, torch_ops = graph_us(kernel_run), graph_us(torch_run)
        attention = graph_us(lambda run=kernel_run: F.scaled_dot_product_attention(*run(), scale=1.0))
        print(f"fold {name}: kernel {kernel:.1f} us, torch ops compiled {torch_ops:.1f} us, max|diff| {diff:.4f};"
              f" kernel + attention {attention:.1f} us")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; random inputs, bf16")
    linear_gelu_sweep()
    fold_side_by_side()


if __name__ == "__main__":
    main()
