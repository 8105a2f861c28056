"""`BatchedEngine`: up to `slots` pages decoding together on one loaded session, pages joining between
decode steps and leaving when they finish (continuous batching).

    engine = BatchedEngine.create(session, max_batch=32, max_prompt_tokens=1280, max_new_tokens=1024)
    slot = engine.add(PageRequest("p1", session.prepare(image, None, "gundam", 9)))  # its prefill runs now
    engine.submit(PageRequest("p2", page2))      # or: queued, admitted by the next step() with a free slot
    while engine.busy:
        events = engine.step()                   # joins, one decode step, what was read back
        for output in events.finished: ...       # BatchedOutput: tokens, stop reason, metrics

A page's prefill is its own step: the session's vision and LM prefill (its compiled regions and graphs),
into a scratch batch-1 cache whose prompt keys and values go to the page's slot; its first token is
chosen from the prefill logits as on the batch-1 path. A decode step runs the bucket that covers the
occupied slots (engine/batched/runner.py). Tokens come back without stalling the device: each step's
tokens are copied to pinned host memory behind it with an event, read once the event fired, waited
for only when `READBACK_LOOKAHEAD` newer steps are queued. A page leaves at EOS (seen in the tokens read
back: the steps launched meanwhile are counted as wasted, as the batch-1 path's steps past EOS), at its
token budget (known on the host: its slot is free once its last step is launched) or, when asked, at a
repetition loop (engine/loops.py, with the batch-1 path's cadence). Greedy tokens of a page equal its
batch-1 tokens (tests/engine/test_batched.py).

The batch-1 path (`DeepSeekOCRSession.run_inference`) is untouched and stays the default; this engine
only reads the session's model, runners and page preparation. Its own scratch caches are the session's
cache buckets.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import nvtx
import torch

from dsocr_workers.engine.batched.memory import DEFAULT_RESERVE_BYTES, KVPlan, plan_kv
from dsocr_workers.engine.batched.metrics import SequenceMetrics, StepKind, StepRecord
from dsocr_workers.engine.batched.runner import StepRunner, bucket_of, buckets_for
from dsocr_workers.engine.batched.slots import (
    SlotAttention,
    SlotCache,
    SlotState,
    choose_tokens,
    reads_filled_slots,
)
from dsocr_workers.engine.result import DecodeOptions, StopReason
from dsocr_workers.engine.sampling import validate_options
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.stages import NVTX_DOMAIN, StageClock
from dsocr_workers.engine.stopping import ends_in_loop, loop_check_due, stop_reason
from dsocr_workers.errors import InputError
from dsocr_workers.model.preprocess import PreparedPage

# Steps whose tokens may be in flight before the host waits for the oldest: the device keeps this many
# steps queued while the host reads one back.
READBACK_LOOKAHEAD = 2


class NoFreeSlot(RuntimeError):
    """`add` with every slot taken: `submit` queues instead."""


@dataclass(frozen=True)
class PageRequest:
    """A prepared page for the batched engine. `max_new_tokens` None: the engine's budget.
    `arrival_s`: when it arrived (perf_counter; None: when handed to the engine)."""

    request_id: str
    page: PreparedPage
    max_new_tokens: int | None = None
    arrival_s: float | None = None


@dataclass(frozen=True)
class BatchedOutput:
    """One finished page."""

    request_id: str
    token_ids: list[int]
    stop_reason: StopReason
    prompt_tokens: int
    image_tokens: int
    crop_grid: tuple[int, int]
    mode: str
    wasted_steps: int  # decode steps computed for it after its end (EOS seen late, a loop)
    metrics: SequenceMetrics


@dataclass(frozen=True)
class TokenEvent:
    """Tokens of one page read back in a step() call; `at_s`: when the last of them was produced."""

    request_id: str
    tokens: tuple[int, ...]
    at_s: float


@dataclass(frozen=True)
class StepEvents:
    """What one step() call did and learnt: pages admitted (request, slot), tokens read back, pages
    finished."""

    admitted: tuple[tuple[str, int], ...]
    tokens: tuple[TokenEvent, ...]
    finished: tuple[BatchedOutput, ...]


@dataclass
class _Sequence:
    request: PageRequest
    slot: int
    budget: int
    ceiling: int
    metrics: SequenceMetrics
    tokens: list[int] = field(default_factory=list)
    launched: int = 0  # decode steps launched for it
    stop_reason: StopReason | None = None
    wasted: int = 0

    @property
    def done(self) -> bool:
        return self.stop_reason is not None


@dataclass
class _Launch:
    """A step launched on the device, its tokens not yet read back."""

    index: int
    kind: StepKind
    occupants: list[tuple[int, _Sequence]]  # (row of the step's tokens, page)
    bucket: int
    ring_row: int
    start: torch.cuda.Event | float
    end: torch.cuda.Event | float
    vision_end: torch.cuda.Event | float | None = None
    copied: torch.cuda.Event | None = None  # CUDA: its tokens are in the ring once this fired
    tokens: list[int] | None = None  # read at once on a CPU
    prompt_tokens: int = 0


class BatchedEngine:
    """Continuous batching over a session's model: `add`/`submit` pages, `step()` until not `busy`."""

    def __init__(
        self, session: DeepSeekOCRSession, plan: KVPlan, options: DecodeOptions | None = None,
        compiled: bool | None = None, cuda_graphs: bool | None = None, backend: str = "inductor",
        attention: SlotAttention | None = None,
    ) -> None:  # fmt: skip
        """`compiled`: the decode step through torch.compile (`backend`); None: on CUDA with the fast
        engine. `cuda_graphs`: replayed as a CUDA graph per bucket; None: on CUDA. `attention`: how a
        decode step reads the slots (engine/batched/slots.py): "filled" needs the fast engine's attention
        modules; None: "filled" where the step is compiled on CUDA with them (a 14% shorter step at
        concurrency 64 on an H100, docs/benchmarks.md), else "masked" (FlexAttention uncompiled is
        its reference implementation, slower than SDPA)."""
        options = options or DecodeOptions()
        validate_options(options)
        if options.seed is not None:
            torch.manual_seed(options.seed)
        cuda = session.device.type == "cuda"
        cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        compiled = (cuda and session.engine == "fast") if compiled is None else compiled
        if cuda_graphs and not cuda:
            raise InputError("CUDA graphs need a CUDA device; the batched engine runs eager on a CPU")
        if cuda_graphs and session.engine != "fast":
            raise InputError(f"the batched engine's CUDA graphs need the fast engine's kernels (the {session.engine} "
                             "engine's routed experts read counts back to the host); load the session with "
                             "engine='fast' or pass cuda_graphs=False")  # fmt: skip
        model = session.model
        if attention is None:
            attention = "filled" if cuda and compiled and reads_filled_slots(model) else "masked"
        if attention == "filled" and not reads_filled_slots(model):
            raise InputError(f"reading only the slots' filled positions needs the fast engine's attention modules; "
                             f"the {session.engine} engine's attend under a mask (attention='masked')")  # fmt: skip
        self.session, self.plan, self.options, self.attention = session, plan, options, attention
        self.device = session.device
        self.cuda = cuda
        with torch.inference_mode():
            self.cache = SlotCache.allocate(model, plan.slots, plan.capacity, self.device)
            self.state = SlotState.allocate(plan.slots, plan.capacity, self.device, options)
        self.buckets = buckets_for(plan.slots)
        self.runner = StepRunner(model, self.cache, self.state, options, self.buckets, compiled=compiled,
                                 cuda_graphs=cuda_graphs, backend=backend, attention=attention)
        self.steps: list[StepRecord] = []  # every step read back, in order
        self._slots: dict[int, _Sequence] = {}  # slot -> the page decoding there
        self._free = list(range(plan.slots))  # kept sorted: a page takes the lowest
        self._waiting: deque[PageRequest] = deque()
        self._pending: deque[_Launch] = deque()
        self._read_tokens: list[TokenEvent] = []  # read back since the last step() returned
        self._read_finished: list[BatchedOutput] = []
        self._unfinished = 0  # pages admitted and not yet finished
        self._step_index = 0
        ring_rows = READBACK_LOOKAHEAD + 2
        self._ring = torch.zeros(ring_rows, plan.slots, dtype=torch.int64, pin_memory=cuda)
        self._ring_next = 0
        self._events: list[torch.cuda.Event] = []
        self._domain = nvtx.get_domain(NVTX_DOMAIN)
        self._nvtx: dict[str, object] = {}
        # Vision's stage ranges (NVTX only: the step's own events time it).
        self._vision_clock = StageClock(self.device, nvtx_enabled=session.instrumented, timing_enabled=False)
        self._anchor_s = 0.0
        self._anchor: torch.cuda.Event | None = None
        if cuda_graphs:
            with torch.inference_mode():  # as every step runs: no autograd graph to trace (the expert ops have none)
                self.runner.capture_all()
        self._set_anchor()

    @classmethod
    def create(
        cls, session: DeepSeekOCRSession, max_batch: int, max_prompt_tokens: int, max_new_tokens: int,
        options: DecodeOptions | None = None, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        compiled: bool | None = None, cuda_graphs: bool | None = None, backend: str = "inductor",
        attention: SlotAttention | None = None,
    ) -> BatchedEngine:  # fmt: skip
        """An engine whose KV cache holds up to `max_batch` pages of `max_prompt_tokens` prompt and
        `max_new_tokens` output positions, fewer where the device's free memory (less `reserve_bytes`)
        does not hold them (`plan_kv`; the plan is `engine.plan`)."""
        free = None
        if session.device.type == "cuda":
            session.synchronize()
            driver_free, _ = torch.cuda.mem_get_info(session.device)
            # What the caching allocator holds but no tensor uses is free to the cache too.
            free = driver_free + torch.cuda.memory_reserved(session.device) - torch.cuda.memory_allocated(session.device)
        plan = plan_kv(max_batch, max_prompt_tokens, max_new_tokens, SlotCache.bytes_per_position(session.model),
                       free, reserve_bytes, session.max_positions)  # fmt: skip
        return cls(session, plan, options, compiled, cuda_graphs, backend, attention)

    # --- the API --------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        """Pages handed over and not finished: waiting, decoding, or finishing."""
        return len(self._waiting) + self._unfinished

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._unfinished or self._pending)

    def submit(self, request: PageRequest) -> None:
        """Queue a page; the next step() with a free slot admits it. A page that cannot fit is refused
        here (`PageRefused`)."""
        request = self._arrived(request)
        self._fit(request)
        self._waiting.append(request)

    def add(self, request: PageRequest) -> int:
        """Admit a page now: its prefill is launched into the lowest free slot, which is returned.
        `NoFreeSlot` when every slot is taken; `PageRefused` when it cannot fit."""
        if not self._free:
            raise NoFreeSlot(f"all {self.plan.slots} slots hold pages")
        request = self._arrived(request)
        budget, ceiling = self._fit(request)
        return self._admit(request, budget, ceiling)

    def step(self) -> StepEvents:
        """Admit waiting pages into free slots (a prefill step each), launch one decode step over the
        occupied slots, read back what the device finished. Returns what happened."""
        admitted: list[tuple[str, int]] = []
        self._collect(wait_beyond=None)
        while self._waiting and self._free:
            request = self._waiting.popleft()
            budget, ceiling = self._fit(request)
            admitted.append((request.request_id, self._admit(request, budget, ceiling)))
            self._collect(wait_beyond=READBACK_LOOKAHEAD)
        self._launch_decode()
        # Nothing left to launch: wait for the rest instead of spinning.
        self._collect(wait_beyond=READBACK_LOOKAHEAD if self._decoding() else 0)
        events = StepEvents(tuple(admitted), tuple(self._read_tokens), tuple(self._read_finished))
        self._read_tokens, self._read_finished = [], []
        return events

    def run(self, requests: list[PageRequest], concurrency: int) -> list[BatchedOutput]:
        """Every request through the engine with at most `concurrency` in flight at once (a closed loop, as
        `vllm bench serve --max-concurrency`): each arrives when the one before it in the window
        finished. Returns the outputs in finishing order."""
        if concurrency < 1:
            raise InputError(f"concurrency must be at least 1, got {concurrency}")
        queue, outputs = deque(requests), list[BatchedOutput]()
        while queue or self.busy:
            while queue and self.in_flight < concurrency:
                self.submit(queue.popleft())
            outputs.extend(self.step().finished)
        return outputs

    def decode_text(self, output: BatchedOutput) -> str:
        return self.session.decode_text(output.token_ids)

    # --- admission ------------------------------------------------------------------------------------

    @staticmethod
    def _arrived(request: PageRequest) -> PageRequest:
        if request.arrival_s is not None:
            return request
        return PageRequest(request.request_id, request.page, request.max_new_tokens, time.perf_counter())

    def _fit(self, request: PageRequest) -> tuple[int, int]:
        wanted = self.plan.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        budget, ceiling = self.session._budget(request.page.prompt_tokens, wanted)
        self.plan.check_fits(request.page.prompt_tokens, budget)
        return budget, ceiling

    def _admit(self, request: PageRequest, budget: int, ceiling: int) -> int:
        """The page's prefill into the lowest free slot. A prefill that fails gives the slot back (and
        raises): the other pages go on."""
        self._ring_room()
        slot = self._free.pop(0)
        page, session = request.page, self.session
        assert request.arrival_s is not None
        sequence = _Sequence(request, slot, budget, ceiling, SequenceMetrics(request.arrival_s, time.perf_counter()))
        prompt = page.prompt_tokens
        try:
            with torch.inference_mode(), self._range("batched/prefill"):
                start = self._mark()
                inputs = session.upload(page)
                image = session.encode_image(inputs, self._vision_clock) if page.injects_image else None
                vision_end = self._mark()
                scratch = session.buffers_for(prompt + budget).cache
                scratch.reset()
                logits = session.lm_prefill(inputs, image, scratch)
                self.cache.load_prompt(slot, scratch, prompt)
                self.state.start(slot, inputs.input_ids)
                chosen = choose_tokens(logits, self.state.row(slot), self.options, self.state.whitelist)
                end = self._mark()
        except BaseException:
            self._release(slot)
            raise
        self._slots[slot] = sequence
        self._unfinished += 1
        launch = self._launched("prefill", [(0, sequence)], 1, chosen, start, end)
        launch.vision_end, launch.prompt_tokens = vision_end, prompt
        if budget == 1:
            self._release(slot)
        return slot

    # --- decoding -------------------------------------------------------------------------------------

    def _decoding(self) -> list[tuple[int, _Sequence]]:
        """(slot, page) of the pages with steps left to launch."""
        return sorted((slot, s) for slot, s in self._slots.items() if not s.done and s.launched < s.budget - 1)

    def _launch_decode(self) -> None:
        self._ring_room()
        occupants = self._decoding()
        if not occupants:
            return
        bucket = bucket_of(occupants[-1][0] + 1, self.buckets)
        with torch.inference_mode(), self._range(f"batched/decode [bucket {bucket}]"):
            start = self._mark()
            chosen = self.runner.run(bucket)
            end = self._mark()
            self._launched("decode", occupants, bucket, chosen, start, end)
            for slot, sequence in occupants:
                sequence.launched += 1
                if sequence.launched == sequence.budget - 1:  # its last step: the slot is free after it
                    self._release(slot)

    def _ring_room(self) -> None:
        """Before a step is launched (and before its pages are chosen: reading back may finish pages and
        free their slots): the ring row its tokens go to must have been read."""
        self._collect(wait_beyond=self._ring.shape[0] - 1)

    def _release(self, slot: int) -> None:
        self._slots.pop(slot, None)
        with torch.inference_mode():  # the state's tensors are inference tensors
            self.state.release(slot)
        self._free.append(slot)
        self._free.sort()

    def _launched(
        self, kind: StepKind, occupants: list[tuple[int, _Sequence]], bucket: int, chosen: torch.Tensor,
        start: torch.cuda.Event | float, end: torch.cuda.Event | float,
    ) -> _Launch:  # fmt: skip
        assert len(self._pending) < self._ring.shape[0], "_ring_room() before a step is launched"
        launch = _Launch(self._step_index, kind, occupants, bucket, self._ring_next, start, end)
        self._step_index += 1
        if self.cuda:
            self._ring[self._ring_next, : chosen.numel()].copy_(chosen, non_blocking=True)
            self._ring_next = (self._ring_next + 1) % self._ring.shape[0]
            copied = self._mark()
            assert isinstance(copied, torch.cuda.Event)
            launch.copied = copied
        else:
            launch.tokens = chosen.tolist()
        self._pending.append(launch)
        return launch

    # --- reading back ---------------------------------------------------------------------------------

    def _collect(self, wait_beyond: int | None) -> None:
        """Read back every launched step whose tokens are on the host; wait for the oldest while more
        than `wait_beyond` are pending (None: never wait). What is read waits for the next step()."""
        while self._pending:
            launch = self._pending[0]
            ready = launch.tokens is not None or (launch.copied is not None and launch.copied.query())
            if not ready and (wait_beyond is None or len(self._pending) <= wait_beyond):
                return
            self._pending.popleft()
            self._read(launch)

    def _read(self, launch: _Launch) -> None:
        if launch.tokens is None:
            assert launch.copied is not None
            launch.copied.synchronize()
            launch.tokens = self._ring[launch.ring_row, : launch.bucket].tolist()
        started, ended = self._time(launch.start), self._time(launch.end)
        vision_ms = (self._time(launch.vision_end) - started) * 1e3 if launch.vision_end is not None else 0.0
        occupancy = len(launch.occupants)
        self.steps.append(StepRecord(launch.index, launch.kind, occupancy, launch.bucket, started, ended,
                                     launch.prompt_tokens, vision_ms))  # fmt: skip
        for mark in (launch.start, launch.end, launch.vision_end, launch.copied):
            if isinstance(mark, torch.cuda.Event):
                self._events.append(mark)
        for row, sequence in launch.occupants:
            if sequence.done:
                sequence.wasted += 1
                continue
            metrics = sequence.metrics
            if launch.kind == "prefill":
                metrics.prefill_started_s = started
            else:
                metrics.occupancy_sum += occupancy
                metrics.decode_steps += 1
            token = launch.tokens[row]
            sequence.tokens.append(token)
            metrics.token_s.append(ended)
            self._read_tokens.append(TokenEvent(sequence.request.request_id, (token,), ended))
            reason = self._stop_reason(sequence)
            if reason is not None:
                self._read_finished.append(self._finish(sequence, reason))

    def _stop_reason(self, sequence: _Sequence) -> StopReason | None:
        """The batch-1 path's rule (engine/stopping.py), with loops looked for at its cadence."""
        tokens, options = sequence.tokens, self.options
        repeating = options.stop_on_repetition and loop_check_due(len(tokens) - 1) and ends_in_loop(tokens)
        return stop_reason(tokens, sequence.budget, sequence.ceiling, options, repeating)

    def _finish(self, sequence: _Sequence, reason: StopReason) -> BatchedOutput:
        sequence.stop_reason = reason
        sequence.metrics.finished_s = time.perf_counter()
        if self._slots.get(sequence.slot) is sequence:  # EOS or a loop before its budget: free its slot now
            self._release(sequence.slot)
        self._unfinished -= 1
        page = sequence.request.page
        return BatchedOutput(sequence.request.request_id, list(sequence.tokens), reason, page.prompt_tokens,
                             page.image_tokens, page.crop_grid, page.mode.name, sequence.wasted,
                             sequence.metrics)  # fmt: skip

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

    def _mark(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _time(self, mark: torch.cuda.Event | float) -> float:
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
