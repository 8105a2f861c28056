"""DeepSeek-OCR (v1)'s dimensions: one dataclass per part, a name → dims table for the presets, its modes,
and the mapping to and from the vendor's `config.json`. Torch-free: the farm's parent names presets and
modes from it.

The vendor's HF code reads only the top-level language keys and hard-codes every vision size; we read
the vision sizes from `vision_config.width` (whose values equal the hard-coded ones in the real file) so
that the `tiny` preset can shrink them while keeping the same topology and token schedule: 16-px
patches, 14-px windows, a 1024-px global view compressed 16× to a 16×16 grid, a 257-position CLIP table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dsocr_workers.errors import CheckpointError
from dsocr_workers.model.config import TINY_SAM, TINY_TEXT, ModeSpec, SamDims, TextDims, pick_mode

TITLE = "DeepSeek-OCR"
ARCHITECTURE = "DeepseekOCRForCausalLM"  # the vendor remote code's class, in its config.json

@dataclass(frozen=True)
class ClipDims:
    width: int = 1024
    layers: int = 24
    heads: int = 16
    ffn: int = 4096
    image_size: int = 224
    patch_size: int = 14
    layer_norm_eps: float = 1e-5

    @property
    def positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


@dataclass(frozen=True)
class OCRConfig:
    sam: SamDims = field(default_factory=SamDims)
    clip: ClipDims = field(default_factory=ClipDims)
    text: TextDims = field(default_factory=TextDims)

    def __post_init__(self) -> None:
        if self.sam.out_channels != self.clip.width:
            raise CheckpointError(
                f"SAM output channels ({self.sam.out_channels}) must equal the CLIP width ({self.clip.width}): "
                "the CLIP trunk takes SAM features as its patch embeddings"
            )

    @property
    def projector_input(self) -> int:
        return self.clip.width + self.sam.out_channels

    @classmethod
    def from_vendor(cls, cfg: dict[str, Any]) -> OCRConfig:
        """Read a vendor `config.json` (top-level language keys, `vision_config.width` sizes)."""
        try:
            text = TextDims(
                **{f.name: cfg[f.name] for f in dataclasses.fields(TextDims) if f.name in cfg}
            )
            widths = cfg.get("vision_config", {}).get("width", {})
            sam_cfg = widths.get("sam_vit_b", {})
            clip_cfg = widths.get("clip-l-14-224", {})
            sam = SamDims(
                width=sam_cfg.get("width", SamDims.width),
                layers=sam_cfg.get("layers", SamDims.layers),
                heads=sam_cfg.get("heads", SamDims.heads),
                global_attn_indexes=tuple(sam_cfg.get("global_attn_indexes", SamDims.global_attn_indexes)),
                neck_channels=sam_cfg.get("neck_channels", SamDims.neck_channels),
                downsample_channels=tuple(sam_cfg.get("downsample_channels", SamDims.downsample_channels)),
            )
            clip = ClipDims(
                width=clip_cfg.get("width", ClipDims.width),
                layers=clip_cfg.get("layers", ClipDims.layers),
                heads=clip_cfg.get("heads", ClipDims.heads),
                ffn=clip_cfg.get("ffn", 4 * clip_cfg.get("width", ClipDims.width)),
            )
        except (TypeError, AttributeError) as exc:
            raise CheckpointError(f"config.json does not describe a DeepSeek-OCR model: {exc}") from exc
        if cfg.get("use_mla", False):
            raise CheckpointError(
                "config.json asks for MLA attention (use_mla=true); DeepSeek-OCR v1 uses MHA"
            )
        if cfg.get("norm_topk_prob", False):
            raise CheckpointError(
                "norm_topk_prob=true is not DeepSeek-OCR v1 (top-k weights are not renormalised)"
            )
        return cls(sam=sam, clip=clip, text=text)

    def to_vendor(self) -> dict[str, Any]:
        """A `config.json` in the vendor's layout (language keys at top level and under `language_config`)."""
        language = self.text.to_vendor()
        return {
            "_name_or_path": "deepseek-ai/DeepSeek-OCR",
            "architectures": [ARCHITECTURE],
            "model_type": "deepseek_vl_v2",
            "candidate_resolutions": [[1024, 1024]],
            "global_view_pos": "head",
            "tile_tag": "2D",
            "language_config": language,
            "projector_config": {
                "input_dim": self.projector_input,
                "model_type": "mlp_projector",
                "n_embed": self.text.hidden_size,
                "projector_type": "linear",
            },
            "vision_config": {
                "image_size": 1024,
                "mlp_ratio": 3.7362,
                "model_name": "deeplip_b_l",
                "model_type": "vision",
                "width": {
                    "clip-l-14-224": {
                        "heads": self.clip.heads,
                        "image_size": self.clip.image_size,
                        "layers": self.clip.layers,
                        "patch_size": self.clip.patch_size,
                        "width": self.clip.width,
                        "ffn": self.clip.ffn,
                    },
                    "sam_vit_b": {
                        "downsample_channels": list(self.sam.downsample_channels),
                        "global_attn_indexes": list(self.sam.global_attn_indexes),
                        "heads": self.sam.heads,
                        "layers": self.sam.layers,
                        "width": self.sam.width,
                        "neck_channels": self.sam.neck_channels,
                    },
                },
            },
            **{k: v for k, v in language.items() if k not in ("architectures",)},
            "torch_dtype": "bfloat16",
            "transformers_version": "4.46.3",
        }


# name → dims. `full` is DeepSeek-OCR v1 (3.336 B parameters). `tiny` keeps every topological feature
# (windowed + global SAM blocks, 16× compressor, CLIP-on-SAM, dense layer 0 then MoE with shared experts,
# the vendor vocabulary and special ids) at widths that run a whole page on a CPU in seconds.
PRESETS: dict[str, OCRConfig] = {
    "full": OCRConfig(),
    "tiny": OCRConfig(
        sam=TINY_SAM,
        clip=ClipDims(width=64, layers=2, heads=2, ffn=128),
        text=TINY_TEXT,
    ),
}


# Resolution modes (spec §3).
MODES: dict[str, ModeSpec] = {
    m.name: m
    for m in (
        ModeSpec("tiny", 512, 512, False),
        ModeSpec("small", 640, 640, False),
        ModeSpec("base", 1024, 1024, False),
        ModeSpec("large", 1280, 1280, False),
        ModeSpec("gundam", 1024, 640, True),
    )
}


def get_mode(mode: str | ModeSpec) -> ModeSpec:
    return pick_mode(MODES, mode, TITLE)


# The vendor's default mode: what a run, a warm-up or `dsocr infer` uses when nothing says otherwise.
DEFAULT_MODE = "gundam"
MAX_CROPS = 9  # the vendor's `max_num` for its tiling: the most tiles a crop-mode page is cut into


def matches(config_json: dict[str, Any]) -> str | None:
    """The layout of a `config.json` if it describes DeepSeek-OCR: "vendor" (the HF remote code's,
    whose architecture names the model), else None. transformers ships no DeepSeek-OCR (v1) layout."""
    architectures = config_json.get("architectures") or []
    return "vendor" if isinstance(architectures, list) and ARCHITECTURE in architectures else None
