"""Vendor checkpoint layout: key mapping against the real index, save-preset → load round trip, and
clear errors for broken checkpoint directories."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsocr_workers.errors import CheckpointError, InputError
from dsocr_workers.model.checkpoint import (
    SAFETENSORS_FILE,
    build_preset,
    expected_vendor_shapes,
    load_checkpoint,
    save_preset,
)
from dsocr_workers.model.config import PRESETS, OCRConfig
from dsocr_workers.model.tokenizer import OCRTokenizer, vendor_added_tokens

VENDOR_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "deepseek-ocr"
CPU = torch.device("cpu")


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
        va = in_memory.encode_clip(in_memory.encode_sam(pixels))
        vb = loaded.model.encode_clip(loaded.model.encode_sam(pixels))
    assert torch.equal(a, b)
    assert torch.equal(va, vb)


def test_different_seeds_give_different_weights():
    a = build_preset("tiny", seed=0, device=CPU, dtype=torch.float32).model
    b = build_preset("tiny", seed=1, device=CPU, dtype=torch.float32).model
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


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
