"""DeepSeek-OCR (v1)'s view encoder: the CLIP-L trunk fed with SAM features, and the newline /
separator token layout (both ours). SAM is shared (model/sam.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsocr_workers.model.deepseek_ocr.config import ClipDims


def resize_position_grid(table: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize a (side × side, C) position table to (height × width, C) as the vendor does: bicubic with
    antialias, in float32, also when upsampling."""
    side = int(table.shape[0] ** 0.5)
    if (side, side) == (height, width):
        return table
    grid = table.reshape(1, side, side, -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(height * width, -1).to(table.dtype)


class ClipEmbeddings(nn.Module):
    def __init__(self, dims: ClipDims):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(dims.width))
        # Present in the checkpoint but never used: SAM features replace the patch embeddings.
        self.patch_embedding = nn.Conv2d(3, dims.width, dims.patch_size, dims.patch_size, bias=False)
        self.position_embedding = nn.Embedding(dims.positions, dims.width)

    def forward(self, sam_features: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = sam_features.shape
        patches = sam_features.flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(patches.dtype).expand(batch, 1, -1)
        table = self.position_embedding.weight
        positions = torch.cat([table[:1], resize_position_grid(table[1:], height, width)])
        return torch.cat([cls, patches], dim=1) + positions.to(patches.dtype)


class ClipAttention(nn.Module):
    def __init__(self, dims: ClipDims):
        super().__init__()
        self.heads = dims.heads
        self.qkv_proj = nn.Linear(dims.width, 3 * dims.width)
        self.out_proj = nn.Linear(dims.width, dims.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return self.out_proj(self._attend(self.qkv_proj(x), batch, length).view(batch, length, width))

    def forward_packed(self, x: torch.Tensor, views: Sequence[tuple[int, int]]) -> torch.Tensor:
        """`forward` over several view groups packed as rows: x (Σ batch·length, width), `views` each
        group's (batch, length) in order. The projections run once over all rows; attention stays within
        each view."""
        qkv = self.qkv_proj(x)
        rows = [batch * length for batch, length in views]
        attended = [self._attend(part, batch, length)
                    for part, (batch, length) in zip(qkv.split(rows), views, strict=True)]
        return self.out_proj(torch.cat(attended))

    def _attend(self, qkv: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """Fused q/k/v rows of `batch` views of `length` tokens → attention output (batch·length, width)."""
        # Fused rows: Q, then K, then V, each head-major.
        q, k, v = qkv.view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(batch * length, -1)


class ClipMLP(nn.Module):
    def __init__(self, dims: ClipDims):
        super().__init__()
        self.fc1 = nn.Linear(dims.width, dims.ffn)
        self.fc2 = nn.Linear(dims.ffn, dims.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        return self.fc2(hidden * torch.sigmoid(1.702 * hidden))  # quick_gelu


class ClipLayer(nn.Module):
    def __init__(self, dims: ClipDims):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dims.width, eps=dims.layer_norm_eps)
        self.self_attn = ClipAttention(dims)
        self.layer_norm2 = nn.LayerNorm(dims.width, eps=dims.layer_norm_eps)
        self.mlp = ClipMLP(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))

    def forward_views(self, groups: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`forward` of each (batch, length, width) view group, the groups packed as rows for everything
        but attention: a gundam page's global view and tiles share each GEMM, which neither fills on its
        own."""
        views = [(group.shape[0], group.shape[1]) for group in groups]
        x = torch.cat([group.reshape(-1, group.shape[-1]) for group in groups])
        x = x + self.self_attn.forward_packed(self.layer_norm1(x), views)
        x = x + self.mlp(self.layer_norm2(x))
        return [part.view(group.shape) for part, group in
                zip(x.split([batch * length for batch, length in views]), groups, strict=True)]


class ClipTransformer(nn.Module):
    def __init__(self, dims: ClipDims):
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(dims) for _ in range(dims.layers))


class ClipOnSam(nn.Module):
    """CLIP-L/14 trunk whose patch embeddings are the SAM output grid. No final LayerNorm; the CLS
    output is dropped by the caller."""

    def __init__(self, dims: ClipDims):
        super().__init__()
        self.embeddings = ClipEmbeddings(dims)
        self.pre_layrnorm = nn.LayerNorm(dims.width, eps=dims.layer_norm_eps)  # sic: the vendor key
        self.transformer = ClipTransformer(dims)

    def forward(self, sam_features: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(sam_features))
        for layer in self.transformer.layers:
            x = layer(x)
        return x


def layout_image_tokens(
    global_tokens: torch.Tensor,
    local_tokens: torch.Tensor | None,
    crop_grid: tuple[int, int],
    image_newline: torch.Tensor,
    view_separator: torch.Tensor,
) -> torch.Tensor:
    """Arrange projected tokens as the vendor does: [local grid] + [global grid] + [separator], each
    grid as 2-D rows with `image_newline` appended after every row.

    global_tokens: (h·w, C) of the global view; local_tokens: (cols·rows, h2·w2, C) in row-major tile
    order, or None; crop_grid: (cols, rows). Returns (N, C).
    """
    channels = global_tokens.shape[-1]
    side = int(global_tokens.shape[0] ** 0.5)
    newline = image_newline.to(global_tokens.dtype)
    global_grid = global_tokens.view(side, side, channels)
    parts = []
    if local_tokens is not None:
        cols, rows = crop_grid
        tile = int(local_tokens.shape[1] ** 0.5)
        # (rows·cols, t, t, C) → (rows, t, cols, t, C): stitch tiles into one (rows·t) × (cols·t) map.
        stitched = local_tokens.view(rows, cols, tile, tile, channels).permute(0, 2, 1, 3, 4)
        stitched = stitched.reshape(rows * tile, cols * tile, channels)
        parts.append(_with_row_newlines(stitched, newline))
    parts.append(_with_row_newlines(global_grid, newline))
    parts.append(view_separator.to(global_tokens.dtype).view(1, channels))
    return torch.cat(parts)


def _with_row_newlines(grid: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    rows, _, channels = grid.shape
    column = newline.view(1, 1, channels).expand(rows, 1, channels)
    return torch.cat([grid, column], dim=1).reshape(-1, channels)
