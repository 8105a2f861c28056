"""The fast engine compiles each family's view encoder block by block (`OCRModel.view_blocks`): the
blocks, run as the fast engine runs them, give the model's own `encode_views`, bit for bit, for a page's
global view and its tiles (packed together where the family's layers pack views)."""

from __future__ import annotations

import pytest
import torch

from dsocr_workers.engine.regions import RegionalVision, TorchCompiler
from dsocr_workers.model.checkpoint import build_preset
from dsocr_workers.model.families import FAMILIES

CPU = torch.device("cpu")
TINY = {"deepseek-ocr": "tiny", "deepseek-ocr2": "ocr2-tiny"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_view_blocks_equal_encode_views(family):
    preset = TINY[family]
    model = build_preset(preset, seed=2, device=CPU, dtype=torch.float32).model
    gundam = FAMILIES[family].mode("gundam")
    views = [
        torch.randn(1, 3, gundam.base_size, gundam.base_size),
        torch.randn(2, 3, gundam.image_size, gundam.image_size),
    ]
    regions = RegionalVision(model, TorchCompiler("eager"))
    with torch.inference_mode():
        sam = regions.encode_sam(views)
        assert all(torch.equal(a, model.encode_sam(v)) for a, v in zip(sam, views, strict=True))
        ours = regions.encode_views(sam)
        assert all(torch.equal(a, model.encode_views(s)) for a, s in zip(ours, sam, strict=True))
    assert model.view_blocks() is not None
