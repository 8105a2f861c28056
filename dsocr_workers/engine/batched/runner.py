"""How the batched decode step runs for a bucket of n slots: eager (a CPU, or CUDA without graphs), or on
CUDA compiled once dynamic in the bucket and replayed as one CUDA graph per bucket.

Buckets are the powers of two up to the engine's slots, and the slots themselves: a step over the pages
in slots 0..k-1 runs the smallest bucket ≥ k (a free slot inside it computes a throwaway row). A
graph's capture runs its step once uncaptured first (compilation, the allocator's first use) and that
run writes the cache and the token buffers like any step, so graphs are captured ahead (`capture_all`)
while no slot holds a page: a free slot's row writes only its own position 0 and token 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dsocr_workers.engine.batched.slots import SlotAttention, SlotCache, SlotState, decode_slots
from dsocr_workers.engine.regions import capture_graph
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.model.modeling import DeepSeekOCR

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE


def buckets_for(slots: int) -> tuple[int, ...]:
    """1, 2, 4, … below `slots`, then `slots`."""
    sizes = []
    size = 1
    while size < slots:
        sizes.append(size)
        size *= 2
    return (*sizes, slots)


def bucket_of(rows: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= rows)


@dataclass
class StepRunner:
    """`run(n)`: one decode step over slots 0..n-1 (n a bucket); returns its chosen tokens, [n] int64 (on
    CUDA graphs, the graph's output tensor: read or copy it before the next step)."""

    model: DeepSeekOCR
    cache: SlotCache
    state: SlotState
    options: DecodeOptions
    buckets: tuple[int, ...]
    compiled: bool = False  # the step through torch.compile, one graph dynamic in n
    backend: str = "inductor"  # torch.compile's (a CPU test traces with "aot_eager")
    cuda_graphs: bool = False
    attention: SlotAttention = "masked"  # slots.py: "filled" with the fast engine's attention modules
    _step: Callable[..., Tensor] = field(init=False)
    _graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = field(init=False, default_factory=dict)
    _pool: _POOL_HANDLE | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # fullgraph: a graph break would be a host round trip inside every step.
        self._step = torch.compile(decode_slots, fullgraph=True, backend=self.backend) if self.compiled else decode_slots
        if self.cuda_graphs:
            self._pool = torch.cuda.graph_pool_handle()
        if self.attention == "filled":
            # Its batch must stay static (slots.py says why), even after another engine's step compiled
            # in this process (bench_serving's levels, the masked engine's bucket-sized caches).
            for tensor in (*self.cache.keys, *self.cache.values, self.state.visible):
                torch._dynamo.mark_static(tensor)

    def _eager(self, n: int) -> Tensor:
        rows = self.state.rows(n)
        bucketed = [rows.tokens, rows.length, rows.prompt_length, rows.active]
        visible = None
        if self.attention == "filled":  # every slot's keys and values: the attention's batch stays fixed
            keys, values = self.cache.keys, self.cache.values
            self.state.refresh_visible()  # outside the compiled step, inside its CUDA graph
            visible = self.state.visible
        else:
            keys = [k[:n] for k in self.cache.keys]
            values = [v[:n] for v in self.cache.values]
            bucketed += [*keys, *values]
        if self.compiled:
            # One graph for every bucket (sizes 0 and 1 are always specialised: bucket 1 has its own).
            for tensor in bucketed:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return self._step(self.model, keys, values, rows, self.options, self.state.whitelist, visible)

    def capture_all(self) -> None:
        """Capture every bucket's graph (compiling the step first where it is compiled). Only while no
        slot holds a page: each capture runs one real step first."""
        if not self.cuda_graphs:
            return
        for n in self.buckets:
            if n not in self._graphs:
                assert self._pool is not None
                graph, (out,) = capture_graph(lambda n=n: [self._eager(n)], self._pool)  # type: ignore[misc]
                self._graphs[n] = (graph, out)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def run(self, n: int) -> Tensor:
        if not self.cuda_graphs:
            return self._eager(n)
        graph, out = self._graphs[n]
        graph.replay()
        return out
