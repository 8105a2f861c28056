"""What every model family shares, torch-free: the decoder's dimensions and special ids (both families
run the same DeepSeek MoE decoder with the vendor's vocabulary), SAM's dimensions (both encode with SAM
ViT-B), the shape of a resolution mode, and the dtypes a run may ask for.

A family's own facts (its vision dims, presets, modes, crop limits) live in its package's `config.py`;
model/families.py names the families.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsocr_workers.errors import InputError

IMAGE_TOKEN_ID = 128815
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1


@dataclass(frozen=True)
class SamDims:
    width: int = 768
    layers: int = 12
    heads: int = 12
    global_attn_indexes: tuple[int, ...] = (2, 5, 8, 11)
    window_size: int = 14
    neck_channels: int = 256
    downsample_channels: tuple[int, int] = (512, 1024)
    image_size: int = 1024  # size of the absolute position table (64×64 patches); resized for other inputs
    patch_size: int = 16

    @property
    def out_channels(self) -> int:
        return self.downsample_channels[-1]


@dataclass(frozen=True)
class TextDims:
    vocab_size: int = 129280
    hidden_size: int = 1280
    intermediate_size: int = 6848
    moe_intermediate_size: int = 896
    num_hidden_layers: int = 12
    num_attention_heads: int = 10
    num_key_value_heads: int = 10
    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_vendor(self) -> dict[str, Any]:
        """The decoder's keys in both vendors' `config.json` (the same DeepSeek-V2 MHA decoder file)."""
        return {
            **dataclasses.asdict(self),
            "architectures": ["DeepseekV2ForCausalLM"],
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "kv_lora_rank": None,
            "q_lora_rank": None,
            "qk_nope_head_dim": 0,
            "qk_rope_head_dim": 0,
            "v_head_dim": 0,
            "use_mla": False,
            "lm_head": True,
            "rm_head": False,
            "torch_dtype": "bfloat16",
        }


# The tiny presets' shared parts (both families): every topological feature of SAM (windowed + global
# blocks, the 16x compressor) and of the decoder (a dense layer 0, then MoE with shared experts, the
# vendor vocabulary) at widths that run a whole page on a CPU in seconds.
TINY_SAM = SamDims(
    width=32, layers=4, heads=2, global_attn_indexes=(1, 3), neck_channels=16, downsample_channels=(32, 64)
)
TINY_TEXT = TextDims(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
    n_shared_experts=2,
)


# A resolution mode: torch-free, so the farm's parent processes can name a family's modes.
@dataclass(frozen=True)
class ModeSpec:
    name: str
    base_size: int  # global view side in crop mode
    image_size: int  # global view side otherwise; the side of a tile's view in crop mode
    crop_mode: bool

    @property
    def global_size(self) -> int:
        return self.base_size if self.crop_mode else self.image_size


def pick_mode(modes: dict[str, ModeSpec], mode: str | ModeSpec, title: str) -> ModeSpec:
    """`mode` of a family whose modes are `modes` (`title` names the family in the error)."""
    if isinstance(mode, ModeSpec):
        return mode
    try:
        return modes[mode]
    except KeyError:
        raise InputError(f"unknown mode {mode!r} for {title}; its modes: {', '.join(modes)}") from None


# What a run may ask for (checked at submit, offered as CLI choices): the dtypes the engine loads weights
# in (engine/session.py maps them to torch dtypes, with short aliases). The engines' names are the
# engine's registry (engine/variants/).
DTYPES = ("bfloat16", "float16", "float32")


def dtype_name(dtype: object) -> str:
    """"bfloat16" for torch.bfloat16: the name a result row and a cache key record (no torch import, so
    that a worker's parent can name one)."""
    return str(dtype).removeprefix("torch.")
