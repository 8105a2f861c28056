"""The batched decode step's attention alone on one GPU: the filled attention (engine/batched/slots.py
`FilledSlotsCache`: FlexAttention's decoding kernel over each slot's filled KV blocks, the step's KV
write included) at the `full` preset's shape (10 heads of 128, bf16), `--slots` slots of `--capacity`
positions, one layer's call compiled as the engine compiles its step and run as a CUDA graph.

Two length profiles from one graph: waves (every slot at `--mean` positions, as pages that start
together) and staggered (spread evenly over mean ± `--spread`, as pages joining one a step; the longest
page's length is what staggering adds). Swept: the kernel's options (KV splits `--splits`, KV tile
BLOCK_N, warps, pipeline stages) beside FlexAttention's own choice and the engine's
(`filled_kernel_options`). Each row: µs per call (median of 50 replays, CUDA events), the KV read over
it (the filled positions' keys and values) in TB/s and as a share of `--peak-tbps`, and the largest
difference from the own choice's output. Markdown to stdout:

    python3 benchmarks/probe_flex_decoding.py > $OUT/flex-decoding.md

`--device cpu --slots 4 --capacity 512 --mean 300 --spread 100 --block-n 32 --warps 4 --stages 1`
smoke-tests it (no graphs there: the host clock around a synchronous call).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch.nn.attention.flex_attention import FlexKernelOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.probe_grouped_experts import graph_us  # noqa: E402
from dsocr_workers.engine.batched.slots import FilledSlotsCache, filled_kernel_options  # noqa: E402
from dsocr_workers.model.deepseek_ocr.config import PRESETS  # noqa: E402


def attend(
    keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, visible: torch.Tensor,
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: FlexKernelOptions | None,
) -> torch.Tensor:
    """One layer of the step's filled attention, as `decode_slots` calls it (here every slot is in the
    bucket: `length`, the bucket's lengths, is `visible`, every slot's)."""
    cache = FilledSlotsCache([keys], [values], length, visible, options)
    return cache.update_and_attend(query, key, value, 0, query.shape[-1] ** -0.5)


def timed_us(run: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    """Median µs of `run` (on a GPU a CUDA graph's replay: probe_grouped_experts' timing) and its output."""
    if device.type == "cuda":
        us, out, _ = graph_us(run, iters=50)
        return us, out
    run()
    times = []
    for _ in range(5):
        began = time.perf_counter()
        out = run()
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=2432, help="positions a slot (a multiple of 128)")
    parser.add_argument("--mean", type=int, default=1460, help="mean filled positions a slot")
    parser.add_argument("--spread", type=int, default=340, help="staggered lengths over mean ± spread")
    parser.add_argument("--splits", default="2", help="SPLIT_KV values to sweep")
    parser.add_argument("--block-n", default="32,64,128", help="KV tiles (BLOCK_N) to sweep")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="the GPU's memory bandwidth (H200: 4.8)")
    args = parser.parse_args()
    device = torch.device(args.device)
    text = PRESETS["full"].text
    heads, head_dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    slots, capacity = args.slots, args.capacity
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = [torch.randn(slots, heads, capacity, head_dim, device=device, dtype=dtype) for _ in range(2)]
    query, key, value = (torch.randn(slots, heads, 1, head_dim, device=device, dtype=dtype) for _ in range(3))
    staggered = torch.linspace(args.mean - args.spread, args.mean + args.spread, slots).round().long()
    profiles = {
        "waves": torch.full((slots,), args.mean, dtype=torch.long),
        "staggered": staggered[torch.randperm(slots)],
    }
    length = torch.empty(slots, dtype=torch.long, device=device)  # the graph's inputs, refilled per profile
    bytes_read = {name: int(lengths.sum()) * heads * head_dim * 2 * cache[0].element_size() for name, lengths in profiles.items()}

    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    engine = filled_kernel_options(slots * heads, gpu.multi_processor_count, (gpu.major, gpu.minor)) if gpu else None
    configs: list[tuple[str, FlexKernelOptions | None]] = [("FlexAttention's own choice", None), (f"the engine's {engine}", engine)]
    for splits, block_n, warps, stages in itertools.product(
        *(map(int, values.split(",")) for values in (args.splits, args.block_n, args.warps, args.stages))
    ):
        options = {"SPLIT_KV": splits, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        configs.append((f"{splits} {block_n} {warps} {stages}", cast(FlexKernelOptions, options)))

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# The filled attention alone ({where}, torch {torch.__version__}, {dtype})\n")
    print(f"`python3 benchmarks/probe_flex_decoding.py {' '.join(sys.argv[1:])}`\n")
    print(f"{slots} slots × {capacity} positions, {heads} heads of {head_dim}; waves: every slot at {args.mean}; "
          f"staggered: {int(staggered.min())}–{int(staggered.max())}, mean {float(staggered.float().mean()):.0f}. "
          f"KV read a call: waves {bytes_read['waves'] / 1e6:.1f} MB, staggered {bytes_read['staggered'] / 1e6:.1f} MB. "
          f"Options: SPLIT_KV BLOCK_N num_warps num_stages.\n")
    print("| options | waves µs | waves TB/s | of peak | staggered µs | staggered TB/s | of peak | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    reference: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for name, options in configs:
            torch._dynamo.reset()
            step = torch.compile(attend, fullgraph=True)
            row: dict[str, Any] = {}
            try:
                for profile, lengths in profiles.items():
                    length.copy_(lengths)
                    keys, values = (c.clone() for c in cache)

                    def run(keys: torch.Tensor = keys, values: torch.Tensor = values,
                            options: FlexKernelOptions | None = options,
                            step: Callable[..., torch.Tensor] = step) -> torch.Tensor:
                        return step(keys, values, length, length, query, key, value, options)

                    us, out = timed_us(run, device)
                    reference.setdefault(profile, out.clone())
                    row[profile] = (us, (out.float() - reference[profile].float()).abs().max().item())
            except Exception as exc:  # a configuration past the shared memory, say
                print(f"| {name} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} |||||||", flush=True)
                continue
            cells = []
            for profile in profiles:
                us = row[profile][0]
                tbps = bytes_read[profile] / (us * 1e-6) / 1e12
                cells += [f"{us:.1f}", f"{tbps:.2f}", f"{tbps / args.peak_tbps:.0%}"]
            diff = max(row[profile][1] for profile in profiles)
            print(f"| {name} | " + " | ".join(cells) + f" | {diff:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
