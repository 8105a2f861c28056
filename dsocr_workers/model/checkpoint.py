"""Checkpoint directories of any model family (`config.json`, safetensors, tokenizer) and the
random-weight presets.

The directory's `config.json` picks the family and its layout (model/families.py); the family gives its
config, its key map (its keys.py: checkpoint names ↔ our module names) and the shapes to expect. The
vendor layouts store each routed expert on its own; the reader stacks them into transformers' fused
tensors as it streams them (model/keys.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsocr_workers.errors import CheckpointError
from dsocr_workers.model.families import (
    ModelFamily,
    all_presets,
    detect,
    family_of_config,
    family_of_preset,
    read_config_json,
)
from dsocr_workers.model.keys import OUR_EXPERTS, VENDOR_EXPERT
from dsocr_workers.model.tokenizer import OCRTokenizer

SAFETENSORS_FILE = "model-00001-of-000001.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PRESET_METADATA_KEY = "dsocr_preset"  # marks a saved preset: its weights are random

@dataclass(frozen=True)
class LoadedModel:
    model: Any  # the family's model class (an nn.Module)
    tokenizer: OCRTokenizer
    config: Any  # the family's config (its `text` is the shared decoder's TextDims)
    family: ModelFamily
    fingerprint: str  # presets: `preset_fingerprint`; checkpoints: a hash of config + tensor headers/samples
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
            raise CheckpointError(
                f"{directory}: files named by {INDEX_FILE} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return files


def _fingerprint(directory: Path, files: list[Path]) -> str:
    """Cheap content fingerprint: config.json, every safetensors header, and 1 MiB samples from the
    start, middle and end of each file's data (hashing whole files would slow every worker start). A
    header is hashed with its keys sorted: safetensors writes the metadata in a hash map's order, which
    changes from one write of the same tensors to the next."""
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))  # safetensors has read it already (load_checkpoint)
            digest.update(json.dumps(header, sort_keys=True).encode())
            data = 8 + header_len  # the samples leave the header's bytes out, for the same reason
            for offset in (data, (data + size) // 2, max(data, size - (1 << 20))):
                handle.seek(offset)
                digest.update(handle.read(1 << 20))
    return "sha256:" + digest.hexdigest()[:16]


def _validate(
    found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], directory: Path, title: str
) -> None:
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
    raise CheckpointError(f"{directory} does not match the {title} architecture: " + "; ".join(problems))


def load_checkpoint(
    directory: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> LoadedModel:
    """Load a vendor-layout checkpoint directory offline. Validates every tensor name and shape from the
    safetensors headers before reading any data, then streams the tensors onto `device` (`_read_state`)."""
    directory = Path(directory)
    family, layout, config = _read_config(directory)
    keys = family.code().keys
    tokenizer = OCRTokenizer.from_dir(directory)
    files = _safetensors_files(directory)
    with ExitStack() as opened:
        handles: dict[str, Any] = {}  # vendor key → the open file that holds it
        found: dict[str, tuple[int, ...]] = {}
        metadata: dict[str, str] = {}
        for path in files:
            try:
                handle = opened.enter_context(safe_open(str(path), framework="pt", device=str(device)))
                metadata.update(handle.metadata() or {})
                for key in handle.keys():
                    handles[key] = handle
                    found[key] = tuple(handle.get_slice(key).get_shape())
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
        _validate(found, keys.expected_shapes(config, layout), directory, family.title)
        state = _read_state(handles, config, device, dtype, lambda key: keys.to_ours(key, layout))
    model = _materialize(family, config, state, device, dtype, attn_implementation, experts_implementation)
    preset, seed = _preset_tag(metadata.get(PRESET_METADATA_KEY))
    return LoadedModel(model, tokenizer, config, family, _fingerprint(directory, files), preset, seed)


def _read_state(
    handles: dict[str, Any],
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    to_ours: Callable[[str], str],
) -> dict[str, torch.Tensor]:
    """Our state dict, read tensor by tensor from open safetensors files (vendor key → handle, opened
    with `device=`): each tensor is converted to `dtype` on the device, so the process never holds a
    second copy of the model. The routed experts are copied into transformers' fused tensors
    (`OUR_EXPERTS`); the caller has validated the names and shapes, so every slice gets written."""
    count = config.text.n_routed_experts
    state: dict[str, torch.Tensor] = {}

    def stacked(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in state:
            state[name] = torch.empty(shape, device=device, dtype=dtype)
        return state[name]

    for key, handle in handles.items():
        tensor = handle.get_tensor(key)
        match = VENDOR_EXPERT.fullmatch(key)
        if match is None:
            state[to_ours(key)] = tensor.to(dtype)
            continue
        layer, expert, kind = match.groups()
        prefix = f"language_model.layers.{layer}.mlp.experts"
        if kind == "down":
            stacked(f"{prefix}.down_proj", (count, *tensor.shape))[int(expert)].copy_(tensor)
        else:  # gate rows first, then up (transformers' gate_up_proj)
            rows = tensor.shape[0]
            fused = stacked(f"{prefix}.gate_up_proj", (count, 2 * rows, tensor.shape[1]))
            start = 0 if kind == "gate" else rows
            fused[int(expert), start:start + rows].copy_(tensor)
    return state


def _read_config(directory: Path) -> tuple[ModelFamily, str, Any]:
    """The family, layout and config of a checkpoint directory, from its `config.json`."""
    config_path = directory / "config.json"
    family, layout = detect(read_config_json(directory), str(config_path))
    try:
        return family, layout, family.config_from(json.loads(config_path.read_text()), layout)
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc


def model_config(source: str) -> Any:
    """The architecture (its family's config) of a preset name or a checkpoint directory, without
    reading any weights."""
    if source in all_presets():
        return family_of_preset(source).presets[source]
    return _read_config(Path(source))[2]


def _preset_tag(tag: str | None) -> tuple[str | None, int | None]:
    """"tiny:seed3" → ("tiny", 3): the safetensors metadata `save_preset` writes."""
    if not tag or ":seed" not in tag:
        return None, None
    name, seed = tag.split(":seed", 1)
    return name, int(seed) if seed.isdigit() else None


def _materialize(
    family: ModelFamily,
    config: Any,
    state: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    experts_implementation: str,
) -> Any:
    """Build the module on the meta device (no wasted init of 3.3 B parameters), assign the tensors,
    then rebuild the non-persistent buffers (RoPE frequencies) on the target device."""
    with torch.device("meta"):
        model = family.code().model(config, attn_implementation, experts_implementation)
    state = {key: tensor.to(device=device, dtype=dtype) for key, tensor in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # every RoPE table: the decoder's, and an encoder's that has one
        for module in list(model.modules()):
            if isinstance(getattr(module, "rotary_emb", None), torch.nn.Module) and hasattr(module, "config"):
                module.rotary_emb = type(module.rotary_emb)(config=module.config)
    leftover = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if leftover:
        raise RuntimeError(f"buffers left on the meta device: {leftover}")
    return model.eval().requires_grad_(False)


# --- presets: each random weight is a pure function of (seed, tensor name, position), made on the
# device the model is built on, so a seed gives bit-identical weights on the CPU and any GPU.
# `_fill_random_`'s recipe, in every preset's fingerprint: change it with the values.
PRESET_WEIGHTS = "hash16-v1"
_CPU = torch.device("cpu")
_COUNTERS_PER_STEP = 1 << 22  # hashes per step of `_fill_random_`: its int32 temporaries stay at 16 MiB


def _init_std(key: str, shape: tuple[int, ...]) -> float | None:
    """Standard deviation of the preset's random init for one tensor; None = constant (norms). Larger
    than training scales on purpose: at N(0, 0.02) greedy output collapses to one repeated token and
    position bugs barely move the logits (spec §12), which would make the engine's checks toothless."""
    if "norm" in key and len(shape) == 1:
        return None
    if key.endswith("embed_tokens.weight") or key in ("image_newline", "view_seperator"):
        return 1.0
    if key.endswith(("pos_embed", "rel_pos_h", "rel_pos_w", "class_embedding", "position_embedding.weight")):
        return 0.1
    if len(shape) == 1:  # biases
        return 0.02
    if OUR_EXPERTS.fullmatch(key):
        return shape[-1] ** -0.5
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    if key.startswith("language_model.") and key.endswith(("q_proj.weight", "k_proj.weight")):
        # Sharper attention: at the variance-preserving scale an off-by-one RoPE position in decode
        # rarely flips a greedy token; at twice the scale it does.
        return 2 * fan_in ** -0.5
    return fan_in ** -0.5


@functools.cache
def _normal_quantiles() -> torch.Tensor:
    """N(0, 1)'s quantiles at the 65,536 midpoints (k + ½)/65,536 in float64, always on the CPU: indexed
    by 16 uniform bits they sample the normal distribution (by its inverse CDF), cut at ±4.2σ."""
    return torch.special.ndtri((torch.arange(1 << 16, dtype=torch.float64) + 0.5) / (1 << 16))


def _int32(bits: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _shift_right_(x: torch.Tensor, shift: int, out: torch.Tensor) -> torch.Tensor:
    """The logical right shift of int32 bit patterns into `out` (torch shifts a signed type
    arithmetically)."""
    torch.bitwise_right_shift(x, shift, out=out)
    return out.bitwise_and_((1 << (32 - shift)) - 1)


def _hash32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' `lowbias32` in place on int32 bit patterns: a bijection of the 32-bit words whose
    output bits each flip with probability ~½ when any input bit does."""
    x.bitwise_xor_(_shift_right_(x, 16, scratch)).mul_(_int32(0x7FEB352D))
    x.bitwise_xor_(_shift_right_(x, 15, scratch)).mul_(_int32(0x846CA68B))
    return x.bitwise_xor_(_shift_right_(x, 16, scratch))


def _fill_random_(flat: torch.Tensor, table: torch.Tensor, seed: int, key: str) -> None:
    """Write tensor `key`'s weights of preset seed `seed` into `flat` (1-D, contiguous, on its device):

        value[i] = table[16 bits of lowbias32((a·j + b) mod 2³²)],   (a, b) from sha256("seed:name")

    with j = i and the hash's high 16 bits for the first ⌈n/2⌉ elements, j = i − ⌈n/2⌉ and its low 16
    bits for the rest. `table` holds the tensor's 65,536 possible values (N(0, 1)'s midpoint quantiles
    times its deviation, rounded to bfloat16 then to the target dtype on the CPU). Only int32
    arithmetic, which wraps alike on the CPU and CUDA, and a gather run on the device."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    multiplier = _int32(int.from_bytes(digest[:4], "little") | 1)  # odd: j ↦ a·j + b is a bijection mod 2³²
    offset = _int32(int.from_bytes(digest[4:8], "little"))
    half = (flat.numel() + 1) // 2
    for start in range(0, half, _COUNTERS_PER_STEP):
        stop = min(start + _COUNTERS_PER_STEP, half)
        x = torch.arange(start, stop, dtype=torch.int32, device=flat.device)
        scratch = torch.empty_like(x)
        _hash32_(x.mul_(multiplier).add_(offset), scratch)
        torch.index_select(table, 0, _shift_right_(x, 16, scratch), out=flat[start:stop])
        second = flat[half + start:half + stop]  # one element shorter at the very end when n is odd
        torch.index_select(table, 0, x[:second.numel()].bitwise_and_(0xFFFF), out=second)


def preset_state(
    config: Any,
    seed: int,
    *,
    device: torch.device = _CPU,
    dtype: torch.dtype = torch.bfloat16,
    keys: Sequence[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights, tensor by tensor in state-dict order (or `keys`, in their order), made on
    `device` in `dtype` (`_fill_random_`). The values are bfloat16's whatever `dtype` (the
    vendor's storage dtype: a saved preset reloads bit-identically), and the same on every device."""
    model_class = family_of_config(config).code().model
    with torch.device("meta"):
        shapes = {key: tuple(t.shape) for key, t in model_class(config).state_dict().items()}
    stds = {key: _init_std(key, shapes[key]) for key in (shapes if keys is None else keys)}
    scales = sorted({std for std in stds.values() if std is not None})
    # Every table at once: a handful of operations, not a handful per tensor.
    tables = (_normal_quantiles() * torch.tensor(scales, dtype=torch.float64)[:, None]).to(torch.bfloat16)
    tables = tables.to(dtype).to(device)
    for key, std in stds.items():
        if std is None:
            make = torch.ones if key.endswith("weight") else torch.zeros
            yield key, make(shapes[key], device=device, dtype=dtype)
            continue
        tensor = torch.empty(shapes[key], device=device, dtype=dtype)
        _fill_random_(tensor.view(-1), tables[scales.index(std)], seed, key)
        yield key, tensor


def preset_fingerprint(name: str, seed: int) -> str:
    return f"preset:{name}:seed{seed}:{PRESET_WEIGHTS}"


def build_preset(
    name: str,
    *,
    seed: int = 0,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    experts_implementation: str = "eager",
) -> LoadedModel:
    """A preset's model with its seeded random weights made on `device` (no host copy, no checkpoint)."""
    family = family_of_preset(name)
    config = family.presets[name]
    state = dict(preset_state(config, seed, device=device, dtype=dtype))
    model = _materialize(family, config, state, device, dtype, attn_implementation, experts_implementation)
    return LoadedModel(
        model, OCRTokenizer.build_preset(), config, family, preset_fingerprint(name, seed), name, seed
    )


def save_preset(name: str, directory: str | Path, *, seed: int = 0, device: torch.device = _CPU) -> Path:
    """Write a preset as a checkpoint directory in the vendor layout; it then loads through
    `load_checkpoint` to the same values `build_preset` makes. The weights are made on `device` (a GPU
    writes the same bytes; the CPU by default: no CUDA context behind a caller's back)."""
    family = family_of_preset(name)
    config = family.presets[name]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = dict(preset_state(config, seed, device=device))
    vendor = {key: t.contiguous().cpu() for key, t in family.code().keys.to_vendor_state(state).items()}
    del state  # on a GPU: the device's copy goes before the file is written
    save_file(
        vendor,
        str(directory / SAFETENSORS_FILE),
        metadata={"format": "pt", PRESET_METADATA_KEY: f"{name}:seed{seed}"},
    )
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in vendor.values())},
        "weight_map": {key: SAFETENSORS_FILE for key in sorted(vendor)},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config.to_vendor(), indent=2))
    OCRTokenizer.build_preset().save(directory)
    return directory
