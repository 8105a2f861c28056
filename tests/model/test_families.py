"""The model family registry (model/families.py): presets and modes by family without torch, a
checkpoint's family from its config.json (every family's vendor layout as its `to_vendor` writes it,
transformers' `deepseek_ocr2` layout), anything else refused with what was found."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsocr_workers.errors import CheckpointError, InputError
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import RunRequest, prepare_run
from dsocr_workers.model.families import (
    FAMILIES,
    all_modes,
    all_presets,
    detect,
    family_of_checkpoint,
    family_of_preset,
    run_mode,
)
from dsocr_workers.stages import BY_COLUMN, STAGES

needs_ocr2 = pytest.mark.skipif(
    "deepseek-ocr2" not in FAMILIES,
    reason="needs the DeepSeek-OCR-2 family registered (model/deepseek_ocr2/, from branch wt-h46ocr2)",
)


def test_every_preset_names_its_family_and_every_family_its_encoder_stage():
    assert family_of_preset("tiny").name == family_of_preset("full").name == "deepseek-ocr"
    assert list(all_presets())[:2] == ["full", "tiny"]
    for family in FAMILIES.values():
        assert family.encoder_stage in STAGES and family.default_mode in family.modes
        assert set(family.modes) <= set(all_modes())
    assert FAMILIES["deepseek-ocr"].encoder_stage == "vision/clip"
    with pytest.raises(InputError, match="unknown preset 'huge'; presets: full, tiny"):
        family_of_preset("huge")


@needs_ocr2
def test_the_ocr2_presets_and_its_encoder_stage():
    assert family_of_preset("ocr2-tiny").name == family_of_preset("ocr2-full").name == "deepseek-ocr2"
    assert FAMILIES["deepseek-ocr2"].encoder_stage == "vision/qwen2" == BY_COLUMN["qwen2_ms"].stage


def test_the_registry_and_the_config_modules_import_no_torch():
    code = (
        "import sys; import dsocr_workers.model.families as f; f.all_presets(); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("preset", list(all_presets()))
def test_a_config_json_written_by_each_family_is_detected(preset, tmp_path):
    family = family_of_preset(preset)
    (tmp_path / "config.json").write_text(json.dumps(family.presets[preset].to_vendor()))
    assert family_of_checkpoint(tmp_path) == family
    found, layout = detect(json.loads((tmp_path / "config.json").read_text()))
    assert (found, layout) == (family, "vendor")
    assert family.config_from(json.loads((tmp_path / "config.json").read_text()), layout) == family.presets[preset]


def transformers_config() -> dict:
    from transformers import DeepseekOcr2Config

    return {**DeepseekOcr2Config().to_dict(), "architectures": ["DeepseekOcr2ForConditionalGeneration"]}


@needs_ocr2
def test_transformers_deepseek_ocr2_layout_is_ocr2():
    family, layout = detect(transformers_config())
    assert (family.name, layout) == ("deepseek-ocr2", "transformers")


@pytest.mark.parametrize(
    ("config", "found"),
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
         "found model_type 'llama', architectures ['LlamaForCausalLM']"),
        ({"hidden_size": 8}, "found neither model_type nor architectures"),
        ([1, 2], "a JSON list, not an object"),
    ],
)  # fmt: skip
def test_an_unknown_config_is_refused_naming_what_it_found(config, found, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as caught:
        family_of_checkpoint(tmp_path)
    message = str(caught.value)
    assert "describes none of the model families this farm runs (DeepSeek-OCR" in message
    assert found in message and str(tmp_path / "config.json") in message


def test_no_config_and_no_directory_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        family_of_checkpoint(tmp_path)
    with pytest.raises(InputError, match="not a checkpoint directory"):
        family_of_checkpoint(tmp_path / "missing")


def test_a_run_s_mode_is_checked_against_its_model_s_family(tmp_path):
    assert run_mode("tiny", None) == "gundam" and run_mode("tiny", "large") == "large"
    with pytest.raises(InputError, match=r"unknown mode 'huge' for DeepSeek-OCR; its modes: tiny, small, base"):
        run_mode("tiny", "huge")
    with pytest.raises(InputError, match="unknown mode 'huge'; modes: "):
        RunOptions(mode="huge")


@needs_ocr2
def test_a_v1_mode_the_ocr2_family_lacks_is_refused_naming_its_modes(tmp_path):
    ocr2 = FAMILIES["deepseek-ocr2"]
    missing = next(mode for mode in FAMILIES["deepseek-ocr"].modes if mode not in ocr2.modes)
    with pytest.raises(InputError, match=f"unknown mode '{missing}' for DeepSeek-OCR-2; its modes: "):
        run_mode("ocr2-tiny", missing)
    assert run_mode("ocr2-tiny", None) == ocr2.default_mode
    listing = tmp_path / "list.txt"
    listing.write_text("missing.png\n")
    with pytest.raises(InputError, match="for DeepSeek-OCR-2; its modes"):
        # Refused before the list is read (its missing image would be another error).
        prepare_run(RunRequest(listing, RunOptions(model="ocr2-tiny", mode=missing)), print)


@pytest.mark.parametrize("preset", ["tiny", "ocr2-tiny"])
def test_max_crops_is_capped_at_the_family_s_limit_before_the_model_loads(preset, tmp_path):
    """`dsocr infer --max-crops` above the model family's MAX_CROPS: exit 2 naming the limit, no model
    loaded, nothing written."""
    from click.testing import CliRunner

    from dsocr_workers.cli import main

    family = family_of_preset(preset)
    assert family.crops(None) == family.max_crops and family.crops(2) == 2
    image = tmp_path / "page.png"
    image.write_bytes(b"not read: the option is refused first")
    args = ["infer", str(image), "--model", preset, "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(main, [*args, "--max-crops", str(family.max_crops + 1)])
    assert result.exit_code == 2, result.output
    assert f"{family.title} cuts a page into at most {family.max_crops} tiles" in result.output
    assert not (tmp_path / "out").exists()
