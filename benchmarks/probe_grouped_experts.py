"""The routed experts alone on one GPU (bf16, the `full` preset's MoE shape: 64 experts, top 6,
1280 → 896; random weights and a random router) for `--tokens` rows: a prompt's (960: the 2x3 page) or
a batched decode step's (its pages, 128 at concurrency 128): the grouped GEMM kernels of
model/grouped_experts.py against transformers' `grouped_mm` experts, which the fast engine ran before.

1. A sweep of the kernels' block configurations (pairs per block `--ms`; output columns 64/128 per
   kernel; inputs per step 64/128; 2–4 pipeline stages; `--warps`), each run as a CUDA graph, with its
   largest difference from `grouped_mm`'s output: 24 configurations per block size and warp count, each
   a Triton compile of both kernels.
2. The routing's order of the pairs by expert (`expert_blocks`: a counting sort, one-hot prefix sums)
   against a stable argsort (a radix sort on the GPU), alone, each compiled as the engine compiles its
   regions and run as a CUDA graph; the two orders must be equal.
3. The kernels with their blocks for this pair count (`blocks_for`) and `grouped_mm`, eager and
   compiled (as the engine's prefill runs them), each with its kernels under torch.profiler.

    python benchmarks/probe_grouped_experts.py --tokens 960 > $OUT/grouped-experts.txt
    python benchmarks/probe_grouped_experts.py --tokens 128 --ms 16,32,64 --warps 4 > $OUT/grouped-experts-decode.txt
    python benchmarks/probe_grouped_experts.py --tokens 640 --shipped  # 1. over the engine's blocks only

CUDA events around a CUDA graph's replay, median of 30 after 5; microseconds per forward.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: E402

from dsocr_workers.engine.regions import capture_graph  # noqa: E402
from dsocr_workers.model.deepseek_ocr.config import PRESETS  # noqa: E402
from dsocr_workers.model.grouped_experts import (  # noqa: E402
    GROUPED_BLOCKS,
    GroupedBlocks,
    KernelBlocks,
    blocks_for,
    expert_blocks,
    launch_grouped_experts,
)


class TransformersExperts:
    """What `grouped_mm_experts_forward` reads of transformers' experts module."""

    has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = True, False, False, False, False

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        self.num_experts = gate_up_proj.shape[0]
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def graph_us(run: Callable[[], torch.Tensor], iters: int = 30) -> tuple[float, torch.Tensor, torch.cuda.CUDAGraph]:
    graph, (out,) = capture_graph(lambda: [run()], torch.cuda.graph_pool_handle())
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times), out, graph


def argsort_order(flat: torch.Tensor) -> torch.Tensor:
    """The pairs' stable order by expert by a sort (expert ids as int16: two radix passes)."""
    return torch.argsort(flat.to(torch.int16), stable=True).to(torch.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=960,
                        help="rows: prompt tokens (the 2x3 page pads to 960) or a decode step's pages")
    parser.add_argument("--ms", default="128", help="pairs per block to sweep, e.g. 16,32,64,128")
    parser.add_argument("--warps", default="8", help="warps per program to sweep, e.g. 4,8")
    parser.add_argument("--shipped", action="store_true",
                        help="section 1 over the engine's blocks (GROUPED_BLOCKS, whichever `blocks_for` picks "
                             "at this pair count) in place of the sweep, and nothing else")
    args = parser.parse_args()
    ms, warps_list = [int(m) for m in args.ms.split(",")], [int(w) for w in args.warps.split(",")]
    text = PRESETS["full"].text
    experts, hidden, inter, top_k = text.n_routed_experts, text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    x = torch.randn(args.tokens, hidden, device=device, dtype=dtype)
    weights, index = torch.topk(torch.randn(args.tokens, experts, device=device).softmax(-1), top_k)
    module = TransformersExperts(gate_up, down)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens, {experts} experts, "
          f"top {top_k}, {hidden} -> {inter}", flush=True)
    with torch.inference_mode():
        reference_us, reference, _ = graph_us(lambda: grouped_mm_experts_forward(module, x, index.to(torch.int16), weights))
        print(f"grouped_mm (expert ids int16): {reference_us:.1f} us", flush=True)
        print("\n== 1. sweep: m, gate_up n, down n, k, warps, stages", flush=True)
        sweep = itertools.product(ms, (64, 128), (64, 128), (64, 128), warps_list, (2, 3, 4))
        configs = [
            KernelBlocks(GroupedBlocks(m, gate_n, k, warps, stages), GroupedBlocks(m, down_n, k, warps, stages))
            for m, gate_n, down_n, k, warps, stages in sweep
        ]
        chosen = blocks_for(args.tokens * top_k, experts)
        for blocks in GROUPED_BLOCKS if args.shipped else configs:
            gate, down_blocks = blocks.gate_up, blocks.down
            name = f"{gate.m} {gate.n} {down_blocks.n} {gate.k} {gate.warps} {gate.stages}"
            name += " (blocks_for's)" if blocks == chosen else ""
            try:
                us, out, _ = graph_us(lambda: launch_grouped_experts(x, gate_up, down, index, weights, blocks))  # noqa: B023
            except Exception as exc:  # a configuration past the shared memory, say
                print(f"{name}: failed ({type(exc).__name__})", flush=True)
                continue
            error = (out.float() - reference.float()).abs().max().item()
            print(f"{name}: {us:.1f} us, max|diff| {error:.3g}", flush=True)
        if args.shipped:
            return 0
        print("\n== 2. the pairs' order by expert: a counting sort against argsort, compiled", flush=True)
        counted_order = torch.compile(lambda: expert_blocks(index, experts, ms[0])[0])
        sorted_order = torch.compile(lambda: argsort_order(index.reshape(-1)))
        for name, run in (("counting sort (expert_blocks)", counted_order), ("argsort", sorted_order)):
            us, out, _ = graph_us(run)
            print(f"{name}: {us:.1f} us", flush=True)
        equal = torch.equal(sorted_order(), counted_order())
        print(f"orders equal: {equal}", flush=True)
        print("\n== 3. the blocks for this pair count and grouped_mm, eager and compiled", flush=True)
        runs = {
            "grouped kernels": lambda: launch_grouped_experts(x, gate_up, down, index, weights),
            "grouped_mm": lambda: grouped_mm_experts_forward(module, x, index.to(torch.int16), weights),
        }
        for name, run in list(runs.items()):
            runs[f"{name}, compiled"] = torch.compile(run)
        for name, run in runs.items():
            us, _, graph = graph_us(run)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            print(f"-- {name}: {us:.1f} us\n" + prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=80), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
