"""DeepSeek-OCR v1 as one module: the vision stages as separate methods (so the engine can time each),
the image-token layout and the MoE decoder with an untied `lm_head`.

The decoder is transformers' `DeepseekOcr2TextModel` (the same DeepSeek-V2 MHA decoder; spec §11
verified it against the vendor numerics). Vision: transformers' SAM encoder, our CLIP-on-SAM trunk.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2TextConfig
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2TextModel

from dsocr_workers.model import experts  # noqa: F401  (registers the vendor-loop experts implementation)
from dsocr_workers.model.config import BOS_TOKEN_ID, EOS_TOKEN_ID, OCRConfig, TextDims
from dsocr_workers.model.vision import ClipOnSam, build_sam, layout_image_tokens

# transformers 5.24 renamed the decoder's KV-cache argument `past_key_values` to `cache` (the old name warns
# until 5.40); 5.17, on the device images, knows only the old one. Callers pass {CACHE_ARGUMENT: cache}.
CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(DeepseekOcr2TextModel.forward).parameters else "past_key_values"
)


def text_config(
    dims: TextDims, attn_implementation: str, experts_implementation: str
) -> DeepseekOcr2TextConfig:
    config = DeepseekOcr2TextConfig(
        vocab_size=dims.vocab_size,
        hidden_size=dims.hidden_size,
        intermediate_size=dims.intermediate_size,
        moe_intermediate_size=dims.moe_intermediate_size,
        num_hidden_layers=dims.num_hidden_layers,
        num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_key_value_heads,
        n_routed_experts=dims.n_routed_experts,
        num_experts_per_tok=dims.num_experts_per_tok,
        n_shared_experts=dims.n_shared_experts,
        max_position_embeddings=dims.max_position_embeddings,
        rms_norm_eps=dims.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta},
        topk_method=dims.topk_method,
        n_group=dims.n_group,
        topk_group=dims.topk_group,
        routed_scaling_factor=dims.routed_scaling_factor,
        mlp_layer_types=["dense"] * dims.first_k_dense_replace
        + ["sparse"] * (dims.num_hidden_layers - dims.first_k_dense_replace),
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    config._experts_implementation = experts_implementation
    return config


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
        self.language_model = DeepseekOcr2TextModel(
            text_config(config.text, attn_implementation, experts_implementation)
        )
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    # --- vision stages: each one call per view group, timed separately by the engine -------------
    def encode_sam(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) normalised pixels → (B, C, S/64, S/64) compressed SAM features."""
        return self.sam(pixels).last_hidden_state

    def encode_clip(self, sam_features: torch.Tensor) -> torch.Tensor:
        """SAM features → CLIP outputs without the CLS position: (B, h·w, C_clip)."""
        return self.clip(sam_features)[:, 1:]

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
