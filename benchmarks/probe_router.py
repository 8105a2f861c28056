"""The MoE router alone on one GPU (the `full` preset's shape: 1280 → 64 experts, top 6; bf16 hidden
states, the weight in bf16 as the model holds it): transformers' router (float32 GEMM, softmax, top-k)
against the fused kernel of model/router.py, each compiled as the engine compiles its step and replayed
as a CUDA graph, at a decode step's token counts and a prompt's; the experts chosen must be equal and
the weights within float32 rounding; each one's kernels under torch.profiler. Then a sweep of the fused
kernel's blocks (tokens per program 16/32, hidden inputs per loop step 64/128/256, 2/4 warps).

    python benchmarks/probe_router.py --tokens 1,128,256,960 > $OUT/router.txt

CUDA events around a CUDA graph's replay, median of 50 after 5; microseconds per call.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2TextTopkRouter  # noqa: E402

from benchmarks.probe_grouped_experts import graph_us  # noqa: E402
from dsocr_workers.model.decoder import text_config  # noqa: E402
from dsocr_workers.model.deepseek_ocr.config import PRESETS  # noqa: E402
from dsocr_workers.model.router import FusedRouter, RouteBlocks, launch_route  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,128,256,960", help="token counts, comma-separated")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = text_config(PRESETS["full"].text, "sdpa", "eager")
    reference = DeepseekOcr2TextTopkRouter(config).to(device)
    with torch.no_grad():
        reference.weight.normal_(0, config.hidden_size**-0.5)
    reference = reference.to(torch.bfloat16)
    fused = FusedRouter(reference)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {config.hidden_size} -> "
          f"{config.n_routed_experts} experts, top {config.num_experts_per_tok}", flush=True)
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
            runs = {
                "transformers' router, compiled": torch.compile(lambda: reference(x)[1:]),  # noqa: B023
                "fused router, compiled": torch.compile(lambda: fused(x)[1:]),  # noqa: B023
            }
            outputs = {}
            print(f"\n== {tokens} tokens", flush=True)
            for name, run in runs.items():
                us, out, graph = graph_us(lambda: torch.cat([out.float() for out in run()], 1), iters=50)  # noqa: B023
                outputs[name] = out.clone()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graph.replay()
                    torch.cuda.synchronize()
                kernels = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
                print(f"{name}: {us:.1f} us; kernels: " + ", ".join(f"{k[:40]} {t:.1f}" for k, t in kernels),
                      flush=True)
            (ref_w, ref_i), (got_w, got_i) = (out.split(config.num_experts_per_tok, 1) for out in outputs.values())
            ref_i, order = ref_i.sort(1)
            same = torch.equal(ref_i, got_i)
            print(f"experts equal: {same}; max|weight diff| {(ref_w.gather(1, order) - got_w).abs().max().item():.3g}",
                  flush=True)
            print("sweep: tokens per program, k, warps", flush=True)
            for block_tokens, k, warps in itertools.product((16, 32), (64, 128, 256), (2, 4)):
                blocks = RouteBlocks(block_tokens, k, warps)
                try:
                    us, out, _ = graph_us(lambda: torch.cat([o.float() for o in launch_route(  # noqa: B023
                        x, reference.weight, config.num_experts_per_tok, fused.routed_scaling_factor, blocks)], 1),  # noqa: B023
                        iters=50)
                except Exception as exc:  # a configuration past the registers, say
                    print(f"{block_tokens} {k} {warps}: failed ({type(exc).__name__})", flush=True)
                    continue
                print(f"{block_tokens} {k} {warps}: {us:.1f} us, same: {torch.equal(out, outputs['fused router, compiled'])}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
