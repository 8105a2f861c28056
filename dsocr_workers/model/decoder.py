"""The decoder both families share: transformers' `DeepseekOcr2TextModel`, the DeepSeek-V2 MoE decoder
with MHA (spec §11 verified it against the vendor numerics; DeepSeek-OCR-2's decoder files are v1's),
built from our `TextDims`.
"""

from __future__ import annotations

import inspect

from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2TextConfig
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2TextModel

from dsocr_workers.model import experts  # noqa: F401  (registers the vendor-loop experts implementation)
from dsocr_workers.model.config import BOS_TOKEN_ID, EOS_TOKEN_ID, TextDims

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



def build_decoder(
    dims: TextDims, attn_implementation: str, experts_implementation: str
) -> DeepseekOcr2TextModel:
    return DeepseekOcr2TextModel(text_config(dims, attn_implementation, experts_implementation))
