"""The batched engine's scheduler: pages waiting, slots and their free list, admission against the KV
plan, token budgets, split prefill, stop decisions and per-page metrics. No torch: each launch is
planned here as a plain `PrefillPlan` or `DecodePlan` for the runner (runner.py), and what the runner
read back (plain token ids and times, `Readback`) comes back here to extend the pages and stop them.

With `split_prefill`, a page joining while other pages decode has its prefill launched in two parts in
two steps, each before that step's decode step: "sam" (its upload and SAM), then "join" (the view
encoder, projector, LM prefill and its first token). A step carries at most one part, and one page is
split at a time. Where the pages decoding do not outnumber those that could join now (a batch filling
up, or a wave of pages ending together), waiting pages are prefilled whole: a split would hold more
pages back a step than it spares decoding pages a long one."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from dsocr_workers.engine.batched.memory import KVPlan
from dsocr_workers.engine.batched.metrics import SequenceMetrics, StepKind, StepRecord
from dsocr_workers.engine.result import DecodeOptions, StopReason
from dsocr_workers.engine.stopping import StopRule, ends_in_loop, loop_check_due, stop_reason

if TYPE_CHECKING:
    from dsocr_workers.model.preprocess import PreparedPage

# (prompt tokens, tokens asked for or None) -> (the page's token budget, the most the model's positions
# allow): the session's rule, handed in so that this module needs no model.
BudgetRule = Callable[[int, int | None], tuple[int, int]]


class NoFreeSlot(RuntimeError):
    """`add` with every slot taken: `submit` queues instead."""


@dataclass(frozen=True)
class PageRequest:
    """A prepared page for the batched engine. `max_new_tokens` None: the engine's budget.
    `arrival_s`: when it arrived (perf_counter; None: when handed to the engine). `stop`: how it stops
    before its budget (None: as the engine's options say)."""

    request_id: str
    page: PreparedPage
    max_new_tokens: int | None = None
    arrival_s: float | None = None
    stop: StopRule | None = None


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


@dataclass(frozen=True)
class Admission:
    """A page that fits: its token budget and the most the model's positions allow (`ceiling`)."""

    request: PageRequest
    budget: int
    ceiling: int


# A page's prefill in one launch ("prefill"), or in two: "sam", then "join" (the module docstring).
PrefillPart = Literal["prefill", "sam", "join"]


@dataclass(frozen=True)
class PrefillPlan:
    """Launch a page's prefill (`part` of it) into `slot`; the part that ends it chooses its first token.
    `clear`: slots that hold no page any more, their device state reset before this launch."""

    index: int
    slot: int
    page: PreparedPage
    budget: int  # its scratch cache holds the prompt and this many tokens
    clear: tuple[int, ...]
    part: PrefillPart = "prefill"

    @property
    def ends_prefill(self) -> bool:
        return self.part != "sam"


@dataclass(frozen=True)
class DecodePlan:
    """Launch one decode step over slots 0..bucket-1; `rows`: the slots whose pages it decodes."""

    index: int
    rows: tuple[int, ...]
    bucket: int
    clear: tuple[int, ...]


StepPlan = PrefillPlan | DecodePlan


@dataclass(frozen=True)
class Readback:
    """A launched step's tokens (one per row computed: the bucket's, or the prefill's one) and when it ran
    (host perf_counter seconds)."""

    index: int
    tokens: list[int]
    started_s: float
    ended_s: float
    vision_ms: float = 0.0  # a prefill's (or prefill part's) vision stages


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
class _Sequence:
    admission: Admission
    slot: int
    metrics: SequenceMetrics
    tokens: list[int] = field(default_factory=list)
    prefilled: bool = False  # the launch that ends its prefill is queued
    launched: int = 0  # decode steps launched for it
    stop_reason: StopReason | None = None

    @property
    def request(self) -> PageRequest:
        return self.admission.request

    @property
    def budget(self) -> int:
        return self.admission.budget

    @property
    def done(self) -> bool:
        return self.stop_reason is not None


@dataclass
class _Launch:
    """A launched step whose tokens are not read back yet: (row of its tokens, page) per page given a
    token; `prefilled`: a prefill's (or prefill part's) page."""

    plan: StepPlan
    occupants: list[tuple[int, _Sequence]]
    prefilled: _Sequence | None = None
    attended: tuple[int, ...] = ()  # a decode step's, per page: the KV positions its attention reads


class Scheduler:
    """Which page decodes where, what each launch computes, and when each page stops."""

    def __init__(
        self,
        plan: KVPlan,
        options: DecodeOptions,
        budget_rule: BudgetRule,
        split_prefill: bool = False,
    ) -> None:
        """`split_prefill`: a page joining while more decode than wait is prefilled in two parts over two
        steps (the module docstring); False: every page's prefill in one launch."""
        self.plan, self.options, self.budget_rule = plan, options, budget_rule
        self._stop = StopRule.of(options)
        self.split_prefill = split_prefill
        self.buckets = buckets_for(plan.slots)
        self.steps: list[StepRecord] = []  # every step read back, in order
        self._slots: dict[int, _Sequence] = {}  # slot -> the page prefilling or decoding there
        self._split: _Sequence | None = None  # the page whose "sam" part is launched, its "join" not
        self._free = list(range(plan.slots))  # kept sorted: a page takes the lowest
        self._clear: list[int] = []  # freed since the last launch: the runner resets them
        self._waiting: deque[Admission] = deque()
        self._unread: dict[int, _Launch] = {}  # launched, not read back: by step index
        self._tokens: list[TokenEvent] = []  # read back since the last `events`
        self._finished: list[BatchedOutput] = []
        self._unfinished = 0  # pages admitted and not yet finished
        self._step_index = 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        """Pages handed over and not finished: waiting, decoding, or finishing."""
        return len(self._waiting) + self._unfinished

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._unfinished or self._unread)

    @property
    def admissible(self) -> bool:
        """A page waits and a slot is free."""
        return bool(self._waiting and self._free)

    @property
    def decoding(self) -> bool:
        """Some page has decode steps left to launch."""
        return bool(self._decoding())

    @property
    def prefilling(self) -> bool:
        """A page holds a slot with the rest of its split prefill to launch."""
        return self._split is not None

    @property
    def launchable(self) -> bool:
        """Something is left to launch: a decode step, a prefill part, or a page to admit."""
        return self.decoding or self.prefilling or self.admissible

    # --- admission ------------------------------------------------------------------------------------

    def admit(self, request: PageRequest) -> Admission:
        """The page's budget, checked against a slot (`PageRefused` where it cannot fit)."""
        if request.arrival_s is None:
            request = replace(request, arrival_s=time.perf_counter())
        wanted = self.plan.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        budget, ceiling = self.budget_rule(request.page.prompt_tokens, wanted)
        self.plan.check_fits(request.page.prompt_tokens, budget)
        return Admission(request, budget, ceiling)

    def submit(self, request: PageRequest) -> None:
        self._waiting.append(self.admit(request))

    def next_waiting(self) -> Admission:
        return self._waiting.popleft()

    def plan_prefill(self, admission: Admission, part: PrefillPart = "prefill") -> PrefillPlan:
        """The page into the lowest free slot, its whole prefill in one launch, or with `part` "sam" the
        first of two (`plan_join` plans the second); `launched` or `failed` must follow."""
        assert part != "join", "plan_join continues a split prefill"
        assert part == "prefill" or self._split is None, "one page's prefill is split at a time"
        sequence = self._take_slot(admission)
        if part == "sam":
            self._split = sequence
        return self._prefill_plan(sequence, part)

    def plan_join(self) -> PrefillPlan | None:
        """The second part of the split prefill under way; None: none is. `launched` or `failed` must
        follow."""
        return None if self._split is None else self._prefill_plan(self._split, "join")

    def plan_first_part(self) -> PrefillPart:
        """How the next waiting page's prefill starts: split ("sam") where splitting is on and the pages
        decoding outnumber those that could join now (waiting, up to the free slots), else whole."""
        joinable = min(len(self._waiting), len(self._free))
        return "sam" if self.split_prefill and len(self._decoding()) > joinable else "prefill"

    def _prefill_plan(self, sequence: _Sequence, part: PrefillPart) -> PrefillPlan:
        admission = sequence.admission
        return PrefillPlan(
            self._step_index,
            sequence.slot,
            admission.request.page,
            admission.budget,
            self._take_clear(),
            part,
        )

    def _take_slot(self, admission: Admission) -> _Sequence:
        if not self._free:
            raise NoFreeSlot(f"all {self.plan.slots} slots hold pages")
        slot = self._free.pop(0)
        assert admission.request.arrival_s is not None  # set by `admit`
        metrics = SequenceMetrics(admission.request.arrival_s, time.perf_counter())
        sequence = self._slots[slot] = _Sequence(admission, slot, metrics)
        self._unfinished += 1
        return sequence

    def failed(self, plan: PrefillPlan) -> None:
        """The prefill (or a part of it) raised: the page is dropped, its slot free again (and reset), the
        other pages go on."""
        self._clear.extend(plan.clear)
        if self._split is self._slots[plan.slot]:
            self._split = None
        self._unfinished -= 1
        self._release(plan.slot)

    # --- decoding -------------------------------------------------------------------------------------

    def _decoding(self) -> list[tuple[int, _Sequence]]:
        """(slot, page) of the pages prefilled with steps left to launch."""
        return sorted(
            (slot, s)
            for slot, s in self._slots.items()
            if not s.done and s.prefilled and s.launched < s.budget - 1
        )

    def plan_decode(self) -> DecodePlan | None:
        """One decode step over the bucket that covers every page with steps left; None: there is none."""
        occupants = self._decoding()
        if not occupants:
            return None
        bucket = bucket_of(occupants[-1][0] + 1, self.buckets)
        return DecodePlan(self._step_index, tuple(slot for slot, _ in occupants), bucket, self._take_clear())

    def launched(self, plan: StepPlan) -> None:
        """The runner launched `plan`. A page's slot is free once its last step is launched."""
        self._step_index += 1
        if isinstance(plan, PrefillPlan):
            sequence = self._slots[plan.slot]
            if not plan.ends_prefill:  # no token yet
                self._unread[plan.index] = _Launch(plan, [], sequence)
                return
            if plan.part == "join":
                self._split = None
            sequence.prefilled = True
            self._unread[plan.index] = _Launch(plan, [(0, sequence)], sequence)
            if sequence.budget == 1:
                self._release(plan.slot)
            return
        occupants = [(slot, self._slots[slot]) for slot in plan.rows]
        # A page's prompt, the tokens decoded before this step and the one it feeds.
        attended = tuple(s.request.page.prompt_tokens + s.launched + 1 for _, s in occupants)
        self._unread[plan.index] = _Launch(plan, occupants, attended=attended)
        for slot, sequence in occupants:
            sequence.launched += 1
            if sequence.launched == sequence.budget - 1:
                self._release(slot)

    def _release(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._clear.append(slot)
        self._free.append(slot)
        self._free.sort()

    def _take_clear(self) -> tuple[int, ...]:
        clear, self._clear = tuple(self._clear), []
        return clear

    # --- reading back ---------------------------------------------------------------------------------

    def read(self, readback: Readback) -> None:
        """A launched step's tokens: each page's next token, its stop decision, the step's record."""
        launch = self._unread.pop(readback.index)
        plan = launch.plan
        kind: StepKind = "decode" if isinstance(plan, DecodePlan) else plan.part
        occupancy = len(launch.occupants)
        if isinstance(plan, DecodePlan):
            kv = launch.attended
            record = StepRecord(
                plan.index,
                kind,
                occupancy,
                plan.bucket,
                readback.started_s,
                readback.ended_s,
                kv_positions=sum(kv),
                kv_longest=max(kv, default=0),
            )
        else:
            record = StepRecord(
                plan.index,
                kind,
                occupancy,
                1,
                readback.started_s,
                readback.ended_s,
                plan.page.prompt_tokens if plan.ends_prefill else 0,
                readback.vision_ms,
                launch.prefilled.request.request_id if launch.prefilled is not None else None,
            )
        self.steps.append(record)
        if launch.prefilled is not None:
            launch.prefilled.metrics.prefill_ms += record.ms
            launch.prefilled.metrics.vision_ms += record.vision_ms
        begins = isinstance(plan, PrefillPlan) and plan.part != "join"
        if begins and launch.prefilled is not None:
            launch.prefilled.metrics.prefill_started_s = readback.started_s
        for row, sequence in launch.occupants:
            if sequence.done:  # a step launched before its stop was read: wasted
                continue
            metrics = sequence.metrics
            if kind == "decode":
                metrics.occupancy_sum += occupancy
                metrics.decode_steps += 1
            token = readback.tokens[row]
            sequence.tokens.append(token)
            metrics.token_s.append(readback.ended_s)
            self._tokens.append(TokenEvent(sequence.request.request_id, (token,), readback.ended_s))
            reason = self._stop_reason(sequence)
            if reason is not None:
                self._finished.append(self._finish(sequence, reason))

    def _stop_reason(self, sequence: _Sequence) -> StopReason | None:
        """The batch-1 rule (engine/stopping.py), with loops looked for at its cadence."""
        tokens, rule = sequence.tokens, sequence.request.stop or self._stop
        repeating = rule.stop_on_repetition and loop_check_due(len(tokens) - 1) and ends_in_loop(tokens)
        return stop_reason(tokens, sequence.budget, sequence.admission.ceiling, rule, repeating)

    def _finish(self, sequence: _Sequence, reason: StopReason) -> BatchedOutput:
        sequence.stop_reason = reason
        sequence.metrics.finished_s = time.perf_counter()
        if self._slots.get(sequence.slot) is sequence:  # EOS or a loop before its budget: free its slot now
            self._release(sequence.slot)
        self._unfinished -= 1
        page = sequence.request.page
        # Its decode steps launched and not read yet: computed past its end.
        wasted = sequence.launched - (len(sequence.tokens) - 1)
        return BatchedOutput(
            sequence.request.request_id,
            list(sequence.tokens),
            reason,
            page.prompt_tokens,
            page.image_tokens,
            page.crop_grid,
            page.mode.name,
            wasted,
            sequence.metrics,
        )

    def events(self, admitted: list[tuple[str, int]]) -> StepEvents:
        """What was read back since the last call, with the pages `admitted` meanwhile."""
        events = StepEvents(tuple(admitted), tuple(self._tokens), tuple(self._finished))
        self._tokens, self._finished = [], []
        return events

