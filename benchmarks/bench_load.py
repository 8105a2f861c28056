"""The model load: a preset built in memory against the same weights loaded from a
checkpoint, side by side in one process on one device.

  1. `save_preset` writes the preset (random weights, seed 0) as a vendor-layout checkpoint into a
     scratch directory (timed once; the file stays in the page cache, as a worker's host has it).
  2. One untimed round of each (CUDA context, kernels loaded, allocator warm), then --repeats rounds,
     the order alternating: `build_preset` and `load_checkpoint`, each timed on the host's wall clock
     between two `torch.cuda.synchronize()` calls, with the peak device memory it allocated (CUDA) over
     the bytes of the model it returned: 1.0 is a load that never held a second copy.
  3. The last round's two models compared tensor by tensor (`identical`), and the preset's tensors made
     on the CPU against those made on the device (`same_on_cpu`: every tensor of `tiny`, a sample of
     `full` up to --cpu-elements), the recipe's claim that a seed gives the same bits everywhere.

Prints one JSON document (and writes it to --out when given): medians and every round, in seconds.

    python3 benchmarks/bench_load.py                                   # full on the GPU, bf16
    python3 benchmarks/bench_load.py --model tiny --device cpu         # a CPU check, float32
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment, sync  # noqa: E402
from dsocr_workers.model.checkpoint import (  # noqa: E402
    PRESET_WEIGHTS,
    LoadedModel,
    build_preset,
    load_checkpoint,
    preset_state,
    save_preset,
)
from dsocr_workers.model.deepseek_ocr.config import PRESETS  # noqa: E402

SEED = 0


def model_bytes(loaded: LoadedModel) -> int:
    return sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers()))


def timed(make: Callable[[], LoadedModel], device: torch.device) -> tuple[LoadedModel, dict[str, Any]]:
    """`make()`'s wall seconds between two synchronizations and, on CUDA, its peak allocation over the
    model's bytes."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    sync()
    start = time.perf_counter()
    loaded = make()
    sync()
    row: dict[str, Any] = {"s": time.perf_counter() - start}
    if device.type == "cuda":
        row["peak_over_model"] = (torch.cuda.max_memory_allocated(device) - before) / model_bytes(loaded)
    return loaded, row


def same_on_cpu(name: str, built: LoadedModel, budget: int) -> dict[str, Any]:
    """The preset's tensors made again on the CPU against the device's, as many as `budget` elements
    allow, smallest first after the largest (one of each size class is worth more than many alike)."""
    state = built.model.state_dict()
    by_size = sorted(state, key=lambda key: state[key].numel())
    chosen: list[str] = []
    total = 0
    for key in [by_size[-1], *by_size[:-1]]:
        if total + state[key].numel() > budget:
            continue
        chosen.append(key)
        total += state[key].numel()
    cpu = dict(preset_state(PRESETS[name], SEED, dtype=state[chosen[0]].dtype, keys=chosen))
    differ = [key for key in chosen if not torch.equal(cpu[key], state[key].cpu())]
    return {"tensors": len(chosen), "of": len(state), "elements": total, "equal": not differ, "differ": differ[:10]}


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="full" if cuda else "tiny")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16" if cuda else "float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-elements", type=int, default=400_000_000,
                        help="elements of the preset made again on the CPU to compare (0: none)")
    parser.add_argument("--scratch", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # as a session resolves it (set_device wants an index)
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    scratch = Path(tempfile.mkdtemp(prefix="bench-load-", dir=args.scratch))
    try:
        start = time.perf_counter()
        directory = save_preset(args.model, scratch / args.model, seed=SEED, device=device)
        save_s = time.perf_counter() - start

        def preset() -> LoadedModel:
            return build_preset(args.model, seed=SEED, device=device, dtype=dtype)

        def checkpoint() -> LoadedModel:
            return load_checkpoint(directory, device=device, dtype=dtype)

        makers = {"preset": preset, "checkpoint": checkpoint}
        first = {name: timed(make, device)[1] for name, make in makers.items()}
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
        last: dict[str, LoadedModel] = {}
        for index in range(args.repeats):
            order = list(makers) if index % 2 == 0 else list(reversed(makers))
            for name in order:
                last.pop(name, None)  # the previous round's model goes before this one is made
                last[name], row = timed(makers[name], device)
                rounds[name].append(row)
        built, loaded = last["preset"], last["checkpoint"]
        ours, theirs = built.model.state_dict(), loaded.model.state_dict()
        identical = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        report: dict[str, Any] = {
            "environment": environment(),
            "model": args.model, "seed": SEED, "device": str(device), "dtype": args.dtype,
            "preset_weights": PRESET_WEIGHTS, "preset_fingerprint": built.fingerprint,
            "checkpoint_fingerprint": loaded.fingerprint,
            "checkpoint_bytes": sum(p.stat().st_size for p in directory.glob("*.safetensors")),
            "model_bytes": model_bytes(built),
            "save_preset_s": save_s,
            "first": first,
            "median_s": {name: statistics.median(r["s"] for r in rows) for name, rows in rounds.items()},
            "rounds": rounds,
            "identical": identical,
        }
        report["preset_over_checkpoint"] = report["median_s"]["preset"] / report["median_s"]["checkpoint"]
        if device.type != "cpu" and args.cpu_elements > 0:
            report["same_on_cpu"] = same_on_cpu(args.model, built, args.cpu_elements)
        report["host_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = report["identical"] and report.get("same_on_cpu", {"equal": True})["equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
