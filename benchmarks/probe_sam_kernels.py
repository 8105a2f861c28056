"""SAM's kernels alone on one GPU (bf16, the `full` preset's SAM, random weights): what the fast engine's
SAM changes rest on.

1. The patch embedding (16×16 convolution at stride 16), the neck and the compressor convolutions, eager,
   with `cudnn.benchmark` off and on, for a 1024-px view and six 640-px tiles.
2. The attention shapes of the folded relative positions (model/sam_attention.py): query and key at
   64 + H + W channels, the value padded to the same or kept at 64, per SDPA backend; the largest error
   against a float32 reference for the value at 64.

    python benchmarks/probe_sam_kernels.py > $OUT/sam-kernels.txt

CUDA events around 20 calls after 3 warm-up calls; milliseconds per call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsocr_workers.model.config import PRESETS  # noqa: E402
from dsocr_workers.model.vision import build_sam  # noqa: E402

BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
# (name, batch, tokens, query/key head dim) as the full preset's SAM meets them on a gundam page.
ATTENTION_SHAPES = (
    ("global block, 1024-px view", 1, 4096, 192),
    ("global block, six 640-px tiles", 6, 1600, 144),
    ("window blocks, 1024-px view", 25, 196, 96),
    ("window blocks, six 640-px tiles", 54, 196, 96),
)


def cuda_ms(run: Callable[..., object], *args: object, iters: int = 20) -> float:
    for _ in range(3):
        run(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def unit_scale_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The folded attention's call: the softmax scale is already in the query."""
    return F.scaled_dot_product_attention(query, key, value, scale=1.0)


def convolutions() -> None:
    sam = build_sam(PRESETS["full"].sam).to("cuda", torch.bfloat16).eval()
    views = {"1024-px view": torch.randn(1, 3, 1024, 1024, device="cuda", dtype=torch.bfloat16),
             "six 640-px tiles": torch.randn(6, 3, 640, 640, device="cuda", dtype=torch.bfloat16)}  # fmt: skip
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        for name, pixels in views.items():
            patches = sam.patch_embed(pixels)
            neck = sam.neck(patches)
            print(f"cudnn.benchmark={benchmark} {name}: patch embedding {cuda_ms(sam.patch_embed, pixels):.3f} ms, "
                  f"neck {cuda_ms(sam.neck, patches):.3f}, compressor {cuda_ms(sam.proj, neck):.3f}",
                  flush=True)  # fmt: skip
    torch.backends.cudnn.benchmark = False


def attention() -> None:
    for name, batch, tokens, channels in ATTENTION_SHAPES:
        query = torch.randn(batch, 12, tokens, channels, device="cuda", dtype=torch.bfloat16)
        key = torch.randn_like(query)
        values = {"value padded": torch.randn_like(query),
                  "value at 64": torch.randn(batch, 12, tokens, 64, device="cuda", dtype=torch.bfloat16)}  # fmt: skip
        reference = unit_scale_attention(query.float(), key.float(), values["value at 64"].float())
        for backend in BACKENDS:
            for label, value in values.items():
                try:
                    with sdpa_kernel([backend]):
                        ms = cuda_ms(unit_scale_attention, query, key, value)
                        out = unit_scale_attention(query, key, value)
                except RuntimeError as exc:
                    print(f"{name}, {backend.name}, {label}: not available ({str(exc).splitlines()[0][:80]})")
                    continue
                error = f", max |error| {(out.float() - reference).abs().max().item():.3g}" if out.shape[-1] == 64 else ""
                print(f"{name}, {backend.name}, {label}: {ms:.3f} ms{error}", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, RANDOM WEIGHTS (full preset's SAM), bf16")
    with torch.inference_mode():
        convolutions()
        attention()
    return 0


if __name__ == "__main__":
    sys.exit(main())
