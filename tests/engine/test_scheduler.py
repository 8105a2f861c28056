"""The batched scheduler (engine/batched/scheduler.py) without a model or torch: plans handed out, token
ids read back as plain ints, and the slots, stops and metrics that follow from them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from dsocr_workers.engine.batched.memory import PageRefused, plan_kv
from dsocr_workers.engine.batched.scheduler import (
    DecodePlan,
    NoFreeSlot,
    PageRequest,
    PrefillPart,
    PrefillPlan,
    Readback,
    Scheduler,
    StepPlan,
    bucket_of,
    buckets_for,
)
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.model.config import EOS_TOKEN_ID
from dsocr_workers.model.deepseek_ocr.config import get_mode

POSITIONS = 200  # the model's


def budget_rule(prompt_tokens: int, wanted: int | None) -> tuple[int, int]:
    ceiling = POSITIONS - prompt_tokens
    return min(ceiling if wanted is None else wanted, ceiling), ceiling


@dataclass(frozen=True)
class Page:
    """What the scheduler reads of a prepared page."""

    prompt_tokens: int
    image_tokens: int = 10
    crop_grid: tuple[int, int] = (1, 1)
    mode: object = field(default_factory=lambda: get_mode("tiny"))


def scheduler(
    slots: int = 3,
    options: DecodeOptions | None = None,
    max_new_tokens: int = 20,
    split_prefill: bool = False,
) -> Scheduler:
    return Scheduler(
        plan_kv(slots, 60, max_new_tokens, 1, None),
        options or DecodeOptions(ignore_eos=True),
        budget_rule,
        split_prefill,
    )


def request(name: str, new_tokens: int, prompt: int = 30) -> PageRequest:
    return PageRequest(name, Page(prompt), new_tokens)  # type: ignore[arg-type]


class Device:
    """Stands in for the runner: each page's output is scripted by its request id, a step's time is its
    index in seconds, and what is launched is read back only when asked (as the ring does)."""

    def __init__(self, sched: Scheduler, outputs: dict[str, list[int]]) -> None:
        self.sched, self.outputs = sched, outputs
        self.at: dict[int, str] = {}  # slot -> the page the device holds there
        self.unread: list[tuple[StepPlan, list[int]]] = []
        self.cleared: list[int] = []
        self.pending_name = ""  # the page whose prefill is launched next

    def launch(self, plan: StepPlan) -> None:
        self.cleared += plan.clear
        for slot in plan.clear:
            self.at.pop(slot, None)
        if isinstance(plan, PrefillPlan):
            if plan.part != "join":
                self.at[plan.slot] = self.pending_name
            tokens = [self.outputs[self.at[plan.slot]].pop(0)] if plan.ends_prefill else []
        else:
            tokens = [
                self.outputs[self.at[row]].pop(0) if row in plan.rows else 0 for row in range(plan.bucket)
            ]
        self.unread.append((plan, tokens))
        self.sched.launched(plan)

    def prefill(self, name: str, new_tokens: int, part: PrefillPart = "prefill") -> int:
        """A page's whole prefill, or with `part` "sam" the first of its two parts."""
        self.pending_name = name
        plan = self.sched.plan_prefill(self.sched.admit(request(name, new_tokens)), part)
        self.launch(plan)
        return plan.slot

    def join(self) -> PrefillPlan | None:
        plan = self.sched.plan_join()
        if plan is not None:
            self.launch(plan)
        return plan

    def decode(self) -> DecodePlan | None:
        plan = self.sched.plan_decode()
        if plan is not None:
            self.launch(plan)
        return plan

    def read(self, keep: int = 0) -> None:
        """Read back all but the newest `keep` launches (a page's vision takes 0.1 s of its prefill, or of
        each of its parts)."""
        while len(self.unread) > keep:
            plan, tokens = self.unread.pop(0)
            vision = isinstance(plan, PrefillPlan)
            readback = Readback(plan.index, tokens, float(plan.index), plan.index + 0.5, 100.0 if vision else 0.0)
            self.sched.read(readback)


def test_the_scheduler_imports_no_torch():
    code = "import dsocr_workers.engine.batched.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_buckets():
    assert buckets_for(1) == (1,) and buckets_for(6) == (1, 2, 4, 6) and buckets_for(64)[-2:] == (32, 64)
    assert [bucket_of(n, buckets_for(6)) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def test_pages_take_the_lowest_free_slot_and_leave_at_their_budget():
    """A page's slot is free once its last step is launched, before its tokens are read: the next plan
    clears it, and the next page takes it."""
    sched = scheduler()
    device = Device(
        sched, {"a": list(range(100, 103)), "b": list(range(200, 206)), "c": list(range(300, 302))}
    )
    assert device.prefill("a", 3) == 0 and device.prefill("b", 6) == 1
    assert sched.free_slots == 1 and sched.in_flight == 2
    first = device.decode()
    assert first is not None and (first.rows, first.bucket, first.clear) == ((0, 1), 2, ())
    second = device.decode()  # page a's last step: its slot is free from now on
    assert second is not None and second.rows == (0, 1) and sched.free_slots == 2
    assert device.prefill("c", 2) == 0 and device.cleared == [0]  # cleared before c's prefill
    third = device.decode()
    assert third is not None and (third.rows, third.bucket) == ((0, 1), 2)
    assert sched.free_slots == 2  # c's one decode step was its last
    device.read()
    events = sched.events([])
    assert [(o.request_id, o.token_ids, o.stop_reason) for o in events.finished] == [
        ("a", [100, 101, 102], "max_new_tokens"),
        ("c", [300, 301], "max_new_tokens"),
    ]
    assert [t.tokens[0] for t in events.tokens if t.request_id == "b"] == [200, 201, 202, 203]
    while device.decode() is not None:
        pass
    device.read()
    (b,) = sched.events([]).finished
    assert b.token_ids == list(range(200, 206)) and b.wasted_steps == 0
    assert not sched.busy and sched.free_slots == 3 and sched.in_flight == 0


def test_a_late_eos_counts_the_steps_launched_meanwhile_as_wasted():
    """EOS read back two launches late: the page stops there, its slot is freed at that readback, and
    the two steps launched after it are wasted steps of its own."""
    sched = scheduler(slots=2, options=DecodeOptions())
    device = Device(sched, {"a": [101, 102, EOS_TOKEN_ID, 104, 105, 106, 107], "b": list(range(10, 20))})
    device.prefill("a", 7)
    device.prefill("b", 10)
    device.decode()
    device.decode()  # chooses a's EOS
    device.decode()
    device.decode()
    device.read(keep=2)  # the EOS step is read; two steps after it are still in flight
    (a,) = sched.events([]).finished
    assert a.token_ids == [101, 102, EOS_TOKEN_ID] and a.stop_reason == "eos"
    assert sched.free_slots == 1  # freed at the readback, not at a budget
    plan = sched.plan_decode()
    assert plan is not None and plan.rows == (1,) and plan.clear == (0,)
    device.launch(plan)
    device.read()
    assert a.wasted_steps == 2 and sched.events([]).finished == ()
    decode_steps = [s for s in sched.steps if s.kind == "decode"]
    assert [s.occupancy for s in decode_steps] == [2, 2, 2, 2, 1]
    assert a.metrics.decode_steps == 2


def test_a_loop_is_seen_at_the_batch1_cadence():
    sched = scheduler(
        slots=1, options=DecodeOptions(stop_on_repetition=True, ignore_eos=True), max_new_tokens=100
    )
    loop = [7, 8, 9] * 40
    device = Device(sched, {"a": list(loop)})
    device.prefill("a", 100)
    while sched.busy:
        device.decode()
        device.read()
    (a,) = sched.events([]).finished
    assert a.stop_reason == "repetition" and (len(a.token_ids) - 1) % 8 == 0


def test_admission_refuses_what_cannot_fit_and_add_needs_a_free_slot():
    sched = scheduler(slots=1)
    with pytest.raises(PageRefused, match="needs 130 KV positions"):
        sched.submit(request("big", 100))
    assert not sched.busy
    sched.submit(request("a", 4))
    assert sched.admissible and sched.in_flight == 1
    plan = sched.plan_prefill(sched.next_waiting())
    sched.launched(plan)
    assert not sched.admissible
    with pytest.raises(NoFreeSlot):
        sched.plan_prefill(sched.admit(request("b", 4)))


def test_a_failed_prefill_gives_its_slot_back_to_be_cleared():
    sched = scheduler(slots=2)
    plan = sched.plan_prefill(sched.admit(request("a", 4)))
    assert plan.slot == 0 and sched.free_slots == 1
    sched.failed(plan)
    assert sched.free_slots == 2 and not sched.busy
    again = sched.plan_prefill(sched.admit(request("a", 4)))
    assert (again.index, again.slot, again.clear) == (plan.index, 0, (0,))


def test_metrics_follow_the_read_back_times():
    sched = scheduler(slots=2)
    device = Device(sched, {"a": [11, 12, 13], "b": [14, 15]})
    device.prefill("a", 3)
    device.prefill("b", 2)
    device.decode()
    device.decode()
    device.read()
    outputs = {o.request_id: o for o in sched.events([("a", 0), ("b", 1)]).finished}
    a, b = outputs["a"].metrics, outputs["b"].metrics
    assert a.token_s == [0.5, 2.5, 3.5] and a.prefill_started_s == 0.0 and a.decode_steps == 2
    assert b.token_s == [1.5, 2.5] and b.prefill_started_s == 1.0 and b.mean_occupancy == 2
    assert a.arrival_s <= a.admitted_s and a.itl_ms == [2000.0, 1000.0]
    # Its own prefill step's time and the vision in it; not the decode steps it shares.
    assert (a.prefill_ms, a.vision_ms, b.prefill_ms, b.vision_ms) == (500.0, 100.0, 500.0, 100.0)
    assert [(s.index, s.kind, s.occupancy, s.bucket) for s in sched.steps] == [
        (0, "prefill", 1, 1),
        (1, "prefill", 1, 1),
        (2, "decode", 2, 2),
        (3, "decode", 1, 1),
    ]
    assert sched.steps[0].prompt_tokens == 30


def test_a_page_joining_while_others_decode_is_prefilled_in_two_parts_one_a_step():
    """Split: the first page (nothing decodes) is prefilled whole; the next one, while it decodes, in a
    "sam" part that gives no token, then a "join" part that gives its first token. Only after its join
    does it decode, and no other page's prefill starts before the join."""
    sched = scheduler(slots=3, split_prefill=True)
    device = Device(sched, {"a": [100, 101, 102, 103], "b": [200, 201], "c": [300, 301]})
    assert sched.plan_first_part() == "prefill"  # nothing decodes
    assert device.prefill("a", 4) == 0
    assert sched.plan_first_part() == "sam"  # a decodes now
    assert device.prefill("b", 2, "sam") == 1 and sched.prefilling
    with pytest.raises(AssertionError, match="one page's prefill is split at a time"):
        sched.plan_prefill(sched.admit(request("c", 2)), "sam")
    decode = device.decode()
    assert decode is not None and decode.rows == (0,)  # b is not prefilled yet
    join = device.join()
    assert join is not None and (join.slot, join.part, join.ends_prefill) == (1, "join", True)
    assert not sched.prefilling and device.join() is None
    decode = device.decode()
    assert decode is not None and decode.rows == (0, 1)
    device.decode()
    device.read()
    done = {o.request_id: o for o in sched.events([]).finished}
    assert done["a"].token_ids == [100, 101, 102, 103] and done["b"].token_ids == [200, 201]
    parts = [(s.kind, s.occupancy, s.prompt_tokens, s.request_id) for s in sched.steps if s.kind != "decode"]
    assert parts == [("prefill", 1, 30, "a"), ("sam", 0, 0, "b"), ("join", 1, 30, "b")]
    b = done["b"].metrics
    sam, join_step = (s for s in sched.steps if s.request_id == "b")
    assert b.prefill_started_s == sam.started_s and b.token_s[0] == join_step.ended_s
    # Its prefill: its two parts' time, not the decode step between them (which its TTFT holds).
    assert (b.prefill_ms, b.vision_ms) == (1000.0, 200.0) and b.prefill_to_first_token_ms == 2500.0


def test_a_failed_part_drops_its_page_and_frees_its_slot_to_be_cleared():
    sched = scheduler(slots=2, split_prefill=True)
    device = Device(sched, {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7]})
    device.prefill("a", 3)
    device.prefill("b", 2, "sam")
    plan = sched.plan_join()
    assert plan is not None and plan.slot == 1
    sched.failed(plan)  # the runner raised launching it
    device.read()
    assert not sched.prefilling and sched.free_slots == 1 and sched.in_flight == 1
    again = sched.plan_prefill(sched.admit(request("c", 2)), "sam")
    assert (again.slot, again.clear) == (1, (1,))  # the failed page's slot, reset before c's launch


def test_a_page_is_split_only_while_the_pages_decoding_outnumber_those_that_could_join():
    """Whole while a batch fills (or a wave of pages ends together): splitting would hold more pages back
    a step than it spares decoding pages a long one."""
    sched = scheduler(slots=4, split_prefill=True)
    device = Device(sched, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]})
    device.prefill("a", 4)
    for name in ("c", "d"):
        sched.submit(request(name, 4))
    assert sched.plan_first_part() == "prefill"  # 1 decoding, 2 could join
    device.prefill("b", 4)
    assert sched.plan_first_part() == "prefill"  # 2 decoding, 2 could join: not outnumbered
    sched.next_waiting()  # c leaves the queue (as the engine takes it)
    assert sched.plan_first_part() == "sam"  # 2 decoding, 1 could join
    assert scheduler(slots=4).plan_first_part() == "prefill"  # splitting off
