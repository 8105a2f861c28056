"""`BatchedEngine`: up to `slots` pages decoding together on one loaded session, pages joining between
decode steps and leaving when they finish (continuous batching).

    engine = BatchedEngine.create(session, max_batch=32, max_prompt_tokens=1280, max_new_tokens=1024)
    slot = engine.add(PageRequest("p1", session.prepare(image, None, "gundam", 9)))  # its prefill runs now
    engine.submit(PageRequest("p2", page2))      # or: queued, admitted by the next step() with a free slot
    while engine.busy:
        events = engine.step()                   # joins, one decode step, what was read back
        for output in events.finished: ...       # BatchedOutput: tokens, stop reason, metrics

The engine couples the scheduler (scheduler.py: no torch, it plans each launch and decides stops) with
the runner (runner.py: it launches and reads back). With `split_prefill`, a page joining while more
pages decode than wait is prefilled in two parts over two steps (its SAM, then the rest), at most one
part a step, so the pages decoding keep their pace. Tokens are read back without stalling the device:
the host waits for a step only when `READBACK_LOOKAHEAD` newer ones are queued. A page leaving at EOS
seen late counts the steps launched meanwhile as wasted, as the batch-1 path does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.nn.attention.flex_attention import FlexKernelOptions

from dsocr_workers.engine.batched.memory import DEFAULT_RESERVE_BYTES, KVPlan, plan_kv
from dsocr_workers.engine.batched.metrics import StepRecord
from dsocr_workers.engine.batched.runner import READBACK_LOOKAHEAD, BatchRunner, StepConfig
from dsocr_workers.engine.batched.scheduler import (
    Admission,
    BatchedOutput,
    NoFreeSlot,
    PageRequest,
    PrefillPart,
    PrefillPlan,
    Readback,
    Scheduler,
    StepEvents,
)
from dsocr_workers.engine.batched.slots import SlotAttention, SlotCache
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.sampling import validate_options
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.errors import InputError

if TYPE_CHECKING:
    from dsocr_workers.engine.profiling import StepProfiler


class BatchedEngine:
    """Continuous batching over a session's model: `add`/`submit` pages, `step()` until not `busy`."""

    def __init__(
        self,
        session: DeepSeekOCRSession,
        plan: KVPlan,
        options: DecodeOptions | None = None,
        config: StepConfig | None = None,
        split_prefill: bool = True,
    ) -> None:
        """Allocates the slots and captures the step's graphs as `config` says (`StepConfig.decide`:
        None, the session's defaults). `split_prefill`: a page joining while more decode than wait is
        prefilled in two steps (False: every prefill in one launch)."""
        options = options or DecodeOptions()
        validate_options(options)
        if options.seed is not None:
            torch.manual_seed(options.seed)
        config = config or StepConfig.decide(session)
        self.session, self.plan, self.options, self.config = session, plan, options, config
        self.scheduler = Scheduler(plan, options, session._budget, split_prefill)
        self.runner = BatchRunner(session, plan, options, config)
        # Each bucket's capture, in ms: the batched engine's start, which a worker records.
        self.captures_ms = self.runner.capture(self.scheduler.buckets)
        self._prefill_window: tuple[Callable[[], None], Callable[[], None]] | None = None

    @classmethod
    def create(
        cls,
        session: DeepSeekOCRSession,
        max_batch: int,
        max_prompt_tokens: int,
        max_new_tokens: int,
        options: DecodeOptions | None = None,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        compiled: bool | None = None,
        cuda_graphs: bool | None = None,
        attention: SlotAttention | None = None,
        split_prefill: bool = True,
        attention_options: FlexKernelOptions | None = None,
    ) -> BatchedEngine:
        """An engine whose KV cache holds up to `max_batch` pages of `max_prompt_tokens` prompt and
        `max_new_tokens` output positions, fewer where the device's free memory (less `reserve_bytes`)
        does not hold them (`plan_kv`; the plan is `engine.plan`). `compiled`, `cuda_graphs`,
        `attention`, `attention_options`: `StepConfig.decide`; `split_prefill`: as the constructor's."""
        config = StepConfig.decide(session, compiled, cuda_graphs, attention, attention_options)
        free = None
        if session.device.type == "cuda":
            session.synchronize()
            driver_free, _ = torch.cuda.mem_get_info(session.device)
            # What the caching allocator holds but no tensor uses is free to the cache too.
            free = (
                driver_free
                + torch.cuda.memory_reserved(session.device)
                - torch.cuda.memory_allocated(session.device)
            )
        plan = plan_kv(
            max_batch,
            max_prompt_tokens,
            max_new_tokens,
            SlotCache.bytes_per_position(session.model),
            free,
            reserve_bytes,
            session.max_positions,
        )
        return cls(session, plan, options, config, split_prefill)

    @classmethod
    def for_mode(
        cls,
        session: DeepSeekOCRSession,
        concurrency: int,
        mode: str,
        prompt: str | None,
        max_new_tokens: int | None,
        options: DecodeOptions | None = None,
        compiled: bool | None = None,
        cuda_graphs: bool | None = None,
        split_prefill: bool = True,
    ) -> BatchedEngine:
        """An engine for `concurrency` pages of `mode` (and `prompt`) at once: slots that hold its longest
        prompt and `max_new_tokens` (None: what the model's positions leave), as a worker and the build
        step size it."""
        longest = min(session.longest_prompt(mode, prompt), session.max_positions - 1)
        budget = max_new_tokens or session.max_positions - longest
        return cls.create(
            session,
            concurrency,
            longest,
            budget,
            options,
            compiled=compiled,
            cuda_graphs=cuda_graphs,
            split_prefill=split_prefill,
        )

    # --- the API --------------------------------------------------------------------------------------

    @property
    def attention(self) -> SlotAttention:
        return self.config.attention

    @property
    def split_prefill(self) -> bool:
        return self.scheduler.split_prefill

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.scheduler.buckets

    @property
    def steps(self) -> list[StepRecord]:
        """Every step read back, in order (a caller may take and clear them)."""
        return self.scheduler.steps

    @property
    def free_slots(self) -> int:
        return self.scheduler.free_slots

    @property
    def in_flight(self) -> int:
        """Pages handed over and not finished: waiting, decoding, or finishing."""
        return self.scheduler.in_flight

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def profile_steps(self, profiler: StepProfiler | None) -> None:
        """Run the steps `profiler` samples under torch.profiler (engine/profiling.py); None: none."""
        self.runner.profiler = profiler

    def around_prefills(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Call `before` ahead of a step's prefill launches and `after` once they are queued: the caller's
        other threads may pause meanwhile, so that the launches, one per kernel, never wait on the GIL."""
        self._prefill_window = (before, after)

    def submit(self, request: PageRequest) -> None:
        """Queue a page; the next step() with a free slot admits it. A page that cannot fit is refused
        here (`PageRefused`)."""
        self.scheduler.submit(request)

    def add(self, request: PageRequest) -> int:
        """Admit a page now into the lowest free slot, which is returned: its whole prefill is launched
        now. `NoFreeSlot` when every slot is taken; `PageRefused` when it cannot fit."""
        if not self.scheduler.free_slots:
            raise NoFreeSlot(f"all {self.plan.slots} slots hold pages")
        if self.scheduler.prefilling:
            raise NoFreeSlot("a page's split prefill is under way: submit() queues instead")
        return self._prefill(self.scheduler.admit(request), "prefill")

    def step(self) -> StepEvents:
        """Launch prefill work, then one decode step over the pages prefilled; read back what the device
        finished. Returns what happened. The prefill work: the second part of a split prefill under
        way; else, where prefills are split and the pages decoding outnumber those that could join, the
        first part of the next waiting page's; else every waiting page that has a free slot, prefilled
        whole."""
        admitted: list[tuple[str, int]] = []
        self._read(self.runner.collect(wait_beyond=None))
        window = self._prefill_window if self.scheduler.admissible or self.scheduler.prefilling else None
        if window is not None:
            window[0]()
        try:
            join = self.scheduler.plan_join()
            if join is not None:
                self._read(self.runner.room())
                self._launch_prefill(join)
            elif self.scheduler.admissible and self.scheduler.plan_first_part() == "sam":
                admission = self.scheduler.next_waiting()
                admitted.append((admission.request.request_id, self._prefill(admission, "sam")))
            else:
                while self.scheduler.admissible:
                    admission = self.scheduler.next_waiting()
                    admitted.append((admission.request.request_id, self._prefill(admission, "prefill")))
                    self._read(self.runner.collect(wait_beyond=READBACK_LOOKAHEAD))
        finally:
            if window is not None:
                window[1]()
        # Read what frees the ring row (and may end pages) before the decoding pages are chosen.
        self._read(self.runner.room())
        decode = self.scheduler.plan_decode()
        if decode is not None:
            self.runner.launch(decode)
            self.scheduler.launched(decode)
        # Nothing left to launch: wait for the rest instead of spinning.
        self._read(self.runner.collect(wait_beyond=READBACK_LOOKAHEAD if self.scheduler.launchable else 0))
        return self.scheduler.events(admitted)

    def run(
        self, requests: list[PageRequest], concurrency: int, *, one_a_step: bool = False
    ) -> list[BatchedOutput]:
        """Every request through the engine with at most `concurrency` in flight at once (a closed loop, as
        `vllm bench serve --max-concurrency`): each arrives when the one before it in the window
        finished; `one_a_step`: at most one arrives a step, as the farm's pages do (claimed and prepared one
        by one), so a filling batch's pages stay staggered instead of growing together. Returns the
        outputs in finishing order."""
        if concurrency < 1:
            raise InputError(f"concurrency must be at least 1, got {concurrency}")
        queue, outputs = deque(requests), list[BatchedOutput]()
        while queue or self.busy:
            while queue and self.in_flight < concurrency:
                self.submit(queue.popleft())
                if one_a_step:
                    break
            outputs.extend(self.step().finished)
        return outputs

    def decode_text(self, output: BatchedOutput) -> str:
        return self.session.decode_text(output.token_ids)

    def _prefill(self, admission: Admission, part: PrefillPart) -> int:
        """The page's prefill (or its first part) into the lowest free slot."""
        self._read(self.runner.room())
        plan = self.scheduler.plan_prefill(admission, part)
        self._launch_prefill(plan)
        return plan.slot

    def _launch_prefill(self, plan: PrefillPlan) -> None:
        """A prefill (or a part of it) that fails drops its page and gives the slot back (and raises): the
        other pages go on."""
        try:
            self.runner.launch(plan)
        except BaseException:
            self.scheduler.failed(plan)
            raise
        self.scheduler.launched(plan)

    def _read(self, readbacks: list[Readback]) -> None:
        for readback in readbacks:
            self.scheduler.read(readback)

