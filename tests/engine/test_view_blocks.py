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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the attention kernels SDPA picks on a GPU")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_view_blocks_attend_without_cudnn(family):
    """The view encoders run flash (or memory-efficient) attention, compiled as the fast engine compiles
    them: cuDNN's attention plans a new shape at its first calls, which makes a page's first views slow."""
    cuda = torch.device("cuda")
    model = build_preset(TINY[family], seed=2, device=cuda, dtype=torch.bfloat16).model
    gundam = FAMILIES[family].mode("gundam")
    views = [
        torch.randn(1, 3, gundam.base_size, gundam.base_size, device=cuda, dtype=torch.bfloat16),
        torch.randn(2, 3, gundam.image_size, gundam.image_size, device=cuda, dtype=torch.bfloat16),
    ]
    regions = RegionalVision(model, TorchCompiler("inductor"))
    with torch.inference_mode():
        sam = regions.encode_sam(views)
        regions.encode_views(sam)  # compiled here
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            regions.encode_views(sam)
            torch.cuda.synchronize()
    kernels = {event.key for event in profile.key_averages()}
    assert not [name for name in kernels if "cudnn" in name.lower()], sorted(kernels)
    assert [name for name in kernels if "flash" in name or "fmha" in name], sorted(kernels)
