"""What a warm-up's first call of each page shape costs in the vision encoders and the LM prefill's
attention, and how much of it is cuDNN's attention (its graph built for each new shape on first use): the
`full` preset on one GPU, the eager engine (the same attention operators the packages call), the pages of
the warm-up's `--modes` (coldstart/passes.py `warmup_pages`), each shape's SAM and view-encoder calls and
the causal attention of the layer-by-layer LM prefill at the page's padded prompt length (engine/regions.py:
one layer's query, key and value, random) timed twice, first and second, in a fresh process per setting,
and on a GPU the steady calls of SAM, the views and the LM attention ("steady": the median of 20 calls, 50 for the LM attention,
between CUDA events):

- `cudnn`: PyTorch's own choice (cuDNN's attention where it takes the shapes, as on an H100 or H200);
- `no-cudnn`: cuDNN's attention turned off (`torch.backends.cuda.enable_cudnn_sdp(False)`), so the
  memory-efficient or flash kernel runs instead;
- `cudnn-preloaded`: PyTorch's choice, with cuDNN's libraries (those its first use would load) loaded
  before CUDA starts, as a worker's parent could load them before it forks its children: how much of
  the first use is loading them (the load's own time is printed with the table).
- `no-cudnn-views-lm`: cuDNN's attention off around the views and the LM prefill's attention (the flash
  kernel takes them: the same head dim for query, key and value, no mask), on for SAM (whose folded
  attention the flash kernel does not take);
- `cudnn-threaded`: PyTorch's choice, each shape's SAM first run once in a thread of its own, all at
  once, before the timed calls on the main thread: what of a first use a helper thread leaves done for
  the thread that serves (PyTorch keeps cuDNN's attention graphs per thread; the libraries, the CUDA
  modules and any kernels cuDNN compiles are the process's). The threads' wall time is printed.
- `cudnn-replayed`: PyTorch's choice; each shape's SAM first run once on a helper thread that records
  the cuDNN attention calls it makes (their arguments' shapes, strides and dtypes), then those calls
  made again on the main thread with empty tensors of the same layout, before the timed calls: whether
  a shape's first cost can be paid ahead from a record alone, with no model code (as a worker's child
  could, beside its imports). The replay's own time is printed.
- `no-cudnn-sam`: cuDNN off around SAM (`torch.backends.cudnn.flags(enabled=False)`), so its patch
  embedding and neck convolutions run PyTorch's own kernels (im2col and cuBLAS) instead of cuDNN's plans,
  which PyTorch builds per shape and keeps per thread: how much of SAM's first calls those plans are;
- `no-cudnn-attention-sam`: cuDNN's attention off around SAM (`sdpa_kernel` with the memory-efficient,
  flash and math kernels; the fast modules' folded query and key are wider than the value, which the
  flash kernel does not take): SAM's first calls without cuDNN's attention graphs, and its steady cost.

`--fast-modules`: the fast engine's vision modules (SAM's relative positions folded into its attention's
query and key channels, model/sam_attention.py), uncompiled, in place of transformers' modules.

A first call's cost is the host's (graph building, kernel loading), so each call is timed on the host
clock after synchronising the device; a second call's is the device's, for the steady cost of each
setting. The first process to read cuDNN's libraries (about 1 GB) may read them from disk and every
later one from the page cache: warm it first (`cat` them) to compare settings, or repeat one
(`--settings cudnn,cudnn-preloaded,cudnn`). `--profile-shape N`: the Nth shape's first calls (from 1;
past the first, which pays the process's own first use) also run under torch.profiler, and its host
operators and CUDA runtime calls are listed by their own time: where a first call spends it. Milliseconds,
markdown to stdout:

    source benchmarks/device_env.sh && python3 benchmarks/probe_first_calls.py > $OUT/first-calls.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, installed or not
SETTINGS = ("cudnn", "no-cudnn", "no-cudnn-views-lm", "cudnn-preloaded", "cudnn-threaded", "cudnn-replayed",
            "no-cudnn-sam", "no-cudnn-attention-sam")


def preload_cudnn() -> tuple[int, float]:
    """Load every library of the cuDNN wheel (nvidia-cudnn) before CUDA starts: how many, and the ms."""
    import ctypes
    import importlib.util
    import os

    began = time.perf_counter()
    spec = importlib.util.find_spec("nvidia") and importlib.util.find_spec("nvidia.cudnn")
    folders = list(spec.submodule_search_locations or []) if spec else []
    libraries = sorted(path for folder in folders for path in Path(folder, "lib").glob("libcudnn*.so*"))
    for library in libraries:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    return len(libraries), (time.perf_counter() - began) * 1e3


def steady_ms(call, args, repeats: int = 50) -> float:  # type: ignore[no-untyped-def]
    """The median of `repeats` calls after the first two, each between CUDA events."""
    import statistics

    import torch

    times = []
    for _ in range(repeats):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        call(*args)
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended))
    return statistics.median(times)


class Layout(NamedTuple):
    """A recorded tensor argument: what a replay's empty tensor takes from it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any


def recorded_attention(run) -> list[tuple]:  # type: ignore[no-untyped-def]
    """`run()` on a thread of its own, recording its cuDNN attention calls: (op, its arguments with each
    tensor as its `Layout`, its keyword arguments) each."""
    import threading

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple] = []
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is cudnn:
                calls.append((func, [Layout(tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor)
                                     else a for a in args], dict(kwargs or {})))  # fmt: skip
            return func(*args, **(kwargs or {}))

    def recording() -> None:
        with torch.inference_mode(), Record():
            run()

    thread = threading.Thread(target=recording)
    thread.start()
    thread.join()
    return calls


def replay_attention(calls: list[tuple], device: object) -> None:
    """The recorded calls again on this thread, on empty tensors of their layouts."""
    import torch

    for func, args, kwargs in calls:
        tensors = [torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=device) if isinstance(a, Layout)
                   else a for a in args]  # fmt: skip
        func(*tensors, **kwargs)


def measure(model: str, modes: list[str], setting: str, device: str, profile_shape: int = 0,
            fast_modules: bool = False) -> dict:  # fmt: skip
    """The setting's rows (a shape's first and second calls), what a preload or the threads took, and the
    profiled first calls' table of the `profile_shape`th shape (from 1; 0: none)."""
    import contextlib
    import threading

    import torch

    preloaded = preload_cudnn() if setting == "cudnn-preloaded" else None

    from dsocr_workers.engine.coldstart.passes import shape_name, warmup_pages
    from dsocr_workers.engine.regions import padded_length
    from dsocr_workers.engine.session import DeepSeekOCRSession
    from dsocr_workers.engine.variants import engine_class

    if setting == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    without_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def views_and_lm():  # type: ignore[no-untyped-def]
        return sdpa_kernel(without_cudnn) if setting == "no-cudnn-views-lm" else contextlib.nullcontext()

    def sam_kernels():  # type: ignore[no-untyped-def]
        if setting == "no-cudnn-sam":
            return torch.backends.cudnn.flags(enabled=False)
        return sdpa_kernel(without_cudnn) if setting == "no-cudnn-attention-sam" else contextlib.nullcontext()
    if fast_modules:
        from dsocr_workers.engine.variants.fast import FastCompile, FastEngine

        engine = FastEngine(FastCompile(decode_only=True))
    else:
        engine = engine_class("eager")()
    session = DeepSeekOCRSession.from_local(model, device=device, engine=engine)
    crops = session.max_crops()
    rows: list[dict[str, float | str]] = []
    threaded_ms: float | None = None
    replayed: tuple[int, float] | None = None
    profiled = ""

    def timed(call, *args):  # type: ignore[no-untyped-def]
        session.synchronize()
        began = time.perf_counter()
        out = call(*args)
        session.synchronize()
        return out, (time.perf_counter() - began) * 1e3

    attention = session.model.language_model.layers[0].self_attn

    def causal(query, key, value):  # type: ignore[no-untyped-def]
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)

    with torch.inference_mode():
        pages = [(name, session.prepare(image, None, name, crops))
                 for name, image in warmup_pages(session.family, modes, crops)]  # fmt: skip
        if setting == "cudnn-threaded":
            def run_sam(page) -> None:  # type: ignore[no-untyped-def]
                with torch.inference_mode():
                    session.encode_sam(session.upload(page), session.new_clock())

            threads = [threading.Thread(target=run_sam, args=(page,)) for _, page in pages]
            session.synchronize()
            began = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            session.synchronize()
            threaded_ms = (time.perf_counter() - began) * 1e3
        if setting == "cudnn-replayed":
            def run_pages() -> None:
                for _, page in pages:
                    session.encode_sam(session.upload(page), session.new_clock())

            calls = recorded_attention(run_pages)
            session.synchronize()
            began = time.perf_counter()
            replay_attention(calls, session.device)
            session.synchronize()
            replayed = (len(calls), (time.perf_counter() - began) * 1e3)
        for index, (name, page) in enumerate(pages, start=1):
            inputs = session.upload(page)
            row: dict[str, float | str] = {"shape": shape_name(name, page)}
            length = padded_length(page.prompt_tokens, session.max_positions)
            qkv = torch.randn(3, 1, attention.config.num_attention_heads, length, attention.head_dim,
                              device=session.device, dtype=session.dtype)  # fmt: skip
            for attempt in ("first", "second"):
                clock = session.new_clock()
                tracing = index == profile_shape and attempt == "first"
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) if tracing else contextlib.nullcontext() as trace:
                    with sam_kernels():
                        sam, row[f"sam {attempt}"] = timed(session.encode_sam, inputs, clock)
                    with views_and_lm():
                        _, row[f"views {attempt}"] = timed(session.encode_views, inputs, sam, clock)
                        _, row[f"lm {attempt}"] = timed(causal, *qkv)
                if tracing:
                    averages = trace.key_averages()
                    profiled = f"{row['shape']}\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25)
            if session.device.type == "cuda":  # the steady calls on the device's clock: the kernels' own cost
                with views_and_lm():
                    row["views steady"] = steady_ms(session.encode_views, (inputs, sam, clock), repeats=20)
                    row["lm steady"] = steady_ms(causal, qkv)
                with sam_kernels():
                    row["sam steady"] = steady_ms(session.encode_sam, (inputs, clock), repeats=20)
            rows.append(row)
    return {"rows": rows, "preloaded": preloaded, "threaded_ms": threaded_ms, "replayed": replayed,
            "profiled": profiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="full")
    parser.add_argument("--modes", default="gundam")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (no cuDNN there)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="the settings in the order run, each in a fresh process (one may repeat)")
    parser.add_argument("--setting", choices=SETTINGS, help="one process's measurement (internal)")
    parser.add_argument("--profile-shape", type=int, default=0, help="the shape (from 1) whose first calls are profiled")
    parser.add_argument("--fast-modules", action="store_true",
                        help="the fast engine's vision modules, uncompiled, in place of transformers'")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.setting:
        print(json.dumps(measure(args.model, modes, args.setting, args.device, args.profile_shape, args.fast_modules)))
        return
    import torch

    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# First calls of the vision encoders ({where}, torch {torch.__version__}, "
          f"{args.model} preset (random weights), {'the fast engine' if args.fast_modules else 'eager engine'}'s "
          f"modules, modes {args.modes})\n")  # fmt: skip
    print(f"`python3 benchmarks/probe_first_calls.py {' '.join(sys.argv[1:])}`\n")
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            raise SystemExit(f"unknown setting {setting!r}: one of {', '.join(SETTINGS)}")
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--modes", args.modes,
                               "--setting", setting, "--device", args.device, "--profile-shape",
                               str(args.profile_shape), *(["--fast-modules"] if args.fast_modules else [])],
                              cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            print(f"## {setting}: failed\n\n```\n{done.stderr[-3000:]}\n```\n")
            continue
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        rows, preloaded = measured["rows"], measured["preloaded"]
        columns = ["sam first", "sam second", "views first", "views second", "lm first", "lm second"]
        columns += ["sam steady", "views steady", "lm steady"] if "lm steady" in rows[0] else []
        print(f"## {setting}\n")
        if preloaded is not None:
            print(f"{preloaded[0]} cuDNN libraries loaded before CUDA started, in {preloaded[1]:.1f} ms\n")
        if measured["replayed"] is not None:
            calls, ms = measured["replayed"]
            print(f"{calls} recorded cuDNN attention calls replayed on the main thread first: {ms:.1f} ms\n")
        if measured["threaded_ms"] is not None:
            print(f"Each shape's SAM in a thread of its own, all at once, first: {measured['threaded_ms']:.1f} ms\n")
        print("| shape | " + " | ".join(f"{c} ms" for c in columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for row in rows:
            print(f"| {row['shape']} | " + " | ".join(f"{row[c]:.3f}" if "steady" in c else f"{row[c]:.1f}" for c in columns) + " |")
        sums = {c: sum(float(row[c]) for row in rows) for c in columns}
        print("| **all shapes** | " + " | ".join(f"**{sums[c]:.3f}**" if "steady" in c else f"**{sums[c]:.1f}**" for c in columns) + " |\n")
        if measured["profiled"]:
            shape, _, table = measured["profiled"].partition("\n")
            print(f"The first calls of {shape} under torch.profiler, by own host time:\n\n```\n{table}\n```\n")


if __name__ == "__main__":
    main()
