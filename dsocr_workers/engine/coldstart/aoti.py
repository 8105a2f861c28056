"""The fast engine's regions as AOTInductor packages: built ahead of time (`dsocr precompile`), loaded at a
worker's start with no dynamo, no tracing and no compiler.

A region is what the fast engine compiles (engine/regions.py `Compiler`): a SAM or CLIP block per view
size, CLIP over a page's two view groups, an LM prefill layer (dense or MoE), the decode step, and the
batched engine's step over its slots (engine/batched/slots.py `decode_slots`: a package per bucket).
`Recorder` stands in for dynamo while the warm-up's pages run eagerly once, keeping each region kind and
shape met (its `key`) with its first call's arguments; `build_package` exports each with its state and
its weights as inputs (one package serves every layer of a kind), the dimensions jobs vary dynamic.
`PackagedRegions` opens each package with its C++ loader and runs it in place on the caller's cache and
buffers; a shape nothing was built for falls back to dynamo (the job then reads "compiled").
The packages call `dsocr::linear_gelu_tanh` (model/sam_mlp.py); the Triton operators are compiled in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsocr_workers.engine.batched.slots import SlotRows
from dsocr_workers.engine.coldstart.plan import CompilePlan
from dsocr_workers.engine.generate import MIN_CACHE_BUCKET
from dsocr_workers.engine.regions import PREFILL_BUCKET, Compiler, views_attention
from dsocr_workers.engine.sampling import step_key
from dsocr_workers.model.config import dtype_name
from dsocr_workers.model.grouped_experts import blocks_for, tokens_for

log = logging.getLogger(__name__)

Tensor = torch.Tensor


@dataclass(frozen=True)
class Limits:
    """The ranges of a plan's dynamic dimensions: tiles per page, positions of the model."""

    max_crops: int
    max_positions: int


def _tensor_slots(owner: object) -> list[str]:
    """The tensor attributes of a cache layer or an n-gram state, in a fixed order."""
    return [name for name, value in sorted(vars(owner).items()) if isinstance(value, Tensor)]


@contextmanager
def _swapped(slots: list[tuple[object, str]], tensors: list[Tensor]) -> Iterator[None]:
    saved = [getattr(owner, name) for owner, name in slots]
    try:
        for (owner, name), tensor in zip(slots, tensors, strict=True):
            setattr(owner, name, tensor)
        yield
    finally:
        for (owner, name), tensor in zip(slots, saved, strict=True):
            setattr(owner, name, tensor)


def _shape(tensor: Tensor) -> list[int]:
    return list(tensor.shape[1:])


class _Region(ABC):
    """How one kind of region's call is flattened into a package's inputs and back."""

    name: str
    prefixes: tuple[str, ...] = ()  # the weights: the module's tensors under these names (empty: all)

    @abstractmethod
    def key(self, args: tuple, dynamic_tiles: bool) -> dict: ...

    @abstractmethod
    def state(self, args: tuple) -> list[Tensor]: ...

    @abstractmethod
    def holding(self, args: tuple, state: list[Tensor]) -> AbstractContextManager[tuple]:
        """`args` with `state` in the place of the call's own tensors."""

    @abstractmethod
    def dynamic(self, args: tuple, limits: Limits, dynamic_tiles: bool) -> list[dict | None]: ...

    def attention(self) -> AbstractContextManager[None]:
        """The attention kernels its export may choose (the region's own choice is made again when the
        exported graph is decomposed, outside the region's function)."""
        return nullcontext()

    @staticmethod
    def flatten(out: Any) -> tuple[Tensor, ...]:
        return (out,)

    @staticmethod
    def unflatten(flat: list[Tensor]) -> Any:
        return flat[0]


def _tiles(batch: int, dynamic_tiles: bool) -> int | str:
    return "tiles" if dynamic_tiles and batch > 1 else batch


def _tile_dim(limits: Limits) -> Any:
    return torch.export.Dim("tiles", min=2, max=max(limits.max_crops, 3))


class _Block(_Region):
    """A SAM or view encoder block: `function(layer, hidden)`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def key(self, args: tuple, dynamic_tiles: bool) -> dict:
        layer, hidden = args
        kind = (
            ("windowed" if getattr(layer, "window_size", 0) > 0 else "global")
            if self.name == "sam_block"
            else ""
        )
        return {"kind": kind, "views": [[_tiles(hidden.shape[0], dynamic_tiles), *_shape(hidden)]]}

    def state(self, args: tuple) -> list[Tensor]:
        return [args[1]]

    @contextmanager
    def holding(self, args: tuple, state: list[Tensor]) -> Iterator[tuple]:
        yield args[0], state[0]

    def dynamic(self, args: tuple, limits: Limits, dynamic_tiles: bool) -> list[dict | None]:
        return [{0: _tile_dim(limits)} if _tiles(args[1].shape[0], dynamic_tiles) == "tiles" else None]

    def attention(self) -> AbstractContextManager[None]:
        return nullcontext() if self.name == "sam_block" else views_attention()


class _ViewGroups(_Region):
    """A view encoder's block over a page's view groups at once: `function(layer, groups)`."""

    name = "view_block_views"

    def key(self, args: tuple, dynamic_tiles: bool) -> dict:
        return {"views": [[_tiles(group.shape[0], dynamic_tiles), *_shape(group)] for group in args[1]]}

    def state(self, args: tuple) -> list[Tensor]:
        return list(args[1])

    @contextmanager
    def holding(self, args: tuple, state: list[Tensor]) -> Iterator[tuple]:
        yield args[0], list(state)

    def dynamic(self, args: tuple, limits: Limits, dynamic_tiles: bool) -> list[dict | None]:
        tiles = _tile_dim(limits)
        return [{0: tiles} if _tiles(group.shape[0], dynamic_tiles) == "tiles" else None for group in args[1]]

    def attention(self) -> AbstractContextManager[None]:
        return views_attention()

    @staticmethod
    def flatten(out: Any) -> tuple[Tensor, ...]:
        return tuple(out)

    @staticmethod
    def unflatten(flat: list[Tensor]) -> Any:
        return list(flat)


def _positions_dim(limits: Limits, tokens: tuple[int, int | None] = (1, None)) -> Any:
    """The padded prompt lengths (multiples of `PREFILL_BUCKET`) within `tokens`' [low, high] as a
    dimension; None where a single length is in range (the dimension static)."""
    low, high = tokens
    most = limits.max_positions // PREFILL_BUCKET
    first = -(-low // PREFILL_BUCKET)
    last = max(most, 2) if high is None else min(most, high // PREFILL_BUCKET)  # a dimension spans two
    if first >= last:
        return None
    return PREFILL_BUCKET * torch.export.Dim("blocks", min=first, max=last)


def _capacity_dim(limits: Limits) -> Any:
    return torch.export.Dim(
        "capacity", min=min(MIN_CACHE_BUCKET, limits.max_positions), max=limits.max_positions
    )


def _routing(layer: Any) -> tuple[int, int] | None:
    """The MoE layer's experts a token takes and its routed experts (None: a dense layer). Its grouped
    experts kernels' blocks follow from them and the prompt's length as the kernels are traced, so a
    package holds one block size."""
    experts = getattr(layer.mlp, "experts", None)
    return None if experts is None else (layer.mlp.config.num_experts_per_tok, experts.num_experts)


class _LmLayer(_Region):
    """An LM prefill layer: `function(layer, hidden, (cos, sin), cache_layer)`, writing the cache layer. A
    package per kind of layer, and for the MoE layer per block size of its grouped experts kernels, over
    the prompt lengths that choose it."""

    name = "lm_layer"

    def key(self, args: tuple, dynamic_tiles: bool) -> dict:
        layer, hidden = args[0], args[1]
        key: dict[str, str | int] = {"kind": type(layer.mlp).__name__}
        if routing := _routing(layer):
            key["expert_block_pairs"] = blocks_for(hidden.shape[1] * routing[0], routing[1]).gate_up.m
        return key

    def state(self, args: tuple) -> list[Tensor]:
        _, hidden, (cos, sin), cache_layer = args
        return [hidden, cos, sin, *(getattr(cache_layer, name) for name in _tensor_slots(cache_layer))]

    @contextmanager
    def holding(self, args: tuple, state: list[Tensor]) -> Iterator[tuple]:
        layer, _, _, cache_layer = args
        with _swapped([(cache_layer, name) for name in _tensor_slots(cache_layer)], state[3:]):
            yield layer, state[0], (state[1], state[2]), cache_layer

    def dynamic(self, args: tuple, limits: Limits, dynamic_tiles: bool) -> list[dict | None]:
        layer, hidden = args[0], args[1]
        tokens: tuple[int, int | None] = (1, None)
        if routing := _routing(layer):
            top_k, experts = routing
            tokens = tokens_for(blocks_for(hidden.shape[1] * top_k, experts), top_k, experts)
        positions, capacity = _positions_dim(limits, tokens), _capacity_dim(limits)
        cache = [{2: capacity} if tensor.dim() >= 3 else None for tensor in self.state(args)[3:]]
        prompt = {1: positions} if positions is not None else None
        return [prompt, prompt, prompt, *cache]


class _DecodeStep(_Region):
    """The decode step: `function(model, cache, ban, options)`, writing the token buffer, its counters and
    the cache; the options are the package's (a package per `step_key`)."""

    name = "decode_step"
    prefixes = ("language_model.", "lm_head.")

    def key(self, args: tuple, dynamic_tiles: bool) -> dict:
        return {"options": list(step_key(args[3]))}

    @staticmethod
    def _slots(args: tuple) -> list[tuple[object, str]]:
        _, cache, ban, _ = args
        slots: list[tuple[object, str]] = [
            (ban, name)
            for name in ("tokens", "length", "prompt_length", "whitelist")
            if getattr(ban, name) is not None
        ]
        return slots + [(layer, name) for layer in cache.layers for name in _tensor_slots(layer)]

    def state(self, args: tuple) -> list[Tensor]:
        return [getattr(owner, name) for owner, name in self._slots(args)]

    @contextmanager
    def holding(self, args: tuple, state: list[Tensor]) -> Iterator[tuple]:
        with _swapped(self._slots(args), state):
            yield args

    def dynamic(self, args: tuple, limits: Limits, dynamic_tiles: bool) -> list[dict | None]:
        capacity = _capacity_dim(limits)
        dims: list[dict | None] = []
        for (owner, name), tensor in zip(self._slots(args), self.state(args), strict=True):
            if name == "tokens":
                dims.append({0: capacity})
            else:
                dims.append({2: capacity} if tensor.dim() >= 3 and owner is not args[2] else None)
        return dims


class _BatchedStep(_Region):
    """The batched engine's step: `function(model, keys, values, rows, options, whitelist, visible,
    attention_options)`, writing the slots' tokens, lengths and cache. A package per bucket, every shape static:
    a bucket range dynamic in its row count meets the experts' switch from their GEMV kernels to the
    grouped GEMM (model/selected_experts.py), which an export cannot guard on. The options and the
    attention kernel's options are the package's."""

    name = "batched_step"
    prefixes = ("language_model.", "lm_head.")

    def key(self, args: tuple, dynamic_tiles: bool) -> dict:
        _, keys, _, rows, options, _, visible, attention_options = args
        return {
            "rows": rows.length.shape[0],
            "slots": keys[0].shape[0],  # "filled": every slot's cache; "masked": the bucket's
            "capacity": keys[0].shape[2],
            "attention": "masked" if visible is None else "filled",
            "attention_options": attention_options,
            "options": list(step_key(options)),
        }

    def state(self, args: tuple) -> list[Tensor]:
        _, keys, values, rows, _, whitelist, visible, _ = args
        extra = [tensor for tensor in (visible, whitelist) if tensor is not None]
        return [rows.tokens, rows.length, rows.prompt_length, rows.active, *keys, *values, *extra]

    @contextmanager
    def holding(self, args: tuple, state: list[Tensor]) -> Iterator[tuple]:
        model, keys, _, _, options, whitelist, visible, attention_options = args
        layers = len(keys)
        rest = iter(state[4 + 2 * layers :])
        visible = next(rest) if visible is not None else None
        whitelist = next(rest) if whitelist is not None else None
        rows = SlotRows(*state[:4])
        cache = state[4 : 4 + layers], state[4 + layers : 4 + 2 * layers]
        yield model, *cache, rows, options, whitelist, visible, attention_options

    def dynamic(self, args: tuple, limits: Limits, dynamic_tiles: bool) -> list[dict | None]:
        return [None] * len(self.state(args))


REGIONS: dict[str, _Region] = {
    region.name: region
    for region in (
        _Block("sam_block"), _Block("view_block"), _ViewGroups(), _LmLayer(), _DecodeStep(), _BatchedStep()
    )
}


def region_key(name: str, args: tuple, dtype: torch.dtype, dynamic_tiles: bool) -> str:
    """The package a call of region `name` needs, as text: the same in the build and at load."""
    key = {"region": name, "dtype": dtype_name(dtype), **REGIONS[name].key(args, dynamic_tiles)}
    return json.dumps(key, sort_keys=True)


def weights_of(name: str, args: tuple) -> list[tuple[str, Tensor]]:
    """The region's weights, named, in the order its package takes them: the parameters, then the buffers
    of its module (the layer; for the decode step the language model and its head)."""
    module, prefixes = args[0], REGIONS[name].prefixes
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(n, t) for n, t in named if not prefixes or n.startswith(prefixes)]


def _dtype_of(args: tuple) -> torch.dtype:
    return next(args[0].parameters()).dtype


# --- building ---------------------------------------------------------------------------------------


@dataclass
class RecordedCall:
    name: str
    function: Callable[..., Any]
    args: tuple  # the first call's arguments (its modules, cache and n-gram objects)
    # Its tensors as they were before the call, copied; one copy of a tensor several calls share (the
    # batched step's KV cache, met once per bucket), as the first of them met it: an export reads shapes.
    state: list[Tensor]


@dataclass
class Recorder:
    """A `Compiler` for the build step: runs every region eagerly and keeps the first call of each key."""

    dynamic_tiles: bool = True
    calls: dict[str, RecordedCall] = field(default_factory=dict)
    decode_needs_graph: bool = False
    capturable: bool = False
    # The copies by the tensor they copy (its address and layout), with that tensor kept alive so that
    # no other takes its address: a copy per bucket of a full batch's KV cache would not fit.
    copies: dict[tuple, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def region(self, name: str, function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            key = region_key(name, args, _dtype_of(args), self.dynamic_tiles)
            if key not in self.calls:
                state = [self._copy(tensor) for tensor in REGIONS[name].state(args)]
                self.calls[key] = RecordedCall(name, function, args, state)
            return function(*args)

        return call

    def _copy(self, tensor: Tensor) -> Tensor:
        layout = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if layout not in self.copies:
            with torch.inference_mode(False):  # plain tensors: export traces them under no_grad
                self.copies[layout] = (tensor, tensor.clone())
        return self.copies[layout][1]

    def mark_dynamic(self, tensor: Tensor, dim: int) -> None:
        pass


class _Exported(torch.nn.Module):
    """A recorded call as a module of its tensors: `forward(*state, *weights)`, the weights swapped into
    the call's module for the call (the module itself is not this one's state: nothing else is lifted)."""

    def __init__(self, call: RecordedCall, names: list[str]) -> None:
        super().__init__()
        self.call, self.names, self.count = call, names, len(call.state)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        region, call = REGIONS[self.call.name], self.call
        state, weights = list(inputs[: self.count]), inputs[self.count :]
        from torch.nn.utils.stateless import _reparametrize_module

        with (
            _reparametrize_module(call.args[0], dict(zip(self.names, weights, strict=True))),
            region.holding(call.args, state) as args,
        ):
            return region.flatten(call.function(*args))


def package_name(key: str) -> str:
    region = json.loads(key)["region"]
    return f"{region}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt2"


def build_package(call: RecordedCall, limits: Limits, dynamic_tiles: bool, path: Path) -> Path:
    """Export the recorded call and compile it into the package `path`, which appears whole or not at
    all (a build cut short leaves no package another build would take for done)."""
    named = weights_of(call.name, call.args)
    with torch.no_grad(), REGIONS[call.name].attention():
        weights = [tensor.clone() for _, tensor in named]  # plain tensors (a preset's are inference tensors)
        state = [tensor.clone() for tensor in call.state]
        dynamic = REGIONS[call.name].dynamic(call.args, limits, dynamic_tiles) + [None] * len(weights)
        exported = torch.export.export(
            _Exported(call, [name for name, _ in named]),
            tuple(state + weights),
            dynamic_shapes=(tuple(dynamic),),
            strict=False,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
    return path


def remove_partial_packages(folder: Path) -> list[Path]:
    """Remove the partial packages in `folder` whose builder process is gone (a build killed before it
    could remove its own); a live builder's is left alone. Returns what was removed."""
    removed = []
    for partial in folder.glob(".*.pt2"):
        pid = partial.stem.rpartition(".")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0 is not sent: only whether the process exists
        except ProcessLookupError:
            partial.unlink(missing_ok=True)
            removed.append(partial)
        except PermissionError:  # it exists, under another user
            pass
    return removed


# --- loading ----------------------------------------------------------------------------------------


def load_package(path: Path, device: torch.device) -> Any:
    """The package's runner, from its C++ loader: `aoti_load_package` would first check the host's CPU
    vector ISA by compiling test programs, slow at every start and moot for packages that run no CPU
    kernel (the artifact key is the check that matters). Single-threaded: the runner pool's own stream
    synchronisation is refused inside a CUDA graph capture, and a session runs one region at a time."""
    index = device.index if device.type == "cuda" and device.index is not None else -1
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, index)


# A child that opens packages as a worker does: with the engines' modules imported, which register the
# operators the packages call.
_OPEN_PACKAGES = """
import sys, torch
from pathlib import Path
import dsocr_workers.engine.session, dsocr_workers.engine.variants.fast
from dsocr_workers.engine.coldstart.aoti import load_package
for path in sys.argv[2:]:
    load_package(Path(path), torch.device(sys.argv[1]))
    print(path, flush=True)
"""


@dataclass(frozen=True)
class LoadCheck:
    """Packages opened in a child process: those not shown to load (the first that failed and the ones
    after it) and why. A package whose wrapper crashes its loader (one built by a C++ compiler whose
    packages do not load: docs/architecture.md) kills the child, not the caller."""

    not_loaded: tuple[Path, ...]
    reason: str


def check_packages_load(paths: list[Path], device: torch.device) -> LoadCheck:
    child = subprocess.run(
        [sys.executable, "-c", _OPEN_PACKAGES, str(device), *map(str, paths)], capture_output=True, text=True
    )
    if child.returncode == 0:
        return LoadCheck((), "")
    opened = {line.strip() for line in child.stdout.splitlines()}  # an import's own print is no path
    loaded = sum(str(path) in opened for path in paths)
    if child.returncode < 0:
        reason = f"its loader was killed by {signal.Signals(-child.returncode).name}"
    else:
        lines = child.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"exit status {child.returncode}"
    return LoadCheck(tuple(paths[loaded:]), reason)


@dataclass
class PackagedRegions:
    """A `Compiler` whose regions run the packages built for them (`packages`: key → loaded runner);
    a key without a package runs through `fallback` (dynamo) and is named in `missed`."""

    packages: dict[str, Any]
    fallback: Compiler
    plan: CompilePlan | None = None  # the plan whose manifest listed them
    dynamic_tiles: bool = True
    missed: list[str] = field(default_factory=list)
    decode_needs_graph: bool = True
    capturable: bool = True

    @classmethod
    def load(
        cls,
        paths: dict[str, Path],
        device: torch.device,
        fallback: Compiler,
        plan: CompilePlan | None = None,
        dynamic_tiles: bool = True,
    ) -> PackagedRegions:
        packages = {key: load_package(path, device) for key, path in paths.items()}
        return cls(packages, fallback, plan, dynamic_tiles)

    def add(self, paths: dict[str, Path], device: torch.device) -> int:
        """Open those of `paths` not open yet (another plan's, its regions' shapes the same); how many."""
        new = {key: path for key, path in paths.items() if key not in self.packages}
        self.packages.update({key: load_package(path, device) for key, path in new.items()})
        return len(new)

    def region(self, name: str, function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        region = REGIONS[name]
        weights: dict[int, list[Tensor]] = {}  # per module: its weights in the package's order
        compiled: Callable[..., Any] | None = None

        def call(*args: Any) -> Any:
            nonlocal compiled
            key = region_key(name, args, _dtype_of(args), self.dynamic_tiles)
            runner = self.packages.get(key)
            if runner is None:
                if key not in self.missed:
                    log.warning("no AOTInductor package for %s: compiled with dynamo", key)
                    self.missed.append(key)
                compiled = compiled or self.fallback.region(name, function, **options)
                return compiled(*args)
            found = weights.get(id(args[0]))
            if found is None:
                found = weights[id(args[0])] = [tensor for _, tensor in weights_of(name, args)]
            return region.unflatten(runner.boxed_run([*region.state(args), *found]))

        return call

    def mark_dynamic(self, tensor: Tensor, dim: int) -> None:
        pass
