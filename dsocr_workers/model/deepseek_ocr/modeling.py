"""DeepSeek-OCR v1 as one module: the vision stages as separate methods (so the engine can time each),
the image-token layout and the shared MoE decoder (model/decoder.py) with an untied `lm_head`.

Vision: transformers' SAM encoder (model/sam.py), our CLIP-on-SAM trunk as the view encoder.
"""

from __future__ import annotations

import torch
from torch import nn

from dsocr_workers.model.decoder import build_decoder
from dsocr_workers.model.deepseek_ocr.config import OCRConfig
from dsocr_workers.model.deepseek_ocr.vision import ClipOnSam, layout_image_tokens
from dsocr_workers.model.interface import ViewBlocks
from dsocr_workers.model.sam import build_sam


class DeepSeekOCR(nn.Module):
    """The whole model. `attn_implementation` ("eager" = the vendor's fp32-softmax attention, or "sdpa")
    and `experts_implementation` (`experts.VENDOR_LOOP`, or transformers' "eager", "grouped_mm",
    "batched_mm") pick the kernels."""

    def __init__(
        self, config: OCRConfig, attn_implementation: str = "eager", experts_implementation: str = "eager"
    ):
        super().__init__()
        self.config = config
        self.sam = build_sam(config.sam)
        self.clip = ClipOnSam(config.clip)
        self.projector = nn.Linear(config.projector_input, config.text.hidden_size)
        self.image_newline = nn.Parameter(torch.empty(config.text.hidden_size))
        self.view_seperator = nn.Parameter(torch.empty(config.text.hidden_size))  # sic: the vendor key
        self.language_model = build_decoder(config.text, attn_implementation, experts_implementation)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    # --- vision stages: each one call per view group, timed separately by the engine -------------
    def encode_sam(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) normalised pixels → (B, C, S/64, S/64) compressed SAM features."""
        return self.sam(pixels).last_hidden_state

    def encode_views(self, sam_features: torch.Tensor) -> torch.Tensor:
        """SAM features → CLIP outputs without the CLS position: (B, h·w, C_clip)."""
        return self.clip(sam_features)[:, 1:]

    def view_blocks(self) -> ViewBlocks:
        """CLIP layer by layer (`encode_views` in blocks); its layers pack view groups."""
        clip = self.clip
        return ViewBlocks(
            lambda features: clip.pre_layrnorm(clip.embeddings(features)),
            list(clip.transformer.layers),
            lambda hidden: hidden[:, 1:],
            packs_views=True,
        )

    def project(self, clip_features: torch.Tensor, sam_features: torch.Tensor) -> torch.Tensor:
        """CLIP channels first, SAM channels second (the vendor's concat order) → (B, h·w, hidden)."""
        fused = torch.cat([clip_features, sam_features.flatten(2).transpose(1, 2)], dim=-1)
        return self.projector(fused)

    def layout(
        self, global_tokens: torch.Tensor, local_tokens: torch.Tensor | None, crop_grid: tuple[int, int]
    ) -> torch.Tensor:
        return layout_image_tokens(
            global_tokens, local_tokens, crop_grid, self.image_newline, self.view_seperator
        )

    # --- language model -----------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
