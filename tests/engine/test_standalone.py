"""The engine outside the farm (engine/standalone.py) and result.json (engine/result.py), called directly;
tests/engine/test_cli_model.py runs them through `dsocr infer` and `dsocr verify`."""

import json

import pytest
from PIL import Image

from dsocr_workers.engine.result import (
    DecodeOptions,
    InferenceResult,
    ModelSource,
    StageTimings,
    result_document,
)
from dsocr_workers.engine.standalone import DEMO_PAGE_SIZE, InferPage, check_page, demo_page, verify_page
from dsocr_workers.errors import InputError


def result_with_steps(steps_ms: list[float]) -> InferenceResult:
    timings = StageTimings(
        clock="perf_counter", preprocess_ms=1.0, prefill_ms=4.0, vision_ms=3.0, sam_ms=1.0, clip_ms=1.0,
        projector_ms=1.0, lm_prefill_ms=1.0, decode_ms=sum(steps_ms), decode_step_ms=steps_ms,
    )  # fmt: skip
    return InferenceResult(
        text="", token_ids=list(range(len(steps_ms) + 1)), stop_reason="max_new_tokens", prompt_tokens=9,
        image_tokens=4, crop_grid=(1, 1), mode="tiny", image_size=(64, 64), timings=timings, boxes=[],
        skipped_spans=0, memory=None, engine="eager", device="cpu", dtype="float32",
        model=ModelSource("preset", "tiny", random_weights=True, seed=3),
    )  # fmt: skip


def test_result_document_adds_decode_statistics_and_the_files():
    document = result_document(result_with_steps([2.0, 4.0, 6.0, 8.0]), ["b.txt", "result.json"])
    json.dumps(document)  # result.json holds nothing JSON cannot write
    assert document["files"] == ["b.txt", "result.json"]
    assert document["model_label"] == "preset:tiny (RANDOM WEIGHTS, seed 3)"
    assert document["decode_tokens"] == 5  # the first token comes from the prefill logits: 4 steps, 5 tokens
    assert document["tokens_per_s"] == pytest.approx(1e3 * 4 / 20.0)
    assert document["decode_ms_per_token"]["p50"] == pytest.approx(5.0)
    assert document["timings"]["decode_step_ms"] == [2.0, 4.0, 6.0, 8.0]


def test_result_document_without_decode_steps_has_no_rate():
    document = result_document(result_with_steps([]), [])
    assert document["tokens_per_s"] is None
    assert document["decode_ms_per_token"] == {"p50": None, "p90": None, "p99": None}


def test_check_page_refuses_options_and_prompt_before_it_reads_the_image(tmp_path):
    missing = tmp_path / "missing.png"
    with pytest.raises(InputError, match="top_p"):
        check_page(InferPage(missing, tmp_path, decode=DecodeOptions(temperature=1.0, top_p=0.0)))
    with pytest.raises(InputError, match="<image>"):
        check_page(InferPage(missing, tmp_path, prompt="no placeholder"))
    with pytest.raises(InputError, match="no such file"):
        check_page(InferPage(missing, tmp_path, prompt="ocr"))
    page = tmp_path / "page.png"
    Image.new("RGBA", (40, 30)).save(page)
    original = check_page(InferPage(page, tmp_path))
    assert original.size == (40, 30) and original.mode == "RGB"


def test_verify_page_is_the_given_image_or_the_synthetic_page(tmp_path):
    page = tmp_path / "page.png"
    Image.new("RGB", (50, 20), "white").save(page)
    assert verify_page(page).size == (50, 20)
    synthetic = verify_page(None)
    assert synthetic.size == DEMO_PAGE_SIZE
    assert synthetic.tobytes() == demo_page().tobytes()  # deterministic: verify's runs are comparable
    assert len(synthetic.getcolors(maxcolors=2**16) or []) > 2  # text, table and figure, not a blank page
