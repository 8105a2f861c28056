"""The vendor-loop experts dispatch equals transformers' own implementations (float32, CPU)."""

import pytest
import torch

from dsocr_workers.model.checkpoint import build_preset
from dsocr_workers.model.experts import VENDOR_LOOP


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_vendor_loop_matches_transformers_dispatch(tokens):
    model = build_preset("tiny", device=torch.device("cpu"), dtype=torch.float32,
                         experts_implementation=VENDOR_LOOP).model
    moe = model.language_model.layers[1].mlp
    config = model.language_model.config
    hidden = torch.randn(1, tokens, config.hidden_size)
    outputs = {}
    with torch.inference_mode():
        for implementation in (VENDOR_LOOP, "eager", "grouped_mm"):
            config._experts_implementation = implementation
            outputs[implementation] = moe(hidden)
    torch.testing.assert_close(outputs[VENDOR_LOOP], outputs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[VENDOR_LOOP], outputs["grouped_mm"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outputs[VENDOR_LOOP], moe.shared_experts(hidden))  # the routed part is non-zero
