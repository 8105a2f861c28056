"""The batched engine's runner: the device side of the scheduler's plans (scheduler.py). It owns the
slotted KV cache and token state, launches a page's prefill through the session's vision and LM prefill
(whole, or in the two parts of a split prefill, its SAM features held between them) and the decode step
per bucket (eager, or compiled, by dynamo once dynamic in the bucket or ahead a package per bucket, and
replayed as a CUDA graph per bucket), and reads tokens back through a pinned ring behind the device,
timed by CUDA events placed on the host clock.

A graph's capture runs its step once uncaptured first, and that run writes the cache and the token
buffers like any step, so graphs are captured ahead (`capture`) while no slot holds a page: a free
slot's row writes only its own position 0 and token 1.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import nvtx
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import FlexKernelOptions

from dsocr_workers.engine.batched.memory import KVPlan
from dsocr_workers.engine.batched.scheduler import DecodePlan, PrefillPlan, Readback, StepPlan
from dsocr_workers.engine.batched.slots import (
    SlotAttention,
    SlotCache,
    SlotState,
    choose_tokens,
    decode_slots,
    filled_kernel_options,
    reads_filled_slots,
)
from dsocr_workers.engine.clock import NVTX_DOMAIN, StageClock
from dsocr_workers.engine.regions import Compiler, TorchCompiler, capture_graph
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.errors import InputError

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE

    from dsocr_workers.engine.profiling import StepProfiler
    from dsocr_workers.engine.session import DeepSeekOCRSession, DevicePage
    from dsocr_workers.model.interface import OCRModel

# Steps whose tokens may be in flight before the host waits for the oldest: the device keeps this many
# steps queued while the host reads one back.
READBACK_LOOKAHEAD = 2
# The ring's rows: the steps in flight, the one being launched, and one being read.
RING_ROWS = READBACK_LOOKAHEAD + 2

Mark = torch.cuda.Event | float  # a CUDA event, or a host perf_counter reading on a CPU


@dataclass(frozen=True)
class StepConfig:
    """How the decode step runs: through torch.compile with `backend` (None: eager), replayed as a CUDA
    graph per bucket, and how its attention reads the slots (slots.py `SlotAttention`)."""

    backend: str | None
    cuda_graphs: bool
    attention: SlotAttention
    # The filled attention's kernel options for a benchmark's side by side; None: the engine's rule for the
    # GPU (`filled_kernel_options`); {}: FlexAttention's own choices.
    attention_options: FlexKernelOptions | None = None

    @classmethod
    def decide(
        cls,
        session: DeepSeekOCRSession,
        compiled: bool | None = None,
        cuda_graphs: bool | None = None,
        attention: SlotAttention | None = None,
        attention_options: FlexKernelOptions | None = None,
    ) -> StepConfig:
        """None: the engine's defaults on this device (the session's engine declares what it allows).
        `compiled`: on CUDA where the engine compiles its batched step. `cuda_graphs`: on CUDA where its
        kernels allow them. `attention`: "filled" where the step is compiled on CUDA over the fast
        attention modules (fewer KV bytes read), else "masked" (FlexAttention uncompiled is slow).
        `attention_options`: the filled attention's kernel options (None: the engine's rule)."""
        engine, model = session.engine, session.model
        cuda = session.device.type == "cuda"
        compiled = (cuda and engine.compiles_batched_step) if compiled is None else compiled
        cuda_graphs = (cuda and engine.graphs_batched_step) if cuda_graphs is None else cuda_graphs
        if cuda_graphs and not cuda:
            raise InputError("CUDA graphs need a CUDA device; the batched engine runs eager on a CPU")
        if cuda_graphs and not engine.graphs_batched_step:
            raise InputError(
                f"the batched engine's CUDA graphs need kernels that read nothing back to the host; "
                f"the {engine.name} engine's do: load the session with another engine or pass "
                "cuda_graphs=False"
            )
        if attention is None:
            attention = "filled" if cuda and compiled and reads_filled_slots(model) else "masked"
        if attention == "filled" and not reads_filled_slots(model):
            raise InputError(
                f"reading only the slots' filled positions needs the fast engine's attention modules; "
                f"the {engine.name} engine's attend under a mask (attention='masked')"
            )
        if attention_options is not None and attention != "filled":
            raise InputError(f"attention_options={attention_options}: for the filled attention only")
        return cls(engine.compile_backend() if compiled else None, cuda_graphs, attention, attention_options)


@dataclass
class BucketSteps:
    """`run(n)`: one decode step over slots 0..n-1 (n a bucket); returns its chosen tokens, [n] int64 (on
    CUDA graphs, the graph's output tensor: read or copy it before the next step)."""

    model: OCRModel
    cache: SlotCache
    state: SlotState
    options: DecodeOptions
    config: StepConfig
    compiler: Compiler | None = None  # what makes the step (dynamo, packages built ahead); None: eager
    attention_options: FlexKernelOptions | None = field(init=False)  # the filled attention's kernel's
    _step: Callable[..., Tensor] = field(init=False)
    _graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = field(init=False, default_factory=dict)
    _pool: _POOL_HANDLE | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        keys = self.cache.keys[0]
        if self.config.attention_options is not None:
            self.attention_options = self.config.attention_options
        elif self.config.attention == "filled" and keys.is_cuda:
            gpu = torch.cuda.get_device_properties(keys.device)
            self.attention_options = filled_kernel_options(
                keys.shape[0] * keys.shape[1], gpu.multi_processor_count, (gpu.major, gpu.minor)
            )
        else:
            self.attention_options = None
        # fullgraph: a graph break would be a host round trip inside every step.
        self._step = (
            decode_slots
            if self.compiler is None
            else self.compiler.region("batched_step", decode_slots, fullgraph=True)
        )
        if self.config.cuda_graphs:
            self._pool = torch.cuda.graph_pool_handle()
        if self.config.attention == "filled" and isinstance(self.compiler, TorchCompiler):
            # Its batch must stay static (`FilledSlotsCache` says why), even where dynamo would make it
            # dynamic because another engine's step compiled in this process.
            for tensor in (*self.cache.keys, *self.cache.values, self.state.visible):
                torch._dynamo.mark_static(tensor)

    def _eager(self, n: int) -> Tensor:
        rows = self.state.rows(n)
        bucketed = [rows.tokens, rows.length, rows.prompt_length, rows.active]
        visible = None
        if (
            self.config.attention == "filled"
        ):  # every slot's keys and values: the attention's batch stays fixed
            keys, values = self.cache.keys, self.cache.values
            self.state.refresh_visible()  # outside the compiled step, inside its CUDA graph
            visible = self.state.visible
        else:
            keys = [k[:n] for k in self.cache.keys]
            values = [v[:n] for v in self.cache.values]
            bucketed += [*keys, *values]
        if self.compiler is not None:
            # One graph for every bucket (sizes 0 and 1 are always specialised: bucket 1 has its own). The
            # other sizes stay static: dynamo would make a capacity dynamic once an engine of another
            # capacity compiled this step in the process, and the step's kernels cannot take that.
            for tensor in bucketed:
                self.compiler.mark_dynamic(tensor, 0)
                if isinstance(self.compiler, TorchCompiler):
                    for dim in range(1, tensor.dim()):
                        torch._dynamo.mark_static(tensor, dim)
        return self._step(
            self.model, keys, values, rows, self.options, self.state.whitelist, visible, self.attention_options
        )

    def capture(self, buckets: tuple[int, ...]) -> dict[int, float]:
        """Run every bucket's step once (compiling it where it is compiled, loading a package's kernels)
        and, where graphs are on, capture it. Only while no slot holds a page: each run is a real step.
        Returns each bucket's milliseconds."""
        took: dict[int, float] = {}
        for n in buckets:
            if n in self._graphs:
                continue
            began = time.perf_counter()
            if self.config.cuda_graphs:
                assert self._pool is not None
                graph, (out,) = capture_graph(lambda n=n: [self._eager(n)], self._pool)  # type: ignore[misc]
                torch.cuda.synchronize()
                self._graphs[n] = (graph, out)
            else:
                self._eager(n)
            took[n] = (time.perf_counter() - began) * 1e3
        return took

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def run(self, n: int) -> Tensor:
        if not self.config.cuda_graphs:
            return self._eager(n)
        graph, out = self._graphs[n]
        graph.replay()
        return out


@dataclass
class _InFlight:
    """A launched step whose tokens are not on the host yet."""

    index: int
    rows: int  # tokens it chose
    ring_row: int
    start: Mark
    end: Mark
    vision_end: Mark | None = None
    copied: torch.cuda.Event | None = None  # CUDA: its tokens are in the ring once this fired
    tokens: list[int] | None = None  # read at once on a CPU


class BatchRunner:
    """Launches the scheduler's plans on the session's device and reads their tokens back."""

    def __init__(
        self, session: DeepSeekOCRSession, plan: KVPlan, options: DecodeOptions, config: StepConfig
    ) -> None:
        """Allocates the slots' cache and state and the readback ring; `capture` records the graphs."""
        self.session, self.options, self.config = session, options, config
        self.cuda = session.device.type == "cuda"
        with torch.inference_mode():
            self.cache = SlotCache.allocate(session.model, plan.slots, plan.capacity, session.device)
            self.state = SlotState.allocate(plan.slots, plan.capacity, session.device, options)
        compiler = None
        if config.backend is not None:
            compiler = session.compiler or TorchCompiler(config.backend)
        self.steps = BucketSteps(session.model, self.cache, self.state, options, config, compiler)
        self._ring = torch.zeros(RING_ROWS, plan.slots, dtype=torch.int64, pin_memory=self.cuda)
        self._ring_next = 0
        self._pending: deque[_InFlight] = deque()
        # The page between the two parts of its split prefill: its slot, inputs and SAM features.
        self._split: tuple[int, DevicePage, list[Tensor]] | None = None
        self._events: list[torch.cuda.Event] = []  # read back, free to record again
        self._domain = nvtx.get_domain(NVTX_DOMAIN)
        self._nvtx: dict[str, object] = {}
        # Vision's stage ranges (NVTX only: the step's own events time it).
        self._vision_clock = StageClock(
            session.device, nvtx_enabled=session.instrumented, timing_enabled=False, stages=session.stages
        )
        self._anchor_s = 0.0
        self._anchor: torch.cuda.Event | None = None
        self.profiler: StepProfiler | None = None  # runs its sampled steps under torch.profiler

    @property
    def cuda_graphs(self) -> bool:
        return self.config.cuda_graphs

    @property
    def attention_options(self) -> FlexKernelOptions | None:
        return self.steps.attention_options

    @property
    def captured(self) -> int:
        return self.steps.captured

    def capture(self, buckets: tuple[int, ...]) -> dict[int, float]:
        """Every bucket's graph (where graphs are on), then the clock anchor; each capture's ms."""
        with (
            torch.inference_mode()
        ):  # as every step runs: no autograd graph to trace (the expert ops have none)
            took = self.steps.capture(buckets)
        self._set_anchor()
        return took

    # --- launching ------------------------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> None:
        """Launch `plan` (its slots to clear first). Its ring row must have been read (`room`)."""
        assert len(self._pending) < RING_ROWS, "room() before a step is launched"
        # As its `batch_steps` row names it: sampled per kind, its range `batched/<kind>`.
        kind = plan.part if isinstance(plan, PrefillPlan) else "decode"
        sampled = nullcontext() if self.profiler is None else self.profiler.around(plan.index, kind)
        with torch.inference_mode(), sampled:
            if isinstance(plan, DecodePlan):
                self._decode(plan)
                return
            try:
                self._prefill(plan)
            except BaseException:
                self._split = None
                raise

    def _prefill(self, plan: PrefillPlan) -> None:
        """The page's vision and LM prefill into a scratch batch-1 cache, whose prompt keys and values go
        to the page's slot; its first token chosen from the prefill logits as on the batch-1 path. Part
        "sam" launches the upload and SAM and keeps their outputs; part "join" the rest."""
        session, page = self.session, plan.page
        with self._range(f"batched/{plan.part}"):
            start = self._mark()
            self._clear(plan.clear)
            if plan.part == "join":
                assert self._split is not None and self._split[0] == plan.slot, "join follows its sam"
                _, inputs, sam = self._split
                self._split = None
            else:
                inputs = session.upload(page)
                sam = session.encode_sam(inputs, self._vision_clock) if page.injects_image else []
            if plan.part == "sam":
                self._split = (plan.slot, inputs, sam)
                vision_end = self._mark()
                end = self._mark()
                self._launched(plan.index, inputs.input_ids.new_empty(0), start, end).vision_end = vision_end
                return
            image = session.encode_views(inputs, sam, self._vision_clock) if page.injects_image else None
            vision_end = self._mark()
            scratch = session.buffers_for(page.prompt_tokens + plan.budget).cache
            logits = session.lm_prefill(inputs, image, scratch)
            self.cache.load_prompt(plan.slot, scratch, page.prompt_tokens)
            self.state.start(plan.slot, inputs.input_ids)
            chosen = choose_tokens(logits, self.state.row(plan.slot), self.options, self.state.whitelist)
            end = self._mark()
        self._launched(plan.index, chosen, start, end).vision_end = vision_end

    def _decode(self, plan: DecodePlan) -> None:
        with self._range(f"batched/decode [bucket {plan.bucket}]"):
            start = self._mark()
            self._clear(plan.clear)
            chosen = self.steps.run(plan.bucket)
            end = self._mark()
            self._launched(plan.index, chosen, start, end)

    def _clear(self, slots: Sequence[int]) -> None:
        """The slots the step frees, inside its time: work its profile counts is work its clock times."""
        for slot in slots:
            self.state.release(slot)

    def _launched(self, index: int, chosen: Tensor, start: Mark, end: Mark) -> _InFlight:
        launch = _InFlight(index, chosen.numel(), self._ring_next, start, end)
        if self.cuda:
            self._ring[self._ring_next, : chosen.numel()].copy_(chosen, non_blocking=True)
            self._ring_next = (self._ring_next + 1) % RING_ROWS
            copied = self._mark()
            assert isinstance(copied, torch.cuda.Event)
            launch.copied = copied
        else:
            launch.tokens = chosen.tolist()
        self._pending.append(launch)
        return launch

    # --- reading back ---------------------------------------------------------------------------------

    @property
    def unread(self) -> int:
        return len(self._pending)

    def room(self) -> list[Readback]:
        """What must be read before the next launch: the ring row its tokens go to."""
        return self.collect(wait_beyond=RING_ROWS - 1)

    def collect(self, wait_beyond: int | None) -> list[Readback]:
        """Every launched step whose tokens are on the host; waits for the oldest while more than
        `wait_beyond` are in flight (None: never waits)."""
        read = []
        while self._pending:
            launch = self._pending[0]
            ready = launch.tokens is not None or (launch.copied is not None and launch.copied.query())
            if not ready and (wait_beyond is None or len(self._pending) <= wait_beyond):
                break
            self._pending.popleft()
            read.append(self._read(launch))
        return read

    def _read(self, launch: _InFlight) -> Readback:
        if launch.tokens is None:
            assert launch.copied is not None
            launch.copied.synchronize()
            launch.tokens = self._ring[launch.ring_row, : launch.rows].tolist()
        started, ended = self._time(launch.start), self._time(launch.end)
        vision_ms = (self._time(launch.vision_end) - started) * 1e3 if launch.vision_end is not None else 0.0
        for mark in (launch.start, launch.end, launch.vision_end, launch.copied):
            if isinstance(mark, torch.cuda.Event):
                self._events.append(mark)
        return Readback(launch.index, launch.tokens, started, ended, vision_ms)

    # --- clocks ---------------------------------------------------------------------------------------

    def _set_anchor(self) -> None:
        """Device events to host times: one event recorded and waited for, read against perf_counter."""
        if not self.cuda:
            return
        self.session.synchronize()
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record()
        self._anchor.synchronize()
        self._anchor_s = time.perf_counter()

    def _mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _time(self, mark: Mark) -> float:
        if isinstance(mark, float):
            return mark
        assert self._anchor is not None
        return self._anchor_s + self._anchor.elapsed_time(mark) / 1e3

    def _range(self, message: str) -> _NvtxRange:
        if not self.session.instrumented:
            return _NvtxRange(None, None)
        attributes = self._nvtx.get(message)
        if attributes is None:
            attributes = self._nvtx[message] = self._domain.get_event_attributes(message=message)
        return _NvtxRange(self._domain, attributes)


class _NvtxRange:
    """An NVTX push/pop in the `dsocr` domain around one step (nothing when instrumentation is off)."""

    def __init__(self, domain: object, attributes: object) -> None:
        self.domain, self.attributes = domain, attributes

    def __enter__(self) -> None:
        if self.domain is not None:
            self.domain.push_range(self.attributes)  # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        if self.domain is not None:
            self.domain.pop_range()  # type: ignore[attr-defined]
