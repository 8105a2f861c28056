"""The fast engine's SAM patch embedding: the 16×16 convolution at stride 16 as one matrix product.

Non-overlapping patches make the convolution a GEMM over the unfolded pixels, (patches, 3·16·16) ×
(3·16·16, width). cuDNN runs it as an implicit-GEMM convolution instead, slow for its few FLOPs
(docs/benchmarks.md, SAM); the unfold is one copy of the pixels and the product one cuBLAS GEMM. The
eager engine, the numerical reference, keeps the convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2SamVisionEncoder


class PatchEmbeddingMatmul(nn.Module):
    """transformers' SAM patch embedding (pixels (B, 3, H, W) → (B, H/p, W/p, width)) as a GEMM."""

    def __init__(self, projection: nn.Conv2d) -> None:
        super().__init__()
        if projection.kernel_size != projection.stride or projection.padding != (0, 0):
            raise ValueError("a patch embedding is a convolution with stride = kernel and no padding")
        self.patch = projection.kernel_size
        # (width, 3, p, p) → (width, 3·p·p), channels then rows then columns: the unfold's order below.
        self.weight = nn.Parameter(projection.weight.detach().flatten(1), requires_grad=False)
        self.bias = projection.bias

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = pixels.shape
        rows, cols = self.patch
        patches = (
            pixels.reshape(batch, channels, height // rows, rows, width // cols, cols)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(batch, height // rows, width // cols, channels * rows * cols)
        )
        return F.linear(patches, self.weight, self.bias)


def embed_patches_by_matmul(sam: DeepseekOcr2SamVisionEncoder) -> None:
    """Swap SAM's patch embedding for PatchEmbeddingMatmul."""
    sam.patch_embed = PatchEmbeddingMatmul(sam.patch_embed.projection)  # type: ignore[assignment]
