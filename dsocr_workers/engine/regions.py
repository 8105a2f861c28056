"""The fast engine's vision encoders, compiled one transformer block at a time (regional compilation).

Compiling `encode_sam` and `encode_clip` whole made one graph of 12 SAM blocks and one of 24 CLIP layers
per view size: about 30 s of compilation per size on an H200 and, with an empty compile cache, five of
the six minutes a worker needed before it was ready for gundam and the four fixed modes (issue 10 item 4,
docs/benchmarks.md). The blocks of an encoder are one module class with the same code, so dynamo compiles
each kind of block once per input shape and every layer of that kind reuses the graph (the weights are
graph inputs): two SAM graphs per view size (windowed and global attention), one CLIP graph. The work
between blocks (patch embedding, position tables, SAM's neck and compressor convolutions) runs eager: a
few kernels per call.

A tile group (2 or more tiles of one view size) has its batch dimension marked dynamic at every block's
input, so one graph per block kind serves every crop grid of a mode. `maybe_`: a kernel may still guard
on a range of batch sizes, which then costs a second graph instead of an error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsocr_workers.model.modeling import DeepSeekOCR

# Each compiled region is its own function, so each has its own code object and with it its own cache
# of graphs and its own recompile limit (dynamo keys both on the code object).


def _sam_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return layer(hidden)


def _clip_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return layer(hidden)


# Distinct view sizes × block kinds a worker meets: 5 sizes (the four fixed modes' global views and
# gundam's 640-px tiles) × (static, dynamic batch) for each kind, with room to spare.
REGION_RECOMPILE_LIMIT = 32


class RegionalVision:
    """`encode_sam` and `encode_clip` of `model` with each block compiled (`backend`), equal in function
    to the model's own methods. `dynamic_tiles=False`: a graph per tile count (the engine before)."""

    def __init__(self, model: DeepSeekOCR, backend: str, dynamic_tiles: bool = True) -> None:
        self.model = model
        self.dynamic_tiles = dynamic_tiles
        self._sam_block = self._compile(_sam_block, backend)
        self._clip_block = self._compile(_clip_block, backend)

    @staticmethod
    def _compile(block: Callable, backend: str) -> Callable:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT)
        return torch.compile(block, dynamic=False, backend=backend)

    def _mark(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dynamic_tiles and hidden.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(hidden, 0)
        return hidden

    def encode_sam(self, pixels: torch.Tensor) -> torch.Tensor:
        """transformers' SAM encoder forward (`DeepSeekOCR.encode_sam`), block by block."""
        sam = self.model.sam
        hidden = sam.patch_embed(pixels)
        if sam.pos_embed is not None:
            hidden = hidden + sam.interpolate_pos_encoding(hidden.shape[1], hidden.shape[2])
        for layer in sam.layers:
            hidden = self._sam_block(layer, self._mark(hidden))
        return sam.proj(sam.neck(hidden))

    def encode_clip(self, sam_features: torch.Tensor) -> torch.Tensor:
        """`DeepSeekOCR.encode_clip`, layer by layer."""
        clip = self.model.clip
        hidden = clip.pre_layrnorm(clip.embeddings(sam_features))
        for layer in clip.transformer.layers:
            hidden = self._clip_block(layer, self._mark(hidden))
        return hidden[:, 1:]
