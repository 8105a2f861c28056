"""Can the fast engine's compiled parts be built ahead of time and loaded without dynamo (issue 29)?

Measures, on one GPU, the `full` preset in bf16 (fast engine modules), with AOTInductor
(`torch.export.export` → `torch._inductor.aoti_compile_and_package` → `aoti_load_package`):

1. decode: `generate.decode_one_token` wrapped in a module whose inputs are the decode state (the token
   buffer, its length, the prompt length, every KV-cache layer's tensors), exported for one cache bucket,
   packaged WITHOUT its weights (`aot_inductor.package_constants_in_so=False`) and given the session's own
   weights at load (`load_constants(user_managed=True)`: no second copy). The loaded runner called
   directly and captured in a CUDA graph (engine/regions.py `capture_graph`), against the engine's
   `torch.compile(mode="reduce-overhead")` step in the same process: tokens of 64 greedy steps from the
   same prefill, and ms/token (CUDA events per step, median over `--timing-steps`).
2. blocks: one SAM block of each kind (windowed, global) and one CLIP block, dynamic in the tile batch,
   and the LM prefill's two layer kinds (dense, MoE) dynamic in the padded prompt length (a multiple of
   `PREFILL_BUCKET`), each exported with its weights as inputs (`torch.func.functional_call`), so one
   package serves every layer of its kind as the regional compile does: max |diff| against the eager
   block at several sizes, and the time per call.
3. what a FRESH process pays to be ready: `fresh-aoti` (import torch, `aoti_load_package`, constants,
   first call, CUDA graph capture) for each package; `fresh-compile` the engine's way for the decode
   step: with the inductor cache warm, from a mega-cache (`torch.compiler.load_cache_artifacts`), and
   from dynamo's `aot_compile` / `load_compiled_function` (precompile) where it works.

The decode and blocks parts build in two processes at once (compilation is host work; a lock file keeps
their GPU measurements apart), then the fresh processes run one by one. Everything lands in --out:

    # on the GPU machine (tool `run`; nvtx from .whl, benchmarks/README.md "Device wheels")
    source benchmarks/device_env.sh && export CXX=/usr/bin/g++
    python3 benchmarks/probe_aoti.py run --out $OUT --tag h100 --budget-s 560 --build-share 0.7 --fresh-timeout-s 70

CXX: the device image's default C++ compiler (/opt/gcc/bin/g++) builds packages whose loader segfaults
(even a one-layer toy); Ubuntu's /usr/bin/g++ builds loadable ones. Each package is first loaded in a
child process (`trial_load`), so a crashing loader costs that child only. Results and the recommendation:
benchmarks/results/aoti-2026-11-26-summary.md.

`run --preset tiny --device cpu --export-only` checks the exports on a CPU (TRITON_INTERPRET=1; the
decode step then uses transformers' batched experts, the Triton GEMVs cannot be traced on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()
# The repository root (this file lies in benchmarks/, or in a scratch folder below the root on the device).
ROOT = next((p for p in Path(__file__).resolve().parents if (p / "dsocr_workers").is_dir()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


def save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


@contextlib.contextmanager
def gpu_lock(work: Path) -> Iterator[None]:
    """Held around GPU measurements: the other build process compiles meanwhile, never measures."""
    with open(work / "gpu.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def attempt(record: dict[str, Any], name: str, call: Callable[[], Any]) -> Any:
    """Run `call`, record its seconds and, if it raised, the error; None on failure."""
    began = time.perf_counter()
    try:
        value = call()
        record[f"{name}_s"] = round(time.perf_counter() - began, 3)
        return value
    except Exception as exc:  # noqa: BLE001 - a probe records what broke and goes on
        record[f"{name}_s"] = round(time.perf_counter() - began, 3)
        record[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        record[f"{name}_traceback"] = traceback.format_exc()[-6000:]
        log(f"{name} failed: {type(exc).__name__}: {str(exc)[:400]}")
        return None


def tensor_spec(tensor: Any) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


# --- the model -------------------------------------------------------------------------------------


def open_session(preset: str, device_name: str) -> Any:
    """The fast engine's model (its kernels and module swaps, as `DeepSeekOCRSession.from_local` builds it
    on CUDA) in a session that compiles only the decode step (`FastCompile(decode_only=True)`): vision and
    LM prefill run eager, the reference the blocks are compared with."""
    import torch

    from dsocr_workers.engine.result import ModelSource
    from dsocr_workers.engine.session import DeepSeekOCRSession
    from dsocr_workers.engine.variants.fast import FastCompile, FastEngine
    from dsocr_workers.model.checkpoint import build_preset

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    engine = FastEngine(FastCompile(backend=backend, decode_only=True))
    with torch.inference_mode():
        loaded = build_preset(preset, seed=0, device=device, dtype=dtype, **engine.kernels())
    engine.after_load(loaded.model)
    if device.type != "cuda":
        # The CPU check only: the Triton GEMVs cannot be traced on a CPU (Triton's interpreter reads the
        # fake tensors' data); transformers' batched GEMMs stand in.
        loaded.model.language_model.config._experts_implementation = "batched_mm"
    source = ModelSource("preset", preset, random_weights=True, seed=0, fingerprint=loaded.fingerprint)
    return DeepSeekOCRSession(loaded, source, device, dtype, engine)


# SAM's blocks call this project operator (a cuBLASLt epilogue, not a Triton kernel AOTInductor compiles in).
SAM_OPERATORS = "dsocr_workers.model.sam_mlp"


def trial_load(spec: Path, result: Path, record: dict[str, Any], name: str, imports: str = "") -> bool:
    """`fresh-aoti` on one package in a child process (faulthandler on): whether it loaded and ran; its
    numbers, or how it died, into `record`."""
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "fresh-aoti", "--spec", str(spec),
                               "--result", str(result), "--imports", imports], capture_output=True, text=True,
                              timeout=150)  # fmt: skip
        rc: int | str = done.returncode
        tail = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", str(exc)[-3000:]
    record[f"{name}_trial_load"] = {"rc": rc, "s": round(time.perf_counter() - began, 3),
                                    "result": read(result), "output_tail": tail if rc != 0 else ""}  # fmt: skip
    packages = (read(result) or {}).get("packages") or [{}]
    return rc == 0 and "load_package_error" not in packages[0]


def aoti_package(exported: Any, path: Path, record: dict[str, Any], name: str) -> str | None:
    """Compile an exported program into a .pt2 package without its constants (the caller hands them at
    load); its seconds and bytes into `record`."""
    import torch

    configs = {"aot_inductor.package_constants_in_so": False}
    built = attempt(record, f"{name}_aoti_compile",
                    lambda: torch._inductor.aoti_compile_and_package(exported, package_path=str(path),
                                                                     inductor_configs=configs))  # fmt: skip
    if built is not None:
        record[f"{name}_package_bytes"] = os.path.getsize(built)
    return built


def in_place(target: str) -> bool:
    """aten.index_copy_.default and the like."""
    parts = target.split(".")
    return len(parts) >= 3 and parts[-2].endswith("_") and not parts[-2].startswith("_")


def export_program(
    module: Any, args: tuple, record: dict[str, Any], name: str, dynamic_shapes: Any = None
) -> Any:
    """torch.export, non-strict first (tracing with Python, as torch.export defaults to), then strict
    (dynamo) if that failed; which one worked goes into `record`."""
    import torch

    exported = attempt(record, f"{name}_export_nonstrict",
                       lambda: torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False))  # fmt: skip
    if exported is None:
        exported = attempt(record, f"{name}_export_strict",
                           lambda: torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=True))  # fmt: skip
    if exported is not None:
        signature = exported.graph_signature
        record[f"{name}_graph_nodes"] = len(exported.graph.nodes)
        record[f"{name}_mutated_inputs"] = len(signature.user_inputs_to_mutate)
        record[f"{name}_mutated_buffers"] = len(signature.buffers_to_mutate)
        # torch.export may keep in-place ops in its graph (no mutation in the signature until decomposed).
        record[f"{name}_inplace_ops"] = sorted({str(node.target) for node in exported.graph.nodes
                                                if node.op == "call_function" and in_place(str(node.target))})  # fmt: skip
        targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
        record[f"{name}_custom_ops"] = sorted(t for t in targets if t.startswith("dsocr") or "triton" in t)
    return exported


# --- 1. the decode step ----------------------------------------------------------------------------


def decode_state_slots(cache: Any, ban: Any) -> list[tuple[Any, str]]:
    """Every tensor the decode step reads or writes outside the model's weights: the n-gram ban's token
    buffer, its length and the prompt length, then each cache layer's tensors (keys, values and whatever
    this transformers version keeps beside them, e.g. `cumulative_length`)."""
    import torch

    slots: list[tuple[Any, str]] = [(ban, "tokens"), (ban, "length"), (ban, "prompt_length")]
    for layer in cache.layers:
        slots += [
            (layer, key) for key, value in sorted(vars(layer).items()) if isinstance(value, torch.Tensor)
        ]
    return slots


def decode_module(model: Any, cache: Any, ban: Any, options: Any) -> Any:
    """`decode_one_token(model, cache, ban, options)` as a module whose inputs are the decode state
    (`decode_state_slots`, in order): export sees them as inputs it mutates, the weights as the module's
    parameters and buffers."""
    import torch

    from dsocr_workers.engine.generate import decode_one_token

    slots = decode_state_slots(cache, ban)

    class DecodeStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *state: torch.Tensor) -> torch.Tensor:
            saved = [getattr(owner, key) for owner, key in slots]
            try:
                for (owner, key), tensor in zip(slots, state, strict=True):
                    setattr(owner, key, tensor)
                return decode_one_token(self.model, cache, ban, options)
            finally:
                for (owner, key), tensor in zip(slots, saved, strict=True):
                    setattr(owner, key, tensor)

    return DecodeStep(), [getattr(owner, key) for owner, key in slots]


def step_times(step: Callable[[], Any], steps: int) -> list[float]:
    """Milliseconds of each of `steps` calls, from CUDA events recorded between them."""
    import torch

    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for index in range(steps):
        step()
        events[index + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]


def summary_ms(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median": round(statistics.median(ordered), 4), "p10": round(ordered[len(ordered) // 10], 4),
            "p90": round(ordered[(len(ordered) * 9) // 10], 4), "mean": round(statistics.fmean(ordered), 4),
            "n": len(ordered)}  # fmt: skip


def section_decode(args: argparse.Namespace) -> None:
    work = Path(args.work)
    out = work / "decode.json"
    record: dict[str, Any] = {
        "preset": args.preset,
        "device": args.device,
        "bucket_tokens": args.max_new_tokens,
    }
    began = time.perf_counter()
    import torch

    record["import_torch_s"] = round(time.perf_counter() - began, 3)
    record["torch"] = torch.__version__
    import transformers

    record["transformers"] = transformers.__version__
    from PIL import Image

    from dsocr_workers.engine.regions import capture_graph
    from dsocr_workers.engine.result import DecodeOptions
    from dsocr_workers.engine.stages import StageClock

    cuda = args.device.startswith("cuda")
    if cuda:
        record["gpu"] = torch.cuda.get_device_name(0)
    session = attempt(record, "load", lambda: open_session(args.preset, args.device))
    save(out, record)
    if session is None:
        return
    model, device = session.model, session.device
    page = session.prepare(Image.new("RGB", (640, 640), "white"), None, "tiny", 9)
    options = DecodeOptions(ignore_eos=True)
    record["prompt_tokens"] = page.prompt_tokens

    def new_job() -> Any:
        clock = StageClock(device)
        with torch.inference_mode():
            job = session.start_job(page, options, args.max_new_tokens, clock)
            session.prefill(job, clock)
        return job

    job = new_job()
    buffers = job.buffers
    record["cache_capacity"] = int(buffers.tokens.shape[0])
    compiled = session.runners.decode_step  # the engine's step: torch.compile(decode_one_token, reduce-overhead)

    def compiled_step() -> None:
        compiled(model, buffers.cache, job.ban, options)

    def run_job(
        step: Callable[[], None], steps: int, record_times: bool = False
    ) -> tuple[list[int], list[float]]:
        nonlocal job
        job = new_job()
        assert job.buffers is buffers, "one cache bucket for every job of the probe"
        with torch.inference_mode():
            if record_times and cuda:
                times = step_times(step, steps)
            else:
                times = []
                for _ in range(steps):
                    step()
            tokens = buffers.read_tokens(job.prompt_tokens, job.prompt_tokens + 1 + steps)
        return tokens, times

    # The engine's path: its first steps compile (cold cache on a fresh machine) and record the graph.
    with torch.inference_mode():
        began = time.perf_counter()
        compiled_step()
        if cuda:
            torch.cuda.synchronize()
        record["compiled_first_step_s"] = round(time.perf_counter() - began, 3)
        for _ in range(3):
            compiled_step()
        if cuda:
            torch.cuda.synchronize()
        record["compiled_ready_s"] = round(time.perf_counter() - began, 3)
    if hasattr(torch._dynamo.utils, "calculate_time_spent"):
        record["compiled_time_spent"] = {
            k: round(v, 3) for k, v in torch._dynamo.utils.calculate_time_spent().items()
        }
    reference, _ = run_job(compiled_step, args.steps)
    record["reference_tokens"] = reference
    save(out, record)

    # Mega-cache: what torch.compile built, as bytes a fresh process loads into an empty cache.
    def save_megacache() -> int:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            raise RuntimeError("save_cache_artifacts returned None")
        (work / "megacache.bin").write_bytes(artifacts[0])
        return len(artifacts[0])

    record["megacache_bytes"] = attempt(record, "megacache_save", save_megacache)

    def aoti() -> None:
        nonlocal job
        # AOTInductor: export the step with the decode state as inputs, package without weights.
        module, state = decode_module(model, buffers.cache, job.ban, options)
        # Normal tensors: the buffers are inference tensors.
        example = tuple(tensor.clone() for tensor in state)
        record["state_inputs"] = [tensor_spec(t) for t in example]
        with torch.no_grad():
            exported = export_program(module, example, record, "decode")
        save(out, record)
        if exported is None or args.export_only:
            return
        path = aoti_package(exported, work / "decode.pt2", record, "decode")
        save(out, record)
        if path is None:
            return
        weights = {**dict(module.named_parameters()), **dict(module.named_buffers()), **exported.constants}
        # Every name the package may ask for; it asks for those it did not fold (get_constant_fqns).
        spec = {"package": path, "state": record["state_inputs"], "length": int(buffers.length.item()),
                "constants": {name: tensor_spec(tensor) for name, tensor in weights.items()}, "capture": True}  # fmt: skip
        (work / "decode.spec.json").write_text(json.dumps(spec))
        # A first load in a child process: a package that crashes its loader takes only the child down.
        if not trial_load(work / "decode.spec.json", work / "trial-decode.json", record, "decode"):
            return
        runner = attempt(record, "decode_load_same_process",
                         lambda: torch._inductor.aoti_load_package(path, run_single_threaded=True))  # fmt: skip
        if runner is None:
            return
        fqns = runner.get_constant_fqns()
        record["decode_constants"] = len(fqns)
        missing = [name for name in fqns if name not in weights]
        record["decode_constants_missing"] = missing[:20]
        constants = {name: weights[name] for name in fqns if name in weights}
        attempt(record, "decode_load_constants",
                lambda: runner.load_constants(constants, check_full_update=not missing, user_managed=True))  # fmt: skip

        def aoti_direct() -> None:
            runner(*state)

        # In-place: does a direct call write the caller's buffers (length + 1, the token appended)?
        def check_in_place() -> dict[str, int]:
            nonlocal job
            job = new_job()
            with torch.inference_mode():
                before = int(buffers.length.item())
                returned = runner(*state)
                after = int(buffers.length.item())
                written = int(buffers.tokens[after - 1].item()) if after > before else -1
                token = int(returned.reshape(-1)[0].item()) if isinstance(returned, torch.Tensor) else -2
            return {
                "length_before": before,
                "length_after": after,
                "token_written": written,
                "token_returned": token,
            }

        record["decode_in_place"] = attempt(record, "decode_in_place_check", check_in_place)
        direct = attempt(record, "decode_direct_run", lambda: run_job(aoti_direct, args.steps)[0])
        if direct is not None:
            record["aoti_direct_tokens_equal"] = direct == reference
            record["aoti_direct_tokens"] = direct
        save(out, record)

        graph_holder: dict[str, Any] = {}

        def capture() -> None:
            nonlocal job
            job = new_job()
            with torch.inference_mode():
                graph, _ = capture_graph(lambda: [runner(*state)], torch.cuda.graph_pool_handle())
            graph_holder["graph"] = graph

        attempt(record, "decode_capture", capture)
        if "graph" in graph_holder:
            replay = graph_holder["graph"].replay
            graphed = attempt(record, "decode_graphed_run", lambda: run_job(replay, args.steps)[0])
            if graphed is not None:
                record["aoti_graphed_tokens_equal"] = graphed == reference
                record["aoti_graphed_tokens"] = graphed
                if graphed != reference:
                    record["aoti_graphed_first_mismatch"] = next(
                        i for i, (a, b) in enumerate(zip(graphed, reference, strict=False)) if a != b
                    )
        save(out, record)

        # Side by side in this process: events per step, the engine's compiled step, then AOTI (graphed and
        # direct), then the engine's again; warm-up steps of each job left out.
        timing: dict[str, Any] = {}
        with gpu_lock(work):
            variants = [("compiled_reduce_overhead", compiled_step)]
            if "graph" in graph_holder:
                variants.append(("aoti_cuda_graph", graph_holder["graph"].replay))
            variants += [("aoti_direct", aoti_direct), ("compiled_reduce_overhead_again", compiled_step)]
            if "graph" in graph_holder:
                variants.append(("aoti_cuda_graph_again", graph_holder["graph"].replay))
            for name, step in variants:

                def timed(step: Callable[[], None] = step) -> dict[str, Any]:
                    wall_began = time.perf_counter()
                    _, times = run_job(step, args.warm_steps + args.timing_steps, record_times=True)
                    return summary_ms(times[args.warm_steps :]) | {
                        "job_wall_s": round(time.perf_counter() - wall_began, 3)
                    }

                timing[name] = attempt(timing, name, timed)
        record["decode_ms_per_token"] = timing
        save(out, record)

    aoti()

    # dynamo's own ahead-of-time compile (precompile): the step traced once, saved, loaded without tracing.
    def precompile() -> int:
        from dsocr_workers.engine.generate import decode_one_token

        with torch.inference_mode():
            fn = torch.compile(decode_one_token, fullgraph=True).aot_compile(
                ((model, buffers.cache, job.ban, options), {})
            )
        fn.save_compiled_function(str(work / "decode.precompiled"))
        return os.path.getsize(work / "decode.precompiled")

    if not args.export_only and hasattr(torch.compile(lambda x: x), "aot_compile"):
        record["precompile_bytes"] = attempt(record, "precompile", precompile)
    save(out, record)
    log(f"decode done: {json.dumps(record.get('decode_ms_per_token'))[:600]}")


# --- 2. blocks -------------------------------------------------------------------------------------


def weights_as_inputs(layer: Any, call: Callable[..., Any]) -> tuple[Any, list[Any]]:
    """A module whose forward is `call(layer, *inputs)` with the layer's parameters and buffers as
    trailing inputs (`torch.func.functional_call`): the exported graph holds no weights, so one package
    serves every layer of the kind. The layer is held outside the module's state."""
    import torch
    from torch.nn.utils.stateless import _reparametrize_module

    names = [name for name, _ in layer.named_parameters()] + [name for name, _ in layer.named_buffers()]
    tensors = [tensor for _, tensor in layer.named_parameters()] + [
        tensor for _, tensor in layer.named_buffers()
    ]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = len(names)

        def forward(self, *inputs: torch.Tensor) -> Any:
            head, weights = inputs[: -self.count], inputs[-self.count :]
            # functional_call's own swap, around `call` rather than around `layer.forward`.
            with _reparametrize_module(
                layer, dict(zip(names, weights, strict=True)), tie_weights=False, strict=True
            ):
                return call(layer, *head)

    return Block(), tensors


def weights_of(layer: Any) -> list[Any]:
    return [tensor for _, tensor in layer.named_parameters()] + [
        tensor for _, tensor in layer.named_buffers()
    ]


def capture_inputs(layers: Any, run: Callable[[], Any]) -> list[Any]:
    """The first positional input of every layer in `layers` during `run()`."""
    captured: list[Any] = [None] * len(layers)
    handles = [layer.register_forward_pre_hook(lambda _m, inputs, i=i: captured.__setitem__(i, inputs[0].clone()))
               for i, layer in enumerate(layers)]  # fmt: skip
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def compare_block(runner: Any, reference: Callable[[], Any], inputs: list[Any],
                  before: Callable[[], None] = lambda: None) -> dict[str, Any]:  # fmt: skip
    """max |AOTI − eager| and both per-call times (median of 20 after 3, CUDA events) at one size.
    `before()` runs before every call (the LM layers: the cache's fill count back to 0)."""
    before()
    got = runner(*inputs)
    before()
    want = reference()
    got_t = got[0] if isinstance(got, (tuple, list)) else got
    want_t = want[0] if isinstance(want, (tuple, list)) else want
    diff = (got_t.float() - want_t.float()).abs().max().item()
    scale = want_t.float().abs().max().item()
    row: dict[str, Any] = {"max_abs_diff": diff, "max_abs_reference": scale}
    if got_t.is_cuda:
        for name, call in (("aoti_ms", lambda: runner(*inputs)), ("eager_ms", reference)):

            def fn(call: Callable[[], Any] = call) -> None:
                before()
                call()

            for _ in range(3):
                fn()
            row[name] = round(statistics.median(step_times(fn, 20)), 4)
    return row


def section_blocks(args: argparse.Namespace) -> None:
    work = Path(args.work)
    out = work / "blocks.json"
    record: dict[str, Any] = {}
    import torch

    from dsocr_workers.engine.generate import DecodeBuffers
    from dsocr_workers.engine.regions import PREFILL_BUCKET
    from dsocr_workers.model.modeling import CACHE_ARGUMENT

    session = attempt(record, "load", lambda: open_session(args.preset, args.device))
    save(out, record)
    if session is None:
        return
    model, device, dtype = session.model, session.device, session.dtype
    generator = torch.Generator(device=device).manual_seed(0)
    specs: list[dict[str, Any]] = []
    trials_failed: list[str] = []
    tile = 640 if args.preset == "full" else 64
    tiles_max = 9

    def run_block(kind: str, layer: Any, call: Callable[..., Any], head: list[Any], dynamic: Any,
                  sizes: list[Callable[[], tuple[list[Any], Callable[[], Any]]]]) -> None:  # fmt: skip
        entry: dict[str, Any] = {}
        record[kind] = entry
        module, weights = weights_as_inputs(layer, call)
        example = tuple(t.clone() for t in head) + tuple(w.clone() for w in weights)
        dynamic_shapes = (tuple(dynamic) + (None,) * len(weights),)  # forward(*inputs): one parameter
        with torch.no_grad():
            exported = export_program(module, example, entry, "block", dynamic_shapes)
        save(out, record)
        if exported is None or args.export_only:
            return
        path = aoti_package(exported, work / f"{kind}.pt2", entry, "block")
        save(out, record)
        if path is None:
            return
        specs.append(
            {"name": kind, "package": path, "inputs": [tensor_spec(t) for t in example], "capture": False}
        )
        (work / "blocks.spec.json").write_text(json.dumps(specs))
        (work / f"{kind}.spec.json").write_text(json.dumps(specs[-1]))
        if trials_failed:  # a loader that crashed once crashes again: the time goes to the other builds
            entry["block_trial_load"] = f"skipped: the trial load of {trials_failed[0]} failed"
            return
        imports = SAM_OPERATORS if kind.startswith("sam") else ""
        if not trial_load(work / f"{kind}.spec.json", work / f"trial-{kind}.json", entry, "block", imports):
            trials_failed.append(kind)
            return
        runner = attempt(entry, "block_load_same_process", lambda: torch._inductor.aoti_load_package(path))
        if runner is None:
            return
        entry["block_constants"] = len(runner.get_constant_fqns())
        rows = []
        with gpu_lock(work), torch.inference_mode():
            for make in sizes:

                def one(make: Callable[[], tuple[list[Any], Callable[[], Any]]] = make) -> dict[str, Any]:
                    inputs, reference, *before = make()
                    return {"shape": list(inputs[0].shape)} | compare_block(
                        runner, reference, inputs, *before
                    )

                rows.append(attempt(entry, f"size{len(rows)}", one))
        entry["sizes"] = rows
        save(out, record)
        log(f"{kind}: {json.dumps(rows)[:400]}")

    # LM prefill layers: dynamic in the padded prompt length (a multiple of PREFILL_BUCKET), one cache
    # bucket; the layer writes the cache layer handed to it (the fused attention, model/fused.py).
    language_model = model.language_model
    hidden_size = language_model.config.hidden_size
    capacity = 2048 if args.preset == "full" else 512
    longest = 1280 if args.preset == "full" else 256
    buffers = DecodeBuffers.allocate(model, capacity, device)
    layer_cache = buffers.cache.layers[0]
    cache_keys = [key for key, value in sorted(vars(layer_cache).items()) if isinstance(value, torch.Tensor)]
    record["lm_cache_tensors"] = cache_keys

    def lm_call(layer: Any, hidden: Any, cos: Any, sin: Any, *cache_state: Any) -> Any:
        saved = [getattr(layer_cache, key) for key in cache_keys]
        try:
            for key, tensor in zip(cache_keys, cache_state, strict=True):
                setattr(layer_cache, key, tensor)
            out = layer(
                hidden, attention_mask=None, position_embeddings=(cos, sin), **{CACHE_ARGUMENT: layer_cache}
            )
            return out[0] if isinstance(out, tuple) else out
        finally:
            for key, tensor in zip(cache_keys, saved, strict=True):
                setattr(layer_cache, key, tensor)

    def lm_inputs(length: int) -> list[Any]:
        embeds = torch.randn(1, length, hidden_size, device=device, dtype=dtype, generator=generator)
        positions = torch.arange(length, device=device).unsqueeze(0)
        cos, sin = language_model.rotary_emb(embeds, positions)
        state = [torch.zeros_like(getattr(layer_cache, key)) for key in cache_keys]
        return [embeds, cos, sin, *state]

    blocks64 = torch.export.Dim("blocks64", min=1, max=longest // PREFILL_BUCKET)
    length_dim = PREFILL_BUCKET * blocks64
    for kind, index in (("lm_moe", 1), ("lm_dense", 0)):
        if kind not in args.kinds:
            continue
        layer = language_model.layers[index]
        makers = []
        for other in (index, len(language_model.layers) - 1) if index else (index,):
            for length in (128, 640, longest) if other == index else (longest,):

                def make(other: int = other, length: int = length) -> tuple[list[Any], Callable[[], Any]]:
                    head = lm_inputs(length)
                    target = language_model.layers[other]
                    reference_state = [t.clone() for t in head[3:]]

                    # As RegionalPrefill does before its layers: a prefill fills the cache from slot 0.
                    def refill() -> None:
                        for tensor in (*head[3:], *reference_state):
                            if tensor.dim() == 0:
                                tensor.zero_()

                    return ([*head, *weights_of(target)], lambda: lm_call(target, *head[:3], *reference_state),
                            refill)  # fmt: skip

                makers.append(make)
        with torch.inference_mode():
            example = [t.clone() for t in lm_inputs(2 * PREFILL_BUCKET)]
        example = [t.clone() for t in example]
        dynamic = ({1: length_dim}, {1: length_dim}, {1: length_dim}) + (None,) * len(cache_keys)
        run_block(kind, layer, lm_call, example, dynamic, makers)

    # SAM: the tiles' block inputs (a 640-px view each), captured from the eager encoder.
    sam_layers = model.sam.layers
    pixels = torch.randn(tiles_max, 3, tile, tile, device=device, dtype=dtype, generator=generator)
    with torch.inference_mode():
        sam_inputs = capture_inputs(sam_layers, lambda: model.encode_sam(pixels))
        features = model.encode_sam(pixels)
        clip_layers = model.clip.transformer.layers
        clip_inputs = capture_inputs(clip_layers, lambda: model.encode_clip(features))
    windowed = next(i for i, layer in enumerate(sam_layers) if getattr(layer, "window_size", 0) > 0)
    global_ = next(i for i, layer in enumerate(sam_layers) if getattr(layer, "window_size", 0) == 0)
    record["sam_layers"] = {"windowed": windowed, "global": global_, "count": len(sam_layers)}
    tiles = torch.export.Dim("tiles", min=2, max=tiles_max)

    def sam_call(layer: Any, hidden: Any) -> Any:
        out = layer(hidden)
        return out[0] if isinstance(out, tuple) else out

    for kind, index in (("sam_windowed", windowed), ("sam_global", global_)):
        if kind not in args.kinds:
            continue
        same_kind = [i for i, layer in enumerate(sam_layers)
                     if (getattr(layer, "window_size", 0) > 0) == (getattr(sam_layers[index], "window_size", 0) > 0)]  # fmt: skip
        makers = []
        for other in (same_kind[0], same_kind[-1]):
            for count in (2, 6, tiles_max) if other == same_kind[0] else (tiles_max,):

                def make(other: int = other, count: int = count) -> tuple[list[Any], Callable[[], Any]]:
                    hidden = sam_inputs[other][:count].contiguous()
                    return [hidden, *weights_of(sam_layers[other])], lambda: sam_call(
                        sam_layers[other], hidden
                    )

                makers.append(make)
        example = sam_inputs[index][:3].contiguous()
        run_block(kind, sam_layers[index], sam_call, [example], ({0: tiles},), makers)

    def clip_call(layer: Any, hidden: Any) -> Any:
        return layer(hidden)

    makers = []
    for other in (0, len(clip_layers) - 1):
        for count in (2, 6, tiles_max) if other == 0 else (tiles_max,):

            def make(other: int = other, count: int = count) -> tuple[list[Any], Callable[[], Any]]:
                hidden = clip_inputs[other][:count].contiguous()
                return [hidden, *weights_of(clip_layers[other])], lambda: clip_call(
                    clip_layers[other], hidden
                )

            makers.append(make)
    if "clip" in args.kinds:
        run_block("clip", clip_layers[0], clip_call, [clip_inputs[0][:3].contiguous()], ({0: tiles},), makers)

    (work / "blocks.spec.json").write_text(json.dumps(specs))
    save(out, record)


# --- 3. fresh processes ----------------------------------------------------------------------------


def fill(torch: Any, spec: dict[str, Any], device: Any, value: float | None = None) -> Any:
    dtype = getattr(torch, spec["dtype"])
    tensor = torch.empty(spec["shape"], dtype=dtype, device=device)
    if dtype.is_floating_point:
        return tensor.normal_(0, 0.02) if value is None else tensor.fill_(value)
    return tensor.zero_() if value is None else tensor.fill_(int(value))


def graph_of(torch: Any, run: Callable[[], Any]) -> Any:
    """`run` captured in a CUDA graph after one uncaptured call, the cuBLAS workspaces cleared around the
    capture as engine/regions.py `capture_graph` does (kept here: this process imports no project code)."""
    run()
    graph = torch.cuda.CUDAGraph()
    torch._C._cuda_clearCublasWorkspaces()
    try:
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            run()
    finally:
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    return graph


def load_direct(torch: Any, path: str, run_single_threaded: bool) -> Any:
    """The package's C++ loader without `aoti_load_package`'s host comparison, whose CPU vector ISA probe
    (compiles and dlopen children, ~7 s each on the H100 host) was the whole of a fresh process's first
    load: the project's own artifact key (GPU type, torch version, ...) is the check that matters."""
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel
    except ImportError:
        from torch._inductor.package.package import AOTICompiledModel
    return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(path, "model", run_single_threaded, 1, -1))


def fresh_package(
    torch: Any, spec: dict[str, Any], device: Any, loader: str = "aoti_load_package"
) -> dict[str, Any]:
    row: dict[str, Any] = {"package": spec["package"], "name": spec.get("name", "decode"), "loader": loader}

    def load() -> Any:
        if loader == "direct":
            return load_direct(torch, spec["package"], spec["capture"])
        return torch._inductor.aoti_load_package(spec["package"], run_single_threaded=spec["capture"])

    runner = attempt(row, "load_package", load)
    if runner is None:
        return row
    wanted = runner.get_constant_fqns()
    row["constants"] = len(wanted)
    row["constants_unknown"] = [name for name in wanted if name not in spec.get("constants", {})][:20]
    constants = {
        name: fill(torch, spec["constants"][name], device)
        for name in wanted
        if name in spec.get("constants", {})
    }
    if constants:
        attempt(row, "load_constants", lambda: runner.load_constants(constants, check_full_update=not row["constants_unknown"],
                                                                      user_managed=True))  # fmt: skip
    if "state" in spec:
        inputs = [
            fill(torch, s, device, 0) if s["dtype"] == "int64" else fill(torch, s, device)
            for s in spec["state"]
        ]
        inputs[1].fill_(spec["length"])
        inputs[2].fill_(spec["length"])
    else:
        inputs = [fill(torch, s, device) for s in spec["inputs"]]

    def first() -> None:
        with torch.inference_mode():
            runner(*inputs)
        torch.cuda.synchronize()

    attempt(row, "first_call", first)
    if spec.get("capture") and "first_call_error" not in row:

        def capture() -> Any:
            with torch.inference_mode():
                return graph_of(torch, lambda: runner(*inputs))

        graph = attempt(row, "capture", capture)
        if graph is not None:
            row["replay_ms"] = summary_ms(step_times(graph.replay, 50))
    row["ready_s"] = round(
        sum(row.get(k, 0) for k in ("load_package_s", "load_constants_s", "first_call_s", "capture_s")), 3
    )
    return row


def fresh_aoti(args: argparse.Namespace) -> None:
    """A fresh process loading packages: seconds to import torch, to load each package, to give it its
    constants (user-managed: the worker's own weights; here random tensors of the right shapes), its
    first call and, for the decode step, a CUDA graph capture and replay. The package never imports the
    project."""
    record: dict[str, Any] = {"process_start_to_main_s": round(time.perf_counter() - STARTED, 3)}
    began = time.perf_counter()
    import torch
    import torch._inductor  # noqa: F401

    record["import_torch_s"] = round(time.perf_counter() - began, 3)
    device = torch.device("cuda")
    torch.cuda.init()
    torch.empty(1, device=device)
    record["cuda_init_s"] = round(time.perf_counter() - began - record["import_torch_s"], 3)
    began = time.perf_counter()
    for module in filter(None, args.imports.split(",")):
        # A package that calls a project operator (not a Triton kernel it compiled in) needs the
        # operator's registration, e.g. SAM's dsocr::linear_gelu_tanh (model/sam_mlp.py).
        importlib.import_module(module)
    record["project_imports_s"] = round(time.perf_counter() - began, 3)
    specs = json.loads(Path(args.spec).read_text())
    results = [
        fresh_package(torch, spec, device, args.loader)
        for spec in (specs if isinstance(specs, list) else [specs])
    ]
    record["packages"] = results
    record["total_s"] = round(time.perf_counter() - STARTED, 3)
    save(Path(args.result), record)
    log(f"fresh-aoti: {json.dumps(record)[:1500]}")


def fresh_compile(args: argparse.Namespace) -> None:
    """A fresh process making the engine's decode step ready its way: the model built on the device
    (random weights: the timing is the point, and a worker has its weights already), the decode state of
    one bucket, then `torch.compile(decode_one_token, mode="reduce-overhead")` called until its CUDA
    graph replays. `--how warm`: the inductor cache (TORCHINDUCTOR_CACHE_DIR) is the build processes';
    `megacache`: an empty cache filled first from `torch.compiler.load_cache_artifacts`; `precompile`:
    dynamo's saved `aot_compile` loaded with `torch.compiler.load_compiled_function`, captured by hand."""
    record: dict[str, Any] = {"how": args.how}
    began = time.perf_counter()
    import torch

    from dsocr_workers.engine.generate import DecodeBuffers, decode_one_token
    from dsocr_workers.engine.regions import capture_graph, configure_dynamo
    from dsocr_workers.engine.result import DecodeOptions
    from dsocr_workers.engine.variants.fast import FastEngine
    from dsocr_workers.model.config import PRESETS
    from dsocr_workers.model.modeling import DeepSeekOCR

    record["imports_s"] = round(time.perf_counter() - began, 3)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    began = time.perf_counter()
    config = PRESETS[args.preset]
    with torch.inference_mode():
        with torch.device("meta"):
            model = DeepSeekOCR(config, **FastEngine().kernels())
        state = {name: fill(torch, tensor_spec(tensor) | {"dtype": "bfloat16"}, device)
                 for name, tensor in model.state_dict().items()}  # fmt: skip
        model.load_state_dict(state, strict=True, assign=True)
        with torch.device(device):
            model.language_model.rotary_emb = type(model.language_model.rotary_emb)(
                config=model.language_model.config
            )
        model = model.eval().requires_grad_(False)
    FastEngine().after_load(model)
    torch.cuda.synchronize()
    record["model_on_device_s"] = round(time.perf_counter() - began, 3)
    configure_dynamo()
    options = DecodeOptions(ignore_eos=True)
    spec = (
        json.loads((Path(args.work) / "decode.spec.json").read_text())
        if (Path(args.work) / "decode.spec.json").exists()
        else None
    )
    capacity = spec["state"][0]["shape"][0] if spec else 1024
    length = spec["length"] if spec else 100
    with torch.inference_mode():
        buffers = DecodeBuffers.allocate(model, capacity, device)
        ban = buffers.start(torch.zeros(length - 1, dtype=torch.int64, device=device), options)
        # As after a prefill: the cache filled up to the prompt, the first token appended.
        for layer in buffers.cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(length - 1)
        ban.append(torch.zeros(1, dtype=torch.int64, device=device))
    began = time.perf_counter()
    if args.how == "megacache":
        data = (Path(args.work) / "megacache.bin").read_bytes()
        attempt(record, "load_cache_artifacts", lambda: torch.compiler.load_cache_artifacts(data))
    if args.how == "precompile":

        def load() -> Any:
            with open(Path(args.work) / "decode.precompiled", "rb") as handle:
                return torch.compiler.load_compiled_function(handle)

        step = attempt(record, "load_compiled_function", load)
        if step is None:
            save(Path(args.result), record)
            return
        calls = [lambda: step(model, buffers.cache, ban, options)]
    else:
        compiled = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
        calls = [lambda: compiled(model, buffers.cache, ban, options)]
    ready_began = time.perf_counter()
    with torch.inference_mode():
        for index in range(3):

            def call() -> None:
                calls[0]()
                torch.cuda.synchronize()

            if attempt(record, f"call{index + 1}", call) is None and index == 0:
                break
        if args.how == "precompile" and "call1_error" not in record:
            holder: dict[str, Any] = {}

            def capture() -> None:
                holder["graph"], _ = capture_graph(lambda: [calls[0]()], torch.cuda.graph_pool_handle())
                torch.cuda.synchronize()

            attempt(record, "capture", capture)
            if "graph" in holder:
                record["replay_ms"] = summary_ms(step_times(holder["graph"].replay, 50))
        elif "call1_error" not in record:
            record["replay_ms"] = summary_ms(step_times(calls[0], 50))
    record["ready_s"] = round(time.perf_counter() - ready_began + record.get("load_cache_artifacts_s", 0), 3)
    record["start_to_ready_s"] = round(time.perf_counter() - began, 3)
    if hasattr(torch._dynamo.utils, "calculate_time_spent"):
        record["time_spent"] = {k: round(v, 3) for k, v in torch._dynamo.utils.calculate_time_spent().items()}
    record["total_s"] = round(time.perf_counter() - STARTED, 3)
    save(Path(args.result), record)
    log(f"fresh-compile {args.how}: {json.dumps(record)[:1500]}")


# --- the driver ------------------------------------------------------------------------------------


def child(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "a") as handle:  # the child keeps its own descriptor
        # faulthandler: a crash inside a loaded package prints the Python stack before the process dies.
        return subprocess.Popen([sys.executable, "-X", "faulthandler", __file__, *command], stdout=handle,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip


def wait(process: subprocess.Popen, deadline: float, name: str, record: dict[str, Any]) -> None:
    try:
        process.wait(timeout=max(1.0, deadline - time.perf_counter()))
        record[f"{name}_rc"] = process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        record[f"{name}_rc"] = "killed at the deadline"


def read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def run(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime())
    tag = f"aoti-{stamp}-{args.tag}" if args.tag else f"aoti-{stamp}"
    # TORCHINDUCTOR_VEC_ISA_OK=1: aoti_load_package compares the package's CPU vector ISA with this host's,
    # which inductor finds by compiling test programs: ~40 s of a fresh process's first load on the H100
    # host (a CUDA package runs no CPU kernel).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"),
           "TORCHINDUCTOR_VEC_ISA_OK": os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "1")}  # fmt: skip
    common = ["--work", str(work), "--preset", args.preset, "--device", args.device]
    common += ["--export-only"] if args.export_only else []
    deadline = STARTED + args.budget_s
    build_deadline = STARTED + args.budget_s * args.build_share
    driver: dict[str, Any] = {"command": " ".join(sys.argv), "budget_s": args.budget_s}
    processes = {}
    if "blocks" in args.sections:
        processes["blocks"] = child(["blocks", *common, "--kinds", args.kinds], work / "blocks.log", env)
    if "decode" in args.sections:
        processes["decode"] = child(["decode", *common, "--steps", str(args.steps), "--timing-steps",
                                           str(args.timing_steps), "--max-new-tokens", str(args.max_new_tokens)],
                                    work / "decode.log", env)  # fmt: skip
    for name, process in processes.items():
        wait(process, build_deadline if name == "blocks" else build_deadline, name, driver)
        log(f"{name} build finished: {driver[f'{name}_rc']}")
    fresh: dict[str, Any] = {}
    if not args.export_only:
        jobs: list[tuple[str, list[str]]] = []
        decode = read(work / "decode.json") or {}
        blocks = read(work / "blocks.json") or {}
        decode_loads = (decode.get("decode_trial_load") or {}).get("rc") == 0
        blocks_load = any(isinstance(e.get("block_trial_load"), dict) and e["block_trial_load"].get("rc") == 0
                          for e in blocks.values() if isinstance(e, dict))  # fmt: skip
        if decode_loads and (work / "decode.spec.json").exists():
            jobs += [(f"aoti_decode_{loader}", ["fresh-aoti", "--spec", str(work / "decode.spec.json"), "--loader", loader])
                     for loader in ("aoti_load_package", "direct")]  # fmt: skip
        if blocks_load and (work / "blocks.spec.json").exists():
            jobs.append(("aoti_blocks", ["fresh-aoti", "--spec", str(work / "blocks.spec.json"), "--imports",
                                         SAM_OPERATORS, "--loader", "direct"]))  # fmt: skip
        if "decode" in args.sections:
            jobs.append(("compile_warm", ["fresh-compile", "--how", "warm", *common]))
            if (work / "megacache.bin").exists():
                jobs.append(("compile_megacache", ["fresh-compile", "--how", "megacache", *common]))
            if (work / "decode.precompiled").exists():
                jobs.append(("compile_precompile", ["fresh-compile", "--how", "precompile", *common]))
        for name, command in jobs:
            if time.perf_counter() > deadline - 20:
                fresh[name] = "skipped: out of time"
                continue
            result = work / f"fresh-{name}.json"
            job_env = env
            if name == "compile_megacache":
                job_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / "megacache-empty")}
            if name == "compile_precompile":
                job_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(work / "precompile-empty")}
            process = child([*command, "--result", str(result)], work / "fresh.log", job_env)
            wait(process, min(deadline, time.perf_counter() + args.fresh_timeout_s), name, driver)
            fresh[name] = read(result) or f"no result (rc {driver[f'{name}_rc']})"
            log(f"fresh {name}: done")
    report = {"driver": driver, "decode": read(work / "decode.json"), "blocks": read(work / "blocks.json"),
              "fresh": fresh}  # fmt: skip
    save(out / f"{tag}.json", report)
    (out / f"{tag}.md").write_text(markdown(report))
    for name in ("decode.log", "blocks.log", "fresh.log"):
        if (work / name).exists():
            text = (work / name).read_text()
            (out / f"{tag}-{name.replace('.log', '')}.log").write_text(text[-2_000_000:])
    print(markdown(report))
    return 0


def markdown(report: dict[str, Any]) -> str:
    """A short table of the headline numbers (the JSON holds everything)."""
    lines = ["# AOTInductor probe", ""]
    decode = report.get("decode") or {}
    lines.append(
        f"torch {decode.get('torch')}, transformers {decode.get('transformers')}, {decode.get('gpu')}"
    )
    keys = ["load_s", "compiled_first_step_s", "compiled_ready_s", "decode_export_nonstrict_s",
            "decode_export_nonstrict_error", "decode_export_strict_s", "decode_export_strict_error",
            "decode_aoti_compile_s", "decode_aoti_compile_error", "decode_package_bytes", "decode_custom_ops",
            "decode_mutated_inputs", "decode_inplace_ops", "decode_trial_load", "decode_constants", "decode_constants_missing", "decode_load_constants_s",
            "decode_in_place", "aoti_direct_tokens_equal", "decode_capture_s", "decode_capture_error",
            "aoti_graphed_tokens_equal", "megacache_bytes", "megacache_save_error", "precompile_s",
            "precompile_error"]  # fmt: skip
    lines += ["", "## decode", "", "| what | value |", "| --- | --- |"]
    lines += [f"| {k} | {str(decode[k])[:300]} |" for k in keys if k in decode]
    for name, row in (decode.get("decode_ms_per_token") or {}).items():
        if isinstance(row, dict):
            lines.append(
                f"| ms/token {name} | median {row.get('median')} (p10 {row.get('p10')}, p90 {row.get('p90')}, n {row.get('n')}) |"
            )
    blocks = report.get("blocks") or {}
    lines += ["", "## blocks", "", "| block | export | compile s | package bytes | sizes: shape, max abs diff, AOTI ms, eager ms |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for kind in ("sam_windowed", "sam_global", "clip", "lm_dense", "lm_moe"):
        entry = blocks.get(kind)
        if not isinstance(entry, dict):
            continue
        export = entry.get("block_export_nonstrict_error") and entry.get("block_export_strict_error") or "ok"
        sizes = "; ".join(f"{r.get('shape')} {r.get('max_abs_diff'):.3g} {r.get('aoti_ms')} {r.get('eager_ms')}"
                          for r in entry.get("sizes", []) if isinstance(r, dict))  # fmt: skip
        trial = entry.get("block_trial_load")
        if isinstance(trial, dict):
            trial = f"rc {trial.get('rc')} in {trial.get('s')} s"
        export = f"{export}; trial load: {trial}"
        lines.append(f"| {kind} | {str(export)[:200]} | {entry.get('block_aoti_compile_s')} "
                     f"{entry.get('block_aoti_compile_error', '')[:200]} | {entry.get('block_package_bytes')} | {sizes} |")  # fmt: skip
    lines += ["", "## fresh processes", "", "| process | numbers |", "| --- | --- |"]
    for name, row in (report.get("fresh") or {}).items():
        if isinstance(row, dict) and "packages" in row:
            parts = [f"import torch {row.get('import_torch_s')} s, CUDA init {row.get('cuda_init_s')} s"]
            for package in row["packages"]:
                picked = {
                    k: v
                    for k, v in package.items()
                    if k.endswith("_s") or k.endswith("_error") or k == "replay_ms"
                }
                parts.append(f"{package.get('name')}: {json.dumps(picked)[:400]}")
            lines.append(f"| {name} | {'<br>'.join(parts)} |")
        elif isinstance(row, dict):
            picked = {
                k: v
                for k, v in row.items()
                if k.endswith("_s") or k.endswith("_error") or k in ("replay_ms", "time_spent")
            }
            lines.append(f"| {name} | {json.dumps(picked)[:900]} |")
        else:
            lines.append(f"| {name} | {row} |")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def shared(p: argparse.ArgumentParser) -> None:
        p.add_argument("--work", default="/tmp/aoti-work", help="packages, caches and partial results")
        p.add_argument("--preset", default="full")
        p.add_argument("--device", default="cuda:0")
        p.add_argument("--export-only", action="store_true", help="stop after torch.export (CPU checks)")

    p = sub.add_parser("run", help="build both parts at once, then the fresh processes; results into --out")
    shared(p)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="", help="appended to the result names, e.g. h100")
    p.add_argument("--sections", default="decode,blocks")
    p.add_argument("--kinds", default="lm_moe,lm_dense,sam_windowed,sam_global,clip", help="blocks to build")
    p.add_argument("--budget-s", type=float, default=560.0)
    p.add_argument(
        "--build-share", type=float, default=0.66, help="of the budget, for the two build processes"
    )
    p.add_argument("--fresh-timeout-s", type=float, default=90.0)
    p.add_argument("--steps", type=int, default=64, help="greedy steps compared token by token")
    p.add_argument("--timing-steps", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512, help="sizes the cache bucket")
    for name in ("decode", "blocks"):
        p = sub.add_parser(name)
        shared(p)
        p.add_argument("--steps", type=int, default=64)
        p.add_argument("--warm-steps", type=int, default=16)
        p.add_argument("--timing-steps", type=int, default=256)
        p.add_argument("--max-new-tokens", type=int, default=512)
        p.add_argument(
            "--kinds", default="lm_moe,lm_dense,sam_windowed,sam_global,clip", help="blocks to build"
        )
    p = sub.add_parser("fresh-aoti")
    p.add_argument("--spec", required=True)
    p.add_argument(
        "--imports", default="", help="modules to import first (operator registrations), comma-separated"
    )
    p.add_argument(
        "--loader",
        choices=("aoti_load_package", "direct"),
        default="aoti_load_package",
        help="direct: the C++ loader without the host ISA comparison (load_direct)",
    )
    p.add_argument("--result", required=True)
    p = sub.add_parser("fresh-compile")
    shared(p)
    p.add_argument("--how", choices=("warm", "megacache", "precompile"), required=True)
    p.add_argument("--result", required=True)
    args = parser.parse_args()
    if args.command == "run":
        return run(args)
    handlers = {"decode": section_decode, "blocks": section_blocks, "fresh-aoti": fresh_aoti,
                "fresh-compile": fresh_compile}  # fmt: skip
    handlers[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
