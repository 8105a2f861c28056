"""Checkpoints in the vendor layout (`config.json`, safetensors with the vendor key names, tokenizer) and
the random-weight presets.

Vendor keys ↔ our module names: the decoder keys lose their `model.` prefix and go under
`language_model.`, with each layer's 64 routed experts stacked into transformers' fused tensors; SAM keys
get transformers' names (spec §11); CLIP, projector and the two learned vectors keep theirs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsocr_workers.errors import CheckpointError, InputError
from dsocr_workers.model.config import PRESETS, OCRConfig
from dsocr_workers.model.modeling import DeepSeekOCR
from dsocr_workers.model.tokenizer import OCRTokenizer

SAFETENSORS_FILE = "model-00001-of-000001.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PRESET_METADATA_KEY = "dsocr_preset"  # marks a saved preset: its weights are random

# SAM: vendor module path → transformers' (spec §11); block-internal norms are renamed separately.
_SAM_PATHS = {
    "blocks": "layers",
    "patch_embed.proj": "patch_embed.projection",
    "neck.0": "neck.conv1",
    "neck.1": "neck.layer_norm1",
    "neck.2": "neck.conv2",
    "neck.3": "neck.layer_norm2",
    "net_2": "proj.conv1",
    "net_3": "proj.conv2",
}
_SAM_BLOCK_NORMS = {"norm1": "layer_norm1", "norm2": "layer_norm2"}


def _rename_sam(name: str, paths: dict[str, str], norms: dict[str, str]) -> str:
    for old, new in paths.items():
        if name == old or name.startswith(old + "."):
            name = new + name[len(old):]
            break
    parts = name.split(".")
    if parts[0] in ("layers", "blocks") and len(parts) > 2:
        parts[2] = norms.get(parts[2], parts[2])
    return ".".join(parts)


_VENDOR_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_OUR_EXPERTS = re.compile(r"language_model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def _rename_to_ours(key: str) -> str:
    if key.startswith("model.sam_model."):
        return "sam." + _rename_sam(key.removeprefix("model.sam_model."), _SAM_PATHS, _SAM_BLOCK_NORMS)
    if key.startswith("model.vision_model."):
        return "clip." + key.removeprefix("model.vision_model.")
    if key.startswith("model.projector.layers."):
        return "projector." + key.removeprefix("model.projector.layers.")
    if key in ("model.image_newline", "model.view_seperator"):
        return key.removeprefix("model.")
    if key.startswith("model."):
        return "language_model." + key.removeprefix("model.")
    return key  # lm_head.weight


def _rename_to_vendor(key: str) -> str:
    if key.startswith("sam."):
        inverse_paths = {new: old for old, new in _SAM_PATHS.items()}
        inverse_norms = {new: old for old, new in _SAM_BLOCK_NORMS.items()}
        return "model.sam_model." + _rename_sam(key.removeprefix("sam."), inverse_paths, inverse_norms)
    if key.startswith("clip."):
        return "model.vision_model." + key.removeprefix("clip.")
    if key.startswith("projector."):
        return "model.projector.layers." + key.removeprefix("projector.")
    if key in ("image_newline", "view_seperator"):
        return "model." + key
    if key.startswith("language_model."):
        return "model." + key.removeprefix("language_model.")
    return key


def to_vendor_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict → the vendor's 2,710-key layout (experts unstacked)."""
    vendor: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        match = _OUR_EXPERTS.fullmatch(key)
        if match is None:
            vendor[_rename_to_vendor(key)] = tensor
            continue
        layer, kind = match.groups()
        prefix = f"model.layers.{layer}.mlp.experts"
        for expert, weight in enumerate(tensor.unbind(0)):
            if kind == "gate_up_proj":
                gate, up = weight.chunk(2, dim=0)
                vendor[f"{prefix}.{expert}.gate_proj.weight"] = gate
                vendor[f"{prefix}.{expert}.up_proj.weight"] = up
            else:
                vendor[f"{prefix}.{expert}.down_proj.weight"] = weight
    return vendor


def to_our_state(vendor: dict[str, torch.Tensor], config: OCRConfig) -> dict[str, torch.Tensor]:
    """The vendor layout → our state dict (experts stacked as transformers' fused tensors). Empties
    `vendor` as it goes: each layer's expert tensors are freed once stacked, so the copy never holds two
    whole models (on a GPU, where a checkpoint is read to)."""
    ours: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    while vendor:
        key, tensor = vendor.popitem()
        match = _VENDOR_EXPERT.fullmatch(key)
        if match is None:
            ours[_rename_to_ours(key)] = tensor
        else:
            layer, expert, kind = match.groups()
            experts.setdefault((int(layer), kind), {})[int(expert)] = tensor
    for layer in sorted({layer for layer, _ in experts}):
        count = config.text.n_routed_experts
        gate, up, down = (experts.pop((layer, kind)) for kind in ("gate", "up", "down"))
        prefix = f"language_model.layers.{layer}.mlp.experts"
        ours[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]) for e in range(count)])
        ours[f"{prefix}.down_proj"] = torch.stack([down[e] for e in range(count)])
    return ours


def expected_vendor_shapes(config: OCRConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = DeepSeekOCR(config)
    return {key: tuple(t.shape) for key, t in to_vendor_state(model.state_dict()).items()}


@dataclass(frozen=True)
class LoadedModel:
    model: DeepSeekOCR
    tokenizer: OCRTokenizer
    config: OCRConfig
    fingerprint: str  # presets: "preset:<name>:seed<N>"; checkpoints: a hash of config + tensor headers/samples
    preset: str | None = None  # set for presets, also when loaded from a `save_preset` directory
    seed: int | None = None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory}: files named by {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files


def _fingerprint(directory: Path, files: list[Path]) -> str:
    """Cheap content fingerprint: config.json, every safetensors header, and 1 MiB samples from the
    start, middle and end of each file (hashing 6.7 GB would add seconds to every worker start)."""
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(header_len))
            for offset in (0, size // 2, max(0, size - (1 << 20))):
                handle.seek(offset)
                digest.update(handle.read(1 << 20))
    return "sha256:" + digest.hexdigest()[:16]


def _validate(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], directory: Path) -> None:
    missing = sorted(expected.keys() - found.keys())
    extra = sorted(found.keys() - expected.keys())
    misshaped = sorted(k for k in expected.keys() & found.keys() if expected[k] != found[k])
    if not (missing or extra or misshaped):
        return

    def listing(keys: list[str], describe=lambda k: k) -> str:
        shown = ", ".join(describe(k) for k in keys[:10])
        return shown + (f" … and {len(keys) - 10} more" if len(keys) > 10 else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors: {listing(missing)}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors: {listing(extra)}")
    if misshaped:
        problems.append(
            f"{len(misshaped)} tensors with the wrong shape: "
            + listing(misshaped, lambda k: f"{k} {list(found[k])} (expected {list(expected[k])})")
        )
    raise CheckpointError(f"{directory} does not match the DeepSeek-OCR architecture: " + "; ".join(problems))


def load_checkpoint(
    directory: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> LoadedModel:
    """Load a vendor-layout checkpoint directory offline. Validates every tensor name and shape from the
    safetensors headers before reading any data."""
    directory = Path(directory)
    config = _read_config(directory)
    tokenizer = OCRTokenizer.from_dir(directory)
    files = _safetensors_files(directory)

    found: dict[str, tuple[int, ...]] = {}
    metadata: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata.update(handle.metadata() or {})
                for key in handle.keys():
                    found[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    _validate(found, expected_vendor_shapes(config), directory)

    # Read straight onto the device: stacking the routed experts (to_our_state) copies ~6 GB for the full
    # model, ~4 of the ~5 s a load took on the 2-core development machine's CPU; on a GPU it is a device
    # copy.
    vendor: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for key in handle.keys():
                vendor[key] = handle.get_tensor(key)
    model = _materialize(config, to_our_state(vendor, config), device, dtype, attn_implementation, experts_implementation)
    preset, seed = _preset_tag(metadata.get(PRESET_METADATA_KEY))
    return LoadedModel(model, tokenizer, config, _fingerprint(directory, files), preset, seed)


def _read_config(directory: Path) -> OCRConfig:
    if not directory.is_dir():
        raise InputError(f"{directory}: not a checkpoint directory (nor a preset: {', '.join(PRESETS)})")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    try:
        return OCRConfig.from_vendor(json.loads(config_path.read_text()))
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc


def model_config(source: str) -> OCRConfig:
    """The architecture of a preset name or a checkpoint directory, without reading any weights."""
    return PRESETS[source] if source in PRESETS else _read_config(Path(source))


def build_vision_only(
    config: OCRConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> DeepSeekOCR:
    """The model with zeros for the weights of its vision encoders and projector, on `device` as
    `_materialize` leaves them (every tensor in `dtype`), and its language model left on the meta device
    (no memory). Enough to compile the vision graphs (engine/coldstart/helpers.py): a graph depends on the
    weights' shapes, dtypes and devices, never their values. Zeros, not uninitialised memory: an index
    read from a buffer stays in range."""
    with torch.device("meta"):
        model = DeepSeekOCR(config, attn_implementation, experts_implementation)
    vision = {key: torch.zeros(tensor.shape, device=device, dtype=dtype) for key, tensor in model.state_dict().items()
              if not key.startswith(("language_model.", "lm_head."))}  # fmt: skip
    model.load_state_dict(vision, strict=False, assign=True)
    return model.eval().requires_grad_(False)


def build_zeroed(
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> LoadedModel:
    """The whole model of a preset or checkpoint directory with zeros for every weight, as a load leaves
    it (`_materialize`), and its tokenizer; no weight is read. What the language compile helper compiles
    the LM prefill and the decode step on (engine/coldstart/helpers.py): a graph depends on the weights' shapes,
    dtypes and devices, never their values."""
    config = model_config(source)
    with torch.device("meta"):
        shapes = {key: tensor.shape for key, tensor in DeepSeekOCR(config).state_dict().items()}
    state = {key: torch.zeros(shape, device=device, dtype=dtype) for key, shape in shapes.items()}
    model = _materialize(config, state, device, dtype, attn_implementation, experts_implementation)
    tokenizer = OCRTokenizer.build_preset() if source in PRESETS else OCRTokenizer.from_dir(Path(source))
    return LoadedModel(model, tokenizer, config, "zeros", None, None)


def _preset_tag(tag: str | None) -> tuple[str | None, int | None]:
    """"tiny:seed3" → ("tiny", 3): the safetensors metadata `save_preset` writes."""
    if not tag or ":seed" not in tag:
        return None, None
    name, seed = tag.split(":seed", 1)
    return name, int(seed) if seed.isdigit() else None


def _materialize(
    config: OCRConfig,
    state: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    experts_implementation: str,
) -> DeepSeekOCR:
    """Build the module on the meta device (no wasted init of 3.3 B parameters), assign the tensors,
    then rebuild the non-persistent buffers (RoPE frequencies) on the target device."""
    with torch.device("meta"):
        model = DeepSeekOCR(config, attn_implementation, experts_implementation)
    state = {key: tensor.to(device=device, dtype=dtype) for key, tensor in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    rotary = type(model.language_model.rotary_emb)
    with torch.device(device):
        model.language_model.rotary_emb = rotary(config=model.language_model.config)
    leftover = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if leftover:
        raise RuntimeError(f"buffers left on the meta device: {leftover}")
    return model.eval().requires_grad_(False)


# --- presets -----------------------------------------------------------------------------------

def _init_std(key: str, shape: tuple[int, ...]) -> float | None:
    """Standard deviation of the preset's random init for one tensor; None = constant (norms).

    Larger-than-training scales on purpose (N(0,1) embeddings, variance-preserving matrices): with
    every weight at N(0, 0.02) greedy output collapses to one repeated token and position bugs barely
    move the logits (spec §12), which would make the split-vs-one-shot checks toothless."""
    if "norm" in key and len(shape) == 1:
        return None
    if key.endswith("embed_tokens.weight") or key in ("image_newline", "view_seperator"):
        return 1.0
    if key.endswith(("pos_embed", "rel_pos_h", "rel_pos_w", "class_embedding", "position_embedding.weight")):
        return 0.1
    if len(shape) == 1:  # biases
        return 0.02
    if _OUR_EXPERTS.fullmatch(key):
        return shape[-1] ** -0.5
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    if key.startswith("language_model.") and key.endswith(("q_proj.weight", "k_proj.weight")):
        # Sharper attention: at the variance-preserving scale an off-by-one RoPE position in decode
        # moves logits by ~0.5 and rarely flips a greedy token; at twice the scale it does.
        return 2 * fan_in ** -0.5
    return fan_in ** -0.5


def preset_state(config: OCRConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights, tensor by tensor in state-dict order, generated on the CPU in float32
    and rounded to bfloat16 (the vendor's storage dtype) so a saved preset reloads bit-identically."""
    with torch.device("meta"):
        shapes = {key: tuple(t.shape) for key, t in DeepSeekOCR(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    for key, shape in shapes.items():
        std = _init_std(key, shape)
        if std is None:
            tensor = torch.ones(shape) if key.endswith("weight") else torch.zeros(shape)
        else:
            tensor = torch.empty(shape).normal_(0.0, std, generator=generator)
        yield key, tensor.to(torch.bfloat16)


def build_preset(
    name: str,
    *,
    seed: int = 0,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> LoadedModel:
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    config = PRESETS[name]
    state = dict(preset_state(config, seed))
    model = _materialize(config, state, device, dtype, attn_implementation, experts_implementation)
    return LoadedModel(model, OCRTokenizer.build_preset(), config, f"preset:{name}:seed{seed}", name, seed)


def save_preset(name: str, directory: str | Path, *, seed: int = 0) -> Path:
    """Write a preset as a checkpoint directory in the vendor layout (config.json, one safetensors
    file + index, tokenizer files); it then loads through `load_checkpoint` like a real one."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    config = PRESETS[name]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vendor = {key: tensor.contiguous() for key, tensor in to_vendor_state(dict(preset_state(config, seed))).items()}
    save_file(vendor, str(directory / SAFETENSORS_FILE), metadata={"format": "pt", PRESET_METADATA_KEY: f"{name}:seed{seed}"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in vendor.values())},
        "weight_map": {key: SAFETENSORS_FILE for key in sorted(vendor)},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config.to_vendor(), indent=2))
    OCRTokenizer.build_preset().save(directory)
    return directory
