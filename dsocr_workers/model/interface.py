"""What the engine calls on a family's model, whichever family: `ModelFamily.code().model` makes one.

Vision: `encode_sam` per view group, then `encode_views` (the family's view encoder: CLIP for
DeepSeek-OCR, the Qwen2 encoder with learned queries for DeepSeek-OCR-2), `project`, then `layout` puts
the projected tokens in the order the image placeholders take them. The decoder is the shared one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2SamVisionEncoder


class OCRModel(Protocol):
    config: Any  # the family's config; `config.text` is the decoder's TextDims
    sam: DeepseekOcr2SamVisionEncoder  # model/sam.py
    language_model: Any  # model/decoder.py: transformers' DeepseekOcr2TextModel
    lm_head: nn.Linear

    def encode_sam(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def encode_views(self, sam_features: torch.Tensor) -> torch.Tensor: ...

    def project(self, encoded: torch.Tensor, sam_features: torch.Tensor) -> torch.Tensor: ...

    def view_blocks(self) -> ViewBlocks | None:
        """The view encoder in blocks for the fast engine; None: it runs `encode_views` whole."""
        ...

    def layout(
        self, global_tokens: torch.Tensor, local_tokens: torch.Tensor | None, crop_grid: tuple[int, int]
    ) -> torch.Tensor: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    # nn.Module's, which the engine uses too
    def parameters(self) -> Any: ...

    def buffers(self) -> Any: ...

    def named_modules(self) -> Any: ...

    def modules(self) -> Any: ...


@dataclass(frozen=True)
class ViewBlocks:
    """A view encoder as blocks of one module class, so that the fast engine compiles one block at a
    time (engine/regions.py): `enter` before the first block, each layer maps hidden → hidden, `leave`
    after the last. `packs_views`: its layers have `forward_views(groups)`, one call over several view
    groups (the global view and the tiles) that shares each GEMM."""

    enter: Callable[[torch.Tensor], torch.Tensor]
    layers: Sequence[nn.Module]
    leave: Callable[[torch.Tensor], torch.Tensor]
    packs_views: bool = False
