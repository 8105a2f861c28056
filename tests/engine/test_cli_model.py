import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from dsocr_workers.cli import commands_model, main
from dsocr_workers.model import preprocess
from dsocr_workers.model.config import PRESETS


def test_literal_choices_match_the_model_package():
    # The CLI keeps these literal so that `dsocr --help` imports no torch.
    assert tuple(preprocess.MODES) == commands_model.MODE_NAMES
    assert tuple(preprocess.PROMPTS) == commands_model.PROMPT_NAMES
    assert set(commands_model.PRESET_NAMES) == set(PRESETS)


def test_save_preset_writes_a_vendor_layout_checkpoint(tmp_path):
    result = CliRunner().invoke(main, ["model", "save-preset", "tiny", str(tmp_path / "tiny"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "RANDOM WEIGHTS" in result.output
    files = {p.name for p in (tmp_path / "tiny").iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= files
    index = json.loads((tmp_path / "tiny" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) <= files


def test_save_preset_rejects_an_unknown_preset(tmp_path):
    result = CliRunner().invoke(main, ["model", "save-preset", "huge", str(tmp_path)])
    assert result.exit_code == 2
    assert "huge" in result.output


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "empty"), (b"not an image at all", "image")],
)
def test_infer_bad_image_is_an_input_error(tmp_path, content, message):
    bad = tmp_path / "page.png"
    bad.write_bytes(content)
    result = CliRunner().invoke(main, ["infer", str(bad), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert message in result.output.lower()
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_infer_missing_image_and_option_conflicts(tmp_path):
    runner = CliRunner()
    assert runner.invoke(main, ["infer", str(tmp_path / "nope.png")]).exit_code == 2
    page = tmp_path / "page.png"
    Image.new("RGB", (64, 64), "white").save(page)
    conflict = runner.invoke(main, ["infer", str(page), "--prompt", "<image>\nhi", "--prompt-name", "ocr"])
    assert conflict.exit_code == 2 and "not both" in conflict.output
    bad_p = runner.invoke(main, ["infer", str(page), "--temperature", "1", "--top-p", "0"])
    assert bad_p.exit_code == 2 and "top_p" in bad_p.output


def write_page(path: Path, size: tuple[int, int]) -> Path:
    page = commands_model.demo_page().resize(size)
    page.save(path)
    return path
