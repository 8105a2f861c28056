"""DeepSeek-OCR-2 as one module, with the methods the engine calls on every family
(model/interface.py): `encode_sam`, `encode_views`, `view_blocks`, `project`, `layout`, `embed`,
`logits`, `language_model`, `lm_head`.

transformers' `deepseek_ocr2` modules are reused where they equal the vendor: the SAM encoder, the
encoder's Qwen2 layers, final norm and RoPE, and the decoder. Ours: the encoder's forward (the vendor's
additive mask and 1-D positions built from static shapes, the query table picked by exact count), the
projector and the layout.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2VisionEncoderConfig
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2VisionEncoder

from dsocr_workers.model.decoder import build_decoder
from dsocr_workers.model.deepseek_ocr2.config import CROP_QUERIES, GLOBAL_QUERIES, EncoderDims, OCR2Config
from dsocr_workers.model.interface import ViewBlocks
from dsocr_workers.model.sam import build_sam


def encoder_config(dims: EncoderDims) -> DeepseekOcr2VisionEncoderConfig:
    """The vendor's Qwen2 encoder settings; transformers' class defaults (4096 wide, theta 10000) are
    placeholders, so every value is set."""
    config = DeepseekOcr2VisionEncoderConfig(
        hidden_size=dims.hidden_size,
        intermediate_size=dims.intermediate_size,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        hidden_act="silu",
        rms_norm_eps=dims.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta},
        max_position_embeddings=2 * GLOBAL_QUERIES,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"  # the vendor builds its encoder with sdpa, always
    return config


def view_mask(views: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The vendor's additive mask over [`views` visual tokens ; `views` queries], (1, 1, 2v, 2v): a
    visual token sees every visual token and no query; query j sees every visual token and queries
    0..j. Built from shapes only (no data-dependent Python: capturable)."""
    index = torch.arange(2 * views, device=device)
    allowed = (index[None, :] < views) | (index[None, :] <= index[:, None])
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), blocked)[None, None]


class EncoderBlock(nn.Module):
    """One encoder layer as hidden → hidden over [visual ; queries]: its mask and rotary table come from
    the hidden's static shape, as `encode_views` builds them once for all layers."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        views = hidden.shape[1] // 2
        rotary = self.rotary(hidden, torch.arange(2 * views, device=hidden.device)[None])
        mask = view_mask(views, hidden.dtype, hidden.device)
        return self.layer(hidden, attention_mask=mask, position_embeddings=rotary)


class DeepSeekOCR2(nn.Module):
    """The whole model. `attn_implementation` and `experts_implementation` pick the decoder's kernels
    as for v1's `DeepSeekOCR`; the encoder always runs sdpa, as the vendor's does."""

    def __init__(
        self, config: OCR2Config, attn_implementation: str = "eager", experts_implementation: str = "eager"
    ):
        super().__init__()
        self.config = config
        self.sam = build_sam(config.sam)
        self.encoder = DeepseekOcr2VisionEncoder(encoder_config(config.encoder))
        width = config.encoder.hidden_size
        self.query_768 = nn.Embedding(CROP_QUERIES, width)  # the vendor's names: queries of a 768 view
        self.query_1024 = nn.Embedding(GLOBAL_QUERIES, width)
        self.projector = nn.Linear(config.projector_input, config.text.hidden_size)
        self.view_seperator = nn.Parameter(torch.empty(config.text.hidden_size))  # sic: the vendor key
        self.language_model = build_decoder(config.text, attn_implementation, experts_implementation)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    # --- vision stages: each one call per view group, timed separately by the engine -------------
    def encode_sam(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) normalised pixels → (B, C, S/64, S/64) compressed SAM features."""
        return self.sam(pixels).last_hidden_state

    def encode_views(self, sam_features: torch.Tensor) -> torch.Tensor:
        """SAM features (B, C, g, g) → the encoder's outputs at its g² queries, (B, g², C): the Qwen2
        stack over [visual tokens ; queries] at positions 0..2g²−1, final norm, visual outputs dropped."""
        hidden = self._with_queries(sam_features)
        views = hidden.shape[1] // 2
        positions = torch.arange(2 * views, device=hidden.device)[None]
        rotary = self.encoder.rotary_emb(hidden, positions)
        mask = view_mask(views, hidden.dtype, hidden.device)
        for layer in self.encoder.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary)
        return self.encoder.norm(hidden[:, views:])

    def _with_queries(self, sam_features: torch.Tensor) -> torch.Tensor:
        """[visual tokens ; the view size's learned queries], (B, 2g², C)."""
        visual = sam_features.flatten(2).transpose(1, 2)
        batch, views, _ = visual.shape
        if views == CROP_QUERIES:
            table = self.query_768.weight
        elif views == GLOBAL_QUERIES:
            table = self.query_1024.weight
        else:  # transformers picks by `views <= 144`; the vendor has queries for these two sizes only
            raise ValueError(
                f"a {int(views ** 0.5)}×{int(views ** 0.5)} SAM grid has no query table: DeepSeek-OCR-2 "
                f"encodes 768-px views ({CROP_QUERIES} tokens) and 1024-px views ({GLOBAL_QUERIES})"
            )
        return torch.cat([visual, table.to(visual.dtype).expand(batch, -1, -1)], dim=1)

    def view_blocks(self) -> ViewBlocks:
        """The encoder layer by layer (`encode_views` in blocks), each made hidden → hidden by
        `EncoderBlock`; the global view and the tiles run apart (their query counts differ)."""
        return ViewBlocks(
            self._with_queries,
            [EncoderBlock(layer, self.encoder.rotary_emb) for layer in self.encoder.layers],
            lambda hidden: self.encoder.norm(hidden[:, hidden.shape[1] // 2:]),
        )

    def project(self, encoded: torch.Tensor, sam_features: torch.Tensor) -> torch.Tensor:
        """(B, g², C) query outputs → (B, g², hidden). `sam_features` is unused (v1's signature: its
        projector also reads SAM channels)."""
        return self.projector(encoded)

    def layout(
        self, global_tokens: torch.Tensor, local_tokens: torch.Tensor | None, crop_grid: tuple[int, int]
    ) -> torch.Tensor:
        """The vendor's order: every crop's query outputs (crops row-major, each in query order), the
        global view's, then `view_seperator`. No newline vectors, so `crop_grid` only orders the crops
        the preprocessing already cut row-major. global_tokens (g², C); local_tokens (n, 144, C)."""
        parts = [] if local_tokens is None else [local_tokens.reshape(-1, local_tokens.shape[-1])]
        parts += [global_tokens, self.view_seperator.to(global_tokens.dtype)[None]]
        return torch.cat(parts)

    # --- language model -----------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
