"""The eager engine: plain PyTorch, the vendor's attention (fp32 softmax) and expert dispatch. The
numerical reference the other engines are checked against; compiles nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsocr_workers.engine.generate import decode_one_token, prefill
from dsocr_workers.engine.variants.base import Engine, Runners, Vision
from dsocr_workers.model.experts import VENDOR_LOOP

if TYPE_CHECKING:
    from dsocr_workers.engine.regions import Compiler
    from dsocr_workers.model.interface import OCRModel


class EagerEngine(Engine):
    name = "eager"

    def kernels(self) -> dict[str, str]:
        return {"attn_implementation": "eager", "experts_implementation": VENDOR_LOOP}

    def runners(self, model: OCRModel, device: torch.device, compiler: Compiler | None = None) -> Runners:
        return Runners(Vision.per_group(model), prefill, decode_one_token)
