"""The fast engine's vision encoders and LM prefill, compiled one transformer block at a time (regional
compilation), and replayed as CUDA graphs.

The blocks of an encoder share one module class, so dynamo compiles each kind of block once per input
shape and every layer reuses the graph (the weights are graph inputs): far less compilation than whole
encoders (docs/benchmarks.md, cold start). A tile group's batch dimension is marked dynamic, so one graph
per block kind serves every crop grid. The LM prefill likewise, layer by layer, dynamic in the prompt
length. Called block by block, the host becomes the bound; `GraphedVision` and `GraphedPrefill` capture
a page shape's blocks (a padded prompt length's layers) once into CUDA graphs and replay them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from dsocr_workers.engine.sampling import step_key
from dsocr_workers.model.decoder import CACHE_ARGUMENT
from dsocr_workers.model.interface import OCRModel

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE

# Each compiled region is its own function, so each has its own code object and with it its own cache
# of graphs and its own recompile limit (dynamo keys both on the code object).


def _sam_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return layer(hidden)


def views_attention() -> AbstractContextManager[None]:
    """The view encoders' attention kernels: flash, memory-efficient or math, never cuDNN's, whose plans
    for each new shape make a page's first calls slow and whose steady kernels are no faster here."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _view_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with views_attention():
        return layer(hidden)


def _view_block_views(layer: Any, groups: list[torch.Tensor]) -> list[torch.Tensor]:
    with views_attention():
        return layer.forward_views(groups)


def _lm_layer(
    layer: torch.nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache_layer: StaticLayer,
) -> torch.Tensor:
    # No mask: the fused attention attends causally over the prompt it writes to `cache_layer`.
    return layer(
        hidden, attention_mask=None, position_embeddings=position_embeddings, **{CACHE_ARGUMENT: cache_layer}
    )


# Distinct view sizes × block kinds a worker meets (the fixed modes' global views and gundam's tiles,
# static and dynamic batch), with room to spare.
REGION_RECOMPILE_LIMIT = 32


def configure_dynamo() -> None:
    """dynamo's settings for the fast engine's graphs, set before its first compilation."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    # Python floats as constants: the dynamic prefill otherwise traces them as symbolic floats, then
    # specialises them and traces the whole language model again (`TensorifyScalarRestartAnalysis`).
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT)


class Compiler(Protocol):
    """What makes the fast engine's regions fast: dynamo (`TorchCompiler`), AOTInductor packages built
    ahead (engine/coldstart/aoti.py), or, in the build step, a recorder of the calls. `name` is the
    region's kind ("sam_block", "lm_layer", "decode_step", ...); `options` are torch.compile's."""

    # The decode step it makes still needs a CUDA graph around it (dynamo's reduce-overhead has one).
    decode_needs_graph: bool
    # Its regions may be captured in CUDA graphs (the recorder's run eager code, which a capture refuses).
    capturable: bool

    def region(self, name: str, function: Callable[..., Any], **options: Any) -> Callable[..., Any]: ...

    def mark_dynamic(self, tensor: torch.Tensor, dim: int) -> None: ...


def dynamo_graphs() -> int:
    """The graphs dynamo has compiled in this process: 0 where it was never imported (a start from
    packages never imports it)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0


# dynamo's and inductor's own timers that divide a compilation: dynamo's whole, its backend's (AOT
# autograd and inductor), inductor's, its code generation, loading the generated modules, and the wait
# for the kernels compiled in its pool of processes.
COMPILE_TIMERS = (
    "_compile.compile_inner",
    "OutputGraph.call_user_compiler",
    "fx_codegen_and_compile",
    "GraphLowering.codegen",
    "PyCodeCache.load_by_key_path",
    "async_compile.wait",
)


def compile_timers() -> dict[str, float]:
    """`COMPILE_TIMERS`' seconds so far in this process (dynamo's `compile_times`): {} where dynamo was
    never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    names, seconds = utils.compile_times(repr="csv", aggregate=True)
    totals = dict(zip(names, seconds, strict=True))
    return {name: float(totals[name]) for name in COMPILE_TIMERS if name in totals}


def timers_since(before: dict[str, float]) -> dict[str, float]:
    """`compile_timers()` less `before`, the timers that moved only."""
    return {name: seconds - before.get(name, 0.0) for name, seconds in compile_timers().items()
            if seconds > before.get(name, 0.0)}


@dataclass(frozen=True)
class RegionCompile:
    """A region's call that compiled new graphs: how many, and the call's host time (the compilation,
    host work, and the launch of what it compiled)."""

    region: str
    graphs: int
    seconds: float


def compiled_by_region(compiles: list[RegionCompile]) -> dict[str, tuple[int, float]]:
    """Per region, in the order first compiled: the graphs `compiles` made and their calls' seconds."""
    totals: dict[str, tuple[int, float]] = {}
    for record in compiles:
        graphs, seconds = totals.get(record.region, (0, 0.0))
        totals[record.region] = (graphs + record.graphs, seconds + record.seconds)
    return totals


@dataclass
class TorchCompiler:
    """torch.compile with `backend`, each region compiled at its first call: nothing of dynamo is set up
    until a region runs."""

    backend: str
    decode_needs_graph: bool = False
    capturable: bool = True
    # Where the calls that compile new graphs are recorded while `recording`: None outside it, so that
    # a job's calls (a decode step per token) do no bookkeeping.
    _compiles: list[RegionCompile] | None = field(default=None, init=False, repr=False)

    def region(self, name: str, function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        compiled: Callable[..., Any] | None = None

        def call(*args: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                configure_dynamo()
                compiled = torch.compile(function, backend=self.backend, **options)
            if self._compiles is None:
                return compiled(*args)
            before, began = dynamo_graphs(), time.perf_counter()
            out = compiled(*args)
            if graphs := dynamo_graphs() - before:  # dynamo recompiles a region for a new shape at any call
                self._compiles.append(RegionCompile(name, graphs, time.perf_counter() - began))
            return out

        return call

    @contextmanager
    def recording(self) -> Iterator[list[RegionCompile]]:
        """The calls that compile new graphs meanwhile, in order, in the list it yields."""
        compiles: list[RegionCompile] = []
        self._compiles = compiles
        try:
            yield compiles
        finally:
            self._compiles = None

    def mark_dynamic(self, tensor: torch.Tensor, dim: int) -> None:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


class RegionalVision:
    """`encode_sam` and `encode_views` of `model` with each block made by `compiler`, equal in function
    to the model's own methods; the view encoder's blocks are the family's (`OCRModel.view_blocks`), or
    its `encode_views` whole where it offers none. `dynamic_tiles=False`: a graph per tile count."""

    def __init__(self, model: OCRModel, compiler: Compiler, dynamic_tiles: bool = True) -> None:
        self.model = model
        self.compiler = compiler
        self.dynamic_tiles = dynamic_tiles
        self._positions: dict[tuple[int, int], torch.Tensor] = {}  # SAM's position table per patch grid
        self._sam_block = compiler.region("sam_block", _sam_block, dynamic=False)
        self._blocks = model.view_blocks()
        self._view_block = compiler.region("view_block", _view_block, dynamic=False)
        self._view_block_views = compiler.region("view_block_views", _view_block_views, dynamic=False)

    def _mark(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dynamic_tiles and hidden.shape[0] > 1:
            self.compiler.mark_dynamic(hidden, 0)
        return hidden

    def encode_sam(self, groups: list[torch.Tensor]) -> list[torch.Tensor]:
        """`encode_sam` of each view group's pixels, block by block."""
        sam = self.model.sam
        hidden = [self._embed_patches(pixels) for pixels in groups]
        for layer in sam.layers:
            hidden = [self._sam_block(layer, self._mark(group)) for group in hidden]
        return [sam.proj(sam.neck(group)) for group in hidden]

    def _embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        sam = self.model.sam
        hidden = sam.patch_embed(pixels)
        if sam.pos_embed is not None:
            grid = (hidden.shape[1], hidden.shape[2])
            if grid not in self._positions:
                # Interpolated once per view size, not an antialiased resize of the table on every call.
                self._positions[grid] = sam.interpolate_pos_encoding(*grid)
            hidden = hidden + self._positions[grid]
        return hidden

    def encode_views(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """`encode_views` of each view group's SAM features, block by block. Where the layers pack
        views, two groups (the global view and the tiles) run each layer together."""
        blocks = self._blocks
        if blocks is None:
            with views_attention():
                return [self.model.encode_views(group) for group in features]
        hidden = [blocks.enter(group) for group in features]
        for layer in blocks.layers:
            if len(hidden) > 1 and blocks.packs_views:
                hidden = self._view_block_views(layer, [self._mark(group) for group in hidden])
            else:
                hidden = [self._view_block(layer, self._mark(group)) for group in hidden]
        return [blocks.leave(group) for group in hidden]


# Prompts are padded to a multiple of this many positions for the LM prefill (a graph per padded length,
# `GraphedPrefill`): a few tens of lengths cover every mode and grid, for padding that costs little.
PREFILL_BUCKET = 64


def padded_length(length: int, capacity: int) -> int:
    """The prefill length of a `length`-token prompt in a cache of `capacity` positions."""
    return min(-(-length // PREFILL_BUCKET) * PREFILL_BUCKET, capacity)


class RegionalPrefill:
    """`generate.prefill` with each decoder layer made by `compiler`, over the prompt padded to
    `padded_length`: the same logits, the same cache for the prompt's positions and the same fill count.

    The padding changes nothing the prompt's positions compute (causal attention; every other operation
    is per position), and its keys and values land in cache slots that decoding overwrites before any
    query reads them. The layers need the fused attention (`model.fused`), which writes the cache layer
    handed to it."""

    def __init__(self, compiler: Compiler) -> None:
        self.compiler = compiler
        self._layer = compiler.region("lm_layer", _lm_layer)

    def __call__(self, model: OCRModel, embeds: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """`generate.prefill`'s contract: the last position's logits [1, V]."""
        length = embeds.shape[1]
        padded = embeds.new_zeros(1, padded_length(length, cache.get_max_length()), embeds.shape[2])
        padded[:, :length] = embeds
        return self.padded(model, padded, torch.tensor(length, device=embeds.device), cache)

    def padded(
        self, model: OCRModel, embeds: torch.Tensor, length: torch.Tensor, cache: StaticCache
    ) -> torch.Tensor:
        """The prefill of a prompt of `length` (a 0-d int64 device tensor: no host value, so a CUDA graph
        replays it for any length) padded to `embeds`' [1, P, hidden]."""
        language_model = model.language_model
        padded, device = embeds.shape[1], embeds.device
        positions = torch.arange(padded, device=device)
        # StaticLayers, as DecodeBuffers allocates them.
        cache_layers: list[StaticLayer] = cache.layers  # type: ignore[assignment]
        position_embeddings = language_model.rotary_emb(embeds, positions.unsqueeze(0))
        # Dynamic in the prompt length and the cache bucket from the first call, and only there
        # (`dynamic=True` made the hidden size a symbol, which a prompt of that length then pinned).
        for table in position_embeddings:
            self.compiler.mark_dynamic(table, 1)
        # A prefill fills the cache from slot 0 whatever it held: a graph's replay follows a job that
        # left the count at its own end, and `update` writes at the count.
        for cache_layer in cache_layers:
            cache_layer.cumulative_length.zero_()
        hidden = embeds
        for layer, cache_layer in zip(language_model.layers, cache_layers, strict=True):
            self.compiler.mark_dynamic(hidden, 1)
            hidden = self._layer(layer, hidden, position_embeddings, cache_layer)
        for cache_layer in cache_layers:  # filled up to the prompt: the next token goes to its slot
            cache_layer.cumulative_length.copy_(length)
        last = hidden.index_select(1, (length - 1).view(1))[:, 0]
        return model.logits(language_model.norm(last))


@dataclass
class _PrefillGraph:
    embeds: torch.Tensor  # [1, P, hidden], the prompt then zeros
    length: torch.Tensor  # 0-d int64
    cache: StaticCache  # the graph writes this cache's tensors
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class GraphedPrefill:
    """`RegionalPrefill` replayed as a CUDA graph per padded prompt length and cache bucket: layer by
    layer, the prefill costs more host time than device time. A new length is captured at its first
    call (counted in `captured`) or ahead (`capture`). One memory pool: replays run one at a time and
    return copies."""

    def __init__(self, regions: RegionalPrefill) -> None:
        self.regions = regions
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _PrefillGraph] = {}  # (padded length, id of the cache)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def _graph(self, model: OCRModel, padded: int, cache: StaticCache) -> _PrefillGraph:
        key = (padded, id(cache))
        found = self._graphs.get(key)
        if found is not None and found.cache is cache:
            return found
        weight = model.lm_head.weight
        embeds = torch.zeros(1, padded, weight.shape[1], device=weight.device, dtype=weight.dtype)
        length = torch.tensor(padded, device=embeds.device)
        graph, (logits,) = capture_graph(
            lambda: [self.regions.padded(model, embeds, length, cache)], self._pool
        )
        self._graphs[key] = _PrefillGraph(embeds, length, cache, graph, logits)
        return self._graphs[key]

    def capture(self, model: OCRModel, length: int, cache: StaticCache) -> None:
        """Capture the graph a `length`-token prompt into `cache` will replay, if it is new."""
        self._graph(model, padded_length(length, cache.get_max_length()), cache)

    def __call__(self, model: OCRModel, embeds: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """`generate.prefill`'s contract: the last position's logits [1, V]."""
        length = embeds.shape[1]
        found = self._graph(model, padded_length(length, cache.get_max_length()), cache)
        found.embeds[:, :length].copy_(embeds)
        found.embeds[:, length:].zero_()
        found.length.fill_(length)
        found.graph.replay()
        return found.logits.clone()


def capture_graph(
    run: Callable[[], list[torch.Tensor]], pool: _POOL_HANDLE
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """`run` captured as a CUDA graph in `pool`, after one uncaptured call; the graph and the outputs
    of the captured call (replays overwrite them)."""
    run()  # compiles what is new and settles the allocator: nothing may compile during a capture
    graph = torch.cuda.CUDAGraph()
    # Captured as `torch.cuda.graph` does, less its emptying of the allocators' caches at every capture:
    # a warm-up captures dozens of graphs in a row, and each emptying made the next jobs allocate anew.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    # cuBLAS keeps per-stream workspaces outside any graph pool, which inductor's graph trees free when
    # they record; cleared before and after, as the graph trees do, the capture allocates its own
    # workspace in this pool (otherwise a replay may run into freed memory).
    torch._C._cuda_clearCublasWorkspaces()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                outputs = run()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
    finally:
        torch._C._cuda_clearCublasWorkspaces()
    return graph, outputs


@dataclass
class _PageGraphs:
    """The CUDA graphs of one page shape: SAM over every view group, then the view encoder over SAM's
    outputs."""

    pixels: list[torch.Tensor]
    sam: torch.cuda.CUDAGraph
    sam_out: list[torch.Tensor]
    views: torch.cuda.CUDAGraph | None = None
    views_out: list[torch.Tensor] | None = None


class GraphedVision:
    """`RegionalVision` replayed as CUDA graphs, one pair (SAM, view encoder) per page shape:
    `sam(groups)` for all of a page's view groups, then `views(features)` with the list `sam` returned.

    A new shape runs the compiled blocks once and is then captured; replays copy the pixels into the
    graph's inputs. All graphs share one memory pool: they replay one at a time on one stream, each
    captured while the outputs before it were alive, so a replay never overwrites another's outputs."""

    def __init__(self, regions: RegionalVision) -> None:
        self.regions = regions
        self._pool = torch.cuda.graph_pool_handle()
        self._pages: dict[tuple[torch.Size, ...], _PageGraphs] = {}
        self._current: _PageGraphs | None = None

    def sam(self, groups: list[torch.Tensor]) -> list[torch.Tensor]:
        key = tuple(group.shape for group in groups)
        page = self._pages.get(key)
        if page is None:
            pixels = [group.clone() for group in groups]
            graph, outputs = capture_graph(lambda: self.regions.encode_sam(pixels), self._pool)
            page = self._pages[key] = _PageGraphs(pixels, graph, outputs)
        else:
            for static, group in zip(page.pixels, groups, strict=True):
                static.copy_(group)
        page.sam.replay()
        self._current = page
        return list(page.sam_out)

    def views(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        page = self._current
        if (
            page is None
            or len(features) != len(page.sam_out)
            or any(f.data_ptr() != s.data_ptr() for f, s in zip(features, page.sam_out, strict=True))
        ):
            raise RuntimeError("GraphedVision.views takes the features its last sam() call returned")
        if page.views is None:
            page.views, page.views_out = capture_graph(
                lambda: self.regions.encode_views(page.sam_out), self._pool
            )
        page.views.replay()
        assert page.views_out is not None
        return list(page.views_out)


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    token: torch.Tensor


@dataclass
class GraphedDecode:
    """A decode step that is not a CUDA graph itself (an AOTInductor runner: engine/coldstart/aoti.py)
    replayed as one per cache bucket and n-gram state, as dynamo's reduce-overhead mode replays its own.

    The capture's uncaptured first call advances the decode state; its counters (token count, cache
    fill counts) are put back after it, so that the replay that follows makes that step again."""

    step: Callable[..., torch.Tensor]
    _pool: Any = field(default_factory=lambda: torch.cuda.graph_pool_handle())
    _graphs: dict[tuple, _DecodeGraph] = field(default_factory=dict)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def __call__(self, model: OCRModel, cache: StaticCache, ban: Any, options: Any) -> torch.Tensor:
        key = (id(cache), id(ban), step_key(options))
        found = self._graphs.get(key)
        if found is None:
            counters = [
                ban.length,
                *(
                    t
                    for layer in cache.layers
                    for t in vars(layer).values()
                    if isinstance(t, torch.Tensor) and t.dim() == 0
                ),
            ]
            saved = [counter.clone() for counter in counters]
            graph, (token,) = capture_graph(lambda: [self.step(model, cache, ban, options)], self._pool)
            for counter, value in zip(counters, saved, strict=True):
                counter.copy_(value)
            found = self._graphs[key] = _DecodeGraph(graph, token)
        found.graph.replay()
        return found.token
