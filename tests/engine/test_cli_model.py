import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from dsocr_workers.cli import commands_model, main
from dsocr_workers.engine.standalone import demo_page
from dsocr_workers.model import preprocess


def test_literal_choices_match_the_model_package():
    # The CLI keeps the prompt names literal so that `dsocr --help` imports no torch.
    assert tuple(preprocess.PROMPTS) == commands_model.PROMPT_NAMES


def test_farm_entry_points_import_no_torch():
    # A worker's parent, `dsocr reconcile` and `dsocr --help` start fast and never touch CUDA.
    code = "import sys, dsocr_workers.farm.celery.tasks, dsocr_workers.cli; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


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
    bad_ids = runner.invoke(main, ["infer", str(page), "--ngram-whitelist", "td,/td"])
    assert bad_ids.exit_code == 2 and "token ids" in bad_ids.output


def write_page(path: Path, size: tuple[int, int]) -> Path:
    page = demo_page().resize(size)
    page.save(path)
    return path


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    # 1000x800 in gundam mode: a 2x2 tile grid, 693 image tokens (the size table).
    return write_page(tmp_path_factory.mktemp("pages") / "page.png", (1000, 800))


def test_infer_json_result_and_outputs(page, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["infer", str(page), "--model", "tiny", "--device", "cpu", "--max-new-tokens", "5",
               "--ignore-eos", "--out", str(out), "--json"],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document == json.loads((out / "result.json").read_text())
    assert document["crop_grid"] == [2, 2]
    assert document["image_tokens"] == 693
    assert document["prompt_tokens"] > document["image_tokens"]
    assert document["decode_tokens"] == 5 and len(document["token_ids"]) == 5
    assert document["stop_reason"] == "max_new_tokens"
    assert document["model"]["random_weights"] is True
    assert "RANDOM WEIGHTS" in document["model_label"]
    timings = document["timings"]
    assert timings["clock"] == "perf_counter"
    assert 0 < timings["vision_ms"] <= timings["prefill_ms"]
    assert len(timings["decode_step_ms"]) == 4  # the first token comes from the prefill logits
    assert document["decode_ms_per_token"]["p50"] > 0
    for name in ("markup.txt", "boxes.json", "result.mmd", "result_with_boxes.jpg", "result.json"):
        assert (out / name).is_file(), name
        assert name in document["files"]
    assert (out / "markup.txt").read_text(encoding="utf-8") == document["text"]
    assert json.loads((out / "boxes.json").read_text()) == document["boxes"]


def test_infer_table_labels_random_weights(page, tmp_path):
    result = CliRunner().invoke(
        main, ["infer", str(page), "--device", "cpu", "--mode", "tiny", "--max-new-tokens", "3",
               "--prompt-name", "free", "--out", str(tmp_path / "o")],
    )
    assert result.exit_code == 0, result.output
    assert "RANDOM WEIGHTS" in result.output
    for stage in ("preprocess", "vision/sam", "vision/clip", "vision/projector", "lm_prefill", "TTFT"):
        assert stage in result.output
    document = json.loads((tmp_path / "o" / "result.json").read_text())
    assert document["mode"] == "tiny" and document["crop_grid"] == [1, 1] and document["image_tokens"] == 73


def test_infer_prompt_without_image_is_an_input_error(page, tmp_path):
    result = CliRunner().invoke(
        main, ["infer", str(page), "--device", "cpu", "--prompt", "no placeholder", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "<image>" in result.output
    assert not (tmp_path / "o").exists()


def test_verify_passes_on_the_tiny_preset(tmp_path):
    small = write_page(tmp_path / "small.png", (600, 500))  # ≤ 640 on both sides: no tiles, fast on a CPU
    result = CliRunner().invoke(
        main, ["verify", "--model", "tiny", "--device", "cpu", "--image", str(small), "--max-new-tokens", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.output
    assert result.output.count("PASS") >= 3
    assert "RANDOM WEIGHTS" in result.output
