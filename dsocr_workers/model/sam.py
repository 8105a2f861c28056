"""SAM ViT-B with the 16× compressor, the encoder both families put first: transformers' module
reproduces the vendor `sam_model` (spec §11) once keys are renamed (`SAM_PATHS`)."""

from __future__ import annotations

from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2SamVisionConfig
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2SamVisionEncoder

from dsocr_workers.model.config import SamDims


def build_sam(dims: SamDims) -> DeepseekOcr2SamVisionEncoder:
    """transformers' SAM encoder reproduces the vendor `sam_model` (spec §11) once keys are renamed."""
    config = DeepseekOcr2SamVisionConfig(
        hidden_size=dims.width,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        output_channels=dims.neck_channels,
        global_attn_indexes=list(dims.global_attn_indexes),
        window_size=dims.window_size,
        downsample_channels=list(dims.downsample_channels),
        image_size=dims.image_size,
        patch_size=dims.patch_size,
        layer_norm_eps=1e-6,
        mlp_ratio=4.0,
    )
    config._attn_implementation = "sdpa"
    return DeepseekOcr2SamVisionEncoder(config)
