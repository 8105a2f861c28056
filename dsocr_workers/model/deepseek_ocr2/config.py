"""DeepSeek-OCR-2's dimensions, presets, modes and the mapping to and from its two `config.json`
layouts (torch-free: the farm's parent processes read it).

The vendor's remote code hard-codes every vision size and reads only the top-level language keys; its
`vision_config` still says `downsample_channels [512, 1024]` (v1's) although SAM ends in 896 channels.
We read the SAM output width from the encoder width (`width.qwen2-0-5b.dim`, 896: the encoder takes SAM
channels as its tokens), and any other size from keys the vendor file lacks, defaulting to its code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dsocr_workers.errors import CheckpointError
from dsocr_workers.model.config import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    TINY_SAM,
    TINY_TEXT,
    ModeSpec,
    SamDims,
    TextDims,
)

# Queries per view: a 768-px crop (12×12 SAM grid) and the 1024-px global view (16×16).
CROP_QUERIES = 144
GLOBAL_QUERIES = 256
VENDOR_ARCHITECTURE = "DeepseekOCR2ForCausalLM"
TRANSFORMERS_MODEL_TYPE = "deepseek_ocr2"


@dataclass(frozen=True)
class EncoderDims:
    """The Qwen2 stack run as an encoder over [visual tokens ; queries] (no token embedding)."""

    layers: int = 24
    hidden_size: int = 896
    heads: int = 14
    kv_heads: int = 2
    intermediate_size: int = 4864
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads


@dataclass(frozen=True)
class OCR2Config:
    sam: SamDims = field(default_factory=lambda: SamDims(downsample_channels=(512, 896)))
    encoder: EncoderDims = field(default_factory=EncoderDims)
    text: TextDims = field(default_factory=TextDims)

    def __post_init__(self) -> None:
        if self.sam.out_channels != self.encoder.hidden_size:
            raise CheckpointError(
                f"SAM output channels ({self.sam.out_channels}) must equal the encoder width "
                f"({self.encoder.hidden_size}): the encoder reads SAM channels as its tokens"
            )
        if self.encoder.hidden_size % self.encoder.heads or self.encoder.heads % self.encoder.kv_heads:
            raise CheckpointError(
                f"encoder heads {self.encoder.heads} / kv heads {self.encoder.kv_heads} do not divide "
                f"its width {self.encoder.hidden_size}"
            )

    @property
    def projector_input(self) -> int:
        return self.encoder.hidden_size

    @classmethod
    def from_vendor(cls, cfg: dict[str, Any]) -> OCR2Config:
        """Read the remote code's `config.json` (top-level language keys; vision sizes as above)."""
        try:
            widths = cfg.get("vision_config", {}).get("width", {})
            encoder = _read(EncoderDims, widths.get("qwen2-0-5b", {}), _VENDOR_ENCODER)
            sam_cfg = widths.get("sam_vit_b", {})
            first = tuple(sam_cfg.get("downsample_channels", (512,)))[0]  # the second is stale: see above
            sam = _read(SamDims, sam_cfg, _VENDOR_SAM, downsample_channels=(first, encoder.hidden_size))
            projector_input = cfg.get("projector_config", {}).get("input_dim", encoder.hidden_size)
            config = cls(sam=sam, encoder=encoder, text=_text_dims(cfg))
        except (TypeError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"config.json does not describe a DeepSeek-OCR-2 model: {exc}") from exc
        if projector_input != encoder.hidden_size:
            raise CheckpointError(
                f"projector_config.input_dim {projector_input} is not the encoder width {encoder.hidden_size}"
            )
        return config

    @classmethod
    def from_transformers(cls, cfg: dict[str, Any]) -> OCR2Config:
        """Read transformers' `deepseek_ocr2` config. Its class defaults are placeholders (encoder 4096
        wide, theta 10000), so every encoder size must be in the file: a missing one is an error."""
        try:
            vision, text = cfg["vision_config"], cfg["text_config"]
            encoder_cfg = vision["encoder_config"]
            missing = [key for key in _TRANSFORMERS_ENCODER.values() if key not in encoder_cfg]
            if missing:
                raise KeyError(", ".join(missing))
            encoder = _read(EncoderDims, encoder_cfg, _TRANSFORMERS_ENCODER, rope_theta=_rope_theta(encoder_cfg))
            sam = _read(SamDims, vision["sam_config"], _TRANSFORMERS_SAM)
            text_dims = _text_dims(text, layer_types=text.get("mlp_layer_types"))
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"config.json is not a complete transformers deepseek_ocr2 config: {exc}") from exc
        return cls(sam=sam, encoder=encoder, text=text_dims)

    def to_transformers(self) -> dict[str, Any]:
        """A `config.json` in transformers' `deepseek_ocr2` layout."""
        text = self.text
        layer_types = ["dense"] * text.first_k_dense_replace
        layer_types += ["sparse"] * (text.num_hidden_layers - text.first_k_dense_replace)
        return {
            "architectures": ["DeepseekOcr2ForConditionalGeneration"],
            "model_type": TRANSFORMERS_MODEL_TYPE,
            "image_token_id": IMAGE_TOKEN_ID,
            "tie_word_embeddings": False,
            "vision_config": {
                "sam_config": _write(self.sam, _TRANSFORMERS_SAM),
                "encoder_config": {
                    **_write(self.encoder, _TRANSFORMERS_ENCODER),
                    "rope_parameters": {"rope_type": "default", "rope_theta": self.encoder.rope_theta},
                },
            },
            "text_config": {
                **{k: v for k, v in dataclasses.asdict(text).items() if k not in ("rope_theta", "first_k_dense_replace")},
                "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta},
                "mlp_layer_types": layer_types,
                "bos_token_id": BOS_TOKEN_ID,
                "eos_token_id": EOS_TOKEN_ID,
            },
        }

    def to_vendor(self) -> dict[str, Any]:
        """A `config.json` in the remote code's layout; sizes the vendor file does not carry are added
        under `vision_config.width` (its code ignores them)."""
        language = self.text.to_vendor()
        return {
            "_name_or_path": "deepseek-ai/DeepSeek-OCR-2",
            "architectures": [VENDOR_ARCHITECTURE],
            "auto_map": {
                "AutoConfig": "modeling_deepseekocr2.DeepseekOCR2Config",
                "AutoModel": "modeling_deepseekocr2.DeepseekOCR2ForCausalLM",
            },
            "candidate_resolutions": [[1024, 1024]],
            "global_view_pos": "head",
            "model_type": "deepseek_vl_v2",
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
                "model_name": "deepencoderv2",
                "model_type": "vision",
                "width": {
                    "qwen2-0-5b": _write(self.encoder, _VENDOR_ENCODER),
                    "sam_vit_b": {
                        **_write(self.sam, _VENDOR_SAM),
                        "downsample_channels": list(self.sam.downsample_channels),
                    },
                },
            },
            **{k: v for k, v in language.items() if k != "architectures"},
            "transformers_version": "4.46.3",
        }


# Our field → the file's key, per layout and part.
_VENDOR_SAM = {f: f for f in ("width", "layers", "heads", "global_attn_indexes", "neck_channels")}
_VENDOR_ENCODER = {
    "hidden_size": "dim", "layers": "layers", "heads": "heads", "kv_heads": "kv_heads",
    "intermediate_size": "intermediate_size", "rope_theta": "rope_theta",
}
_TRANSFORMERS_SAM = {
    "width": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
    "global_attn_indexes": "global_attn_indexes", "window_size": "window_size",
    "neck_channels": "output_channels", "downsample_channels": "downsample_channels",
}
_TRANSFORMERS_ENCODER = {
    "hidden_size": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
}


def _read(cls: type, src: dict[str, Any], names: dict[str, str], **given: Any) -> Any:
    """A dims dataclass from the keys of `src` named by `names` (absent keys: the class defaults)."""
    values = {field: src[key] for field, key in names.items() if src.get(key) is not None}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**{**values, **given})


def _write(dims: Any, names: dict[str, str]) -> dict[str, Any]:
    values = {key: getattr(dims, field) for field, key in names.items()}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _rope_theta(cfg: dict[str, Any]) -> float:
    """transformers ≥ 5 writes `rope_parameters.rope_theta`; older files a top-level `rope_theta`."""
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params:
        return params["rope_theta"]
    return cfg["rope_theta"]


def _text_dims(cfg: dict[str, Any], layer_types: list[str] | None = None) -> TextDims:
    """The decoder's dims (v1's TextDims: the same DeepSeek MoE decoder)."""
    if cfg.get("use_mla", False):
        raise CheckpointError("config.json asks for MLA attention (use_mla=true); DeepSeek-OCR-2 uses MHA")
    if cfg.get("norm_topk_prob", False):
        raise CheckpointError("norm_topk_prob=true is not DeepSeek-OCR-2 (top-k weights are not renormalised)")
    values = {f.name: cfg[f.name] for f in dataclasses.fields(TextDims) if f.name in cfg}
    if "rope_parameters" in cfg or "rope_theta" in cfg:
        values["rope_theta"] = float(_rope_theta(cfg))
    if layer_types is not None:
        values["first_k_dense_replace"] = layer_types.count("dense")
    for key in ("n_group", "topk_group"):  # transformers writes null for "no grouping"
        if values.get(key) is None:
            values.pop(key, None)
    return TextDims(**values)


# name → dims. `ocr2-full` is DeepSeek-OCR-2's real sizes. `ocr2-tiny` keeps every topological feature
# (windowed + global SAM blocks, the compressor, a GQA encoder with both query tables, dense layer 0
# then MoE with shared experts, the vendor vocabulary, special ids and token schedule) at CPU widths.
PRESETS: dict[str, OCR2Config] = {
    "ocr2-full": OCR2Config(),
    "ocr2-tiny": OCR2Config(
        sam=TINY_SAM,
        encoder=EncoderDims(layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128),
        text=TINY_TEXT,
    ),
}

# The vendor's settings (spec "Preprocessing"): crop mode (a 1024 padded global view + 768 crops) is the
# default and the only one its README documents; the code also accepts one padded 1024 view and one
# 768 view stretched to a square.
MODES: dict[str, ModeSpec] = {
    m.name: m
    for m in (
        ModeSpec("gundam", 1024, 768, True),
        ModeSpec("base", 1024, 1024, False),
        ModeSpec("small", 768, 768, False),
    )
}
DEFAULT_MODE = "gundam"
MIN_CROPS = 2
MAX_CROPS = 6  # `dynamic_preprocess(max_num=6)`, the same in the HF and vLLM paths


def matches(config_json: dict[str, Any]) -> str | None:
    """The layout of a `config.json` if it is DeepSeek-OCR-2's: "vendor" (the remote code's),
    "transformers" (transformers' `deepseek_ocr2`), else None (v1's `deepseek_vl_v2` file included)."""
    if not isinstance(config_json, dict):
        return None
    if config_json.get("model_type") == TRANSFORMERS_MODEL_TYPE:
        return "transformers"
    auto_model = str((config_json.get("auto_map") or {}).get("AutoModel", ""))
    model_name = (config_json.get("vision_config") or {}).get("model_name")
    if (
        VENDOR_ARCHITECTURE in (config_json.get("architectures") or [])
        or auto_model.startswith("modeling_deepseekocr2.")
        or model_name == "deepencoderv2"
    ):
        return "vendor"
    return None


def read_config(config_json: dict[str, Any]) -> OCR2Config:
    """A `config.json` of either layout; anything else is a CheckpointError."""
    layout = matches(config_json)
    if layout == "vendor":
        return OCR2Config.from_vendor(config_json)
    if layout == "transformers":
        return OCR2Config.from_transformers(config_json)
    raise CheckpointError("config.json is not DeepSeek-OCR-2 (neither the remote-code nor transformers' layout)")
