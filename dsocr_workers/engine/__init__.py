"""Split prefill/decode inference with stage timings. Knows nothing of Celery or SQL.

The public API is re-exported here; the session (torch, transformers) loads on first use, so code that
only needs the result types (the farm's parent process, reports) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsocr_workers.engine.result import DecodeOptions, InferenceResult, ModelSource

if TYPE_CHECKING:
    from dsocr_workers.engine.session import DeepSeekOCRSession

__all__ = ["DecodeOptions", "DeepSeekOCRSession", "InferenceResult", "ModelSource"]


def __getattr__(name: str) -> Any:
    if name == "DeepSeekOCRSession":
        from dsocr_workers.engine.session import DeepSeekOCRSession

        return DeepSeekOCRSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
