"""Vendor checkpoint layout: key mapping against the real index, the presets' random weights (seeded,
the same on every device and in any order, pinned), save-preset → load round trip, a load that streams
(no second copy of the model), and clear errors for broken checkpoint directories."""

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.profiler import ProfilerActivity, profile

from dsocr_workers.errors import CheckpointError, InputError
from dsocr_workers.model.checkpoint import (
    PRESET_WEIGHTS,
    SAFETENSORS_FILE,
    _hash32_,
    build_preset,
    load_checkpoint,
    preset_state,
    save_preset,
)
from dsocr_workers.model.deepseek_ocr.config import PRESETS, OCRConfig
from dsocr_workers.model.deepseek_ocr.keys import expected_shapes as expected_vendor_shapes
from dsocr_workers.model.tokenizer import OCRTokenizer, vendor_added_tokens

VENDOR_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "deepseek-ocr"
CPU = torch.device("cpu")
DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the same weights made on a GPU"))]


def vendor_file(name: str) -> dict:
    path = VENDOR_DATA / name
    if not path.is_file():
        pytest.skip(f"vendor data not beside the checkout: {path}")
    return json.loads(path.read_text())


def test_vendor_config_is_the_full_preset():
    assert OCRConfig.from_vendor(vendor_file("config.json")) == PRESETS["full"]


def test_expected_keys_and_parameter_count_match_the_vendor_index():
    index = vendor_file("model.safetensors.index.json")
    shapes = expected_vendor_shapes(PRESETS["full"])
    assert set(shapes) == set(index["weight_map"])
    assert len(shapes) == 2710
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert total == 3_336_106_240
    assert total * 2 == index["metadata"]["total_size"]  # bf16


def test_preset_tokenizer_puts_special_tokens_at_vendor_ids():
    decoder = vendor_file("tokenizer_config.json")["added_tokens_decoder"]
    ours = vendor_added_tokens()
    assert {int(k): v["content"] for k, v in decoder.items()} == {k: c for k, (c, _) in ours.items()}
    tokenizer = OCRTokenizer.build_preset()
    assert tokenizer.encode("<image><|grounding|><|ref|>x<|/ref|><|det|>") [:3] == [128815, 128820, 128816]
    text = "\n<|grounding|>Convert the document to markdown. ünïcode ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_preset("tiny", tmp_path_factory.mktemp("tiny"), seed=3)


def test_saved_preset_uses_the_vendor_layout(tiny_dir):
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == sorted([
        "config.json", "model.safetensors.index.json", SAFETENSORS_FILE, "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json",
    ])
    tensors = load_file(str(tiny_dir / SAFETENSORS_FILE))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
    assert "model.sam_model.blocks.0.norm1.weight" in tensors
    assert "model.sam_model.net_3.weight" in tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert set(tensors) == set(expected_vendor_shapes(PRESETS["tiny"]))


def test_saved_preset_loads_with_identical_logits(tiny_dir):
    in_memory = build_preset("tiny", seed=3, device=CPU, dtype=torch.float32).model
    loaded = load_checkpoint(tiny_dir, device=CPU, dtype=torch.float32)
    assert loaded.fingerprint.startswith("sha256:")
    assert (loaded.preset, loaded.seed) == ("tiny", 3)  # still labelled as random weights
    ids = torch.tensor([[0, 128815, 128815, 201, 128820, 37, 81]])
    with torch.inference_mode():
        a = in_memory.logits(in_memory.language_model(input_ids=ids).last_hidden_state)
        b = loaded.model.logits(loaded.model.language_model(input_ids=ids).last_hidden_state)
        pixels = torch.randn(1, 3, 640, 640)
        va = in_memory.encode_views(in_memory.encode_sam(pixels))
        vb = loaded.model.encode_views(loaded.model.encode_sam(pixels))
    assert torch.equal(a, b)
    assert torch.equal(va, vb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_preset_loads_to_the_same_tensors_and_labels(tiny_dir, tmp_path, dtype):
    built = build_preset("tiny", seed=3, device=CPU, dtype=dtype)
    loaded = load_checkpoint(tiny_dir, device=CPU, dtype=dtype)
    ours, theirs = built.model.state_dict(), loaded.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == []
    assert (loaded.preset, loaded.seed) == (built.preset, built.seed) == ("tiny", 3)
    assert built.fingerprint == f"preset:tiny:seed3:{PRESET_WEIGHTS}"
    again = load_checkpoint(save_preset("tiny", tmp_path / "again", seed=3), device=CPU, dtype=dtype)
    assert again.fingerprint == loaded.fingerprint  # the same preset writes the same bytes


def test_the_same_seed_gives_the_same_weights_and_another_seed_others():
    first = build_preset("tiny", seed=0, device=CPU, dtype=torch.float32).model.state_dict()
    again = build_preset("tiny", seed=0, device=CPU, dtype=torch.float32).model.state_dict()
    other = build_preset("tiny", seed=1, device=CPU, dtype=torch.float32).model.state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)
    constant = {key for key in first if "norm" in key and first[key].dim() == 1}  # ones and zeros by design
    assert constant and all(torch.equal(first[key], other[key]) for key in constant)
    assert [key for key in first if key not in constant and torch.equal(first[key], other[key])] == []


def test_a_tensors_weights_do_not_depend_on_the_tensors_made_before_it():
    in_order = dict(preset_state(PRESETS["tiny"], seed=5))
    backwards = dict(preset_state(PRESETS["tiny"], seed=5, keys=list(reversed(in_order))))
    assert [key for key in in_order if not torch.equal(in_order[key], backwards[key])] == []
    alone = dict(preset_state(PRESETS["tiny"], seed=5, keys=["lm_head.weight", "sam.pos_embed"]))
    assert all(torch.equal(alone[key], in_order[key]) for key in alone)


def test_a_tensors_weights_do_not_depend_on_the_other_tensors_of_the_model():
    # A SAM of two blocks instead of four: every tensor after SAM in the state dict (CLIP, projector,
    # the language model) comes at another place in the sequence, and keeps its values.
    tiny = PRESETS["tiny"]
    shallow = replace(tiny, sam=replace(tiny.sam, layers=2, global_attn_indexes=(1,)))
    ours = dict(preset_state(tiny, seed=5))
    theirs = dict(preset_state(shallow, seed=5))
    assert len(theirs) < len(ours)
    shared = [key for key in theirs if key in ours and theirs[key].shape == ours[key].shape]
    assert any(key.startswith("clip.") for key in shared) and "lm_head.weight" in shared
    assert [key for key in shared if not torch.equal(ours[key], theirs[key])] == []


@pytest.mark.parametrize("device", DEVICES)
def test_preset_weights_are_pinned_and_the_same_on_every_device(device):
    """The tiny preset's bits, seed 0: a change of the recipe (or of a tensor's init scale) must change
    PRESET_WEIGHTS, which names them in every fingerprint, and then this digest."""
    digest = hashlib.sha256()
    spread = {}
    for key, tensor in preset_state(PRESETS["tiny"], seed=0, device=device):
        digest.update(key.encode())
        digest.update(tensor.cpu().view(torch.int16).numpy().tobytes())
        spread[key] = tensor.float().std().item()
    assert PRESET_WEIGHTS == "hash16-v1"
    assert digest.hexdigest()[:16] == "537784daefb88dc3"
    # Draws from the intended distributions: N(0, 1) embeddings, variance-preserving matrices.
    assert spread["language_model.embed_tokens.weight"] == pytest.approx(1.0, rel=0.01)
    assert spread["lm_head.weight"] == pytest.approx(64 ** -0.5, rel=0.01)


@pytest.mark.parametrize("device", DEVICES)
def test_the_hash_is_lowbias32_on_32_bit_words(device):
    """The weights' hash runs on int32 tensors, whose multiply and add wrap around: the same words as
    the 32-bit hash computed exactly (Python integers), at the edges of the signed range too."""

    def lowbias32(word: int) -> int:
        word ^= word >> 16
        word = word * 0x7FEB352D & 0xFFFFFFFF
        word ^= word >> 15
        word = word * 0x846CA68B & 0xFFFFFFFF
        return word ^ word >> 16

    words = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFF, 0xFFFF0000, 0x0000FFFF]
    words += [(index * 0x9E3779B1 + 12345) & 0xFFFFFFFF for index in range(4096)]
    signed = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32, device=device)
    hashed = _hash32_(signed, torch.empty_like(signed)).cpu().to(torch.int64) & 0xFFFFFFFF
    assert hashed.tolist() == [lowbias32(word) for word in words]


def _peak_cpu_bytes(run, mapped: int):
    """The most bytes torch's CPU allocations held at once while `run()` ran, from the profiler's memory
    events in time order (torch has no CPU counterpart of `torch.cuda.max_memory_allocated`), less the
    file mappings: safetensors maps a file as one CPU storage of the file's size (`mapped`), whose
    pages are the file's, shared with the page cache, not a copy."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda event: event.time_range.start):
        if event.name == "[memory]" and abs(event.self_cpu_memory_usage) == mapped:
            continue
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak, result


def test_a_checkpoint_load_holds_no_second_copy_of_the_model(tmp_path, monkeypatch):
    # Routed experts heavy enough that one more copy of them would show: stacking the experts in the
    # file's dtype and then converting them (or the whole state dict after reading it) held two.
    tiny = PRESETS["tiny"]
    monkeypatch.setitem(PRESETS, "tiny-experts",
                        replace(tiny, text=replace(tiny.text, n_routed_experts=64, moe_intermediate_size=128)))
    directory = save_preset("tiny-experts", tmp_path / "experts", seed=1)
    mapped = (directory / SAFETENSORS_FILE).stat().st_size
    peak, loaded = _peak_cpu_bytes(lambda: load_checkpoint(directory, device=CPU, dtype=torch.float32), mapped)
    model = loaded.model
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    experts = sum(t.numel() for key, t in model.state_dict().items() if ".experts." in key)
    assert experts * 2 > 2**22  # a second bfloat16 copy of them would be over the 1 MiB slack below
    assert held <= peak <= held + 2**20


def _mapping_of(path: Path) -> list[tuple[int, int]]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [(int(low, 16), int(high, 16)) for low, high in
            (line.split()[0].split("-") for line in lines if line.endswith(str(path.resolve())))]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory map (Linux)")
def test_a_checkpoint_in_the_target_dtype_is_assigned_not_copied(tiny_dir):
    loaded = load_checkpoint(tiny_dir, device=CPU, dtype=torch.bfloat16)
    ranges = _mapping_of(tiny_dir / SAFETENSORS_FILE)
    assert ranges, "the safetensors file is not mapped"

    def in_file(tensor: torch.Tensor) -> bool:
        return any(low <= tensor.data_ptr() < high for low, high in ranges)

    params = dict(loaded.model.named_parameters())
    stacked = {key for key in params if ".mlp.experts." in key}  # the vendor's experts, one tensor per layer
    assert stacked and not any(in_file(params[key]) for key in stacked)
    assert [key for key in params if key not in stacked and not in_file(params[key])] == []


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_extra_and_misshaped_tensors_are_named(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path / "broken")
    tensors = load_file(str(broken / SAFETENSORS_FILE))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    tensors["model.extra_head.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    save_file(tensors, str(broken / SAFETENSORS_FILE))
    index = {"metadata": {}, "weight_map": {k: SAFETENSORS_FILE for k in tensors}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(broken, device=CPU, dtype=torch.float32)
    message = str(err.value)
    assert "1 missing tensors: model.layers.2.mlp.experts.3.up_proj.weight" in message
    assert "1 unexpected tensors: model.extra_head.weight" in message
    assert "model.norm.weight [7] (expected [64])" in message


@pytest.mark.parametrize("remove", ["config.json", "tokenizer.json", SAFETENSORS_FILE])
def test_missing_files_are_reported(tiny_dir, tmp_path, remove):
    broken = _copy(tiny_dir, tmp_path / "broken")
    (broken / remove).unlink()
    with pytest.raises(CheckpointError, match=remove.split(".")[0]):
        load_checkpoint(broken, device=CPU, dtype=torch.float32)


def test_not_a_directory_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nope", device=CPU, dtype=torch.float32)


def test_a_corrupt_safetensors_file_is_a_checkpoint_error(tiny_dir, tmp_path):
    broken = _copy(tiny_dir, tmp_path / "broken")
    (broken / SAFETENSORS_FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(broken, device=CPU, dtype=torch.float32)
