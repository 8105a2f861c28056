"""How a lane tells its child the jobs it fetched for it (farm/celery/worker.py `NextMessage`): every
message listed is shown, so the child reserves each of them (a lane fetches two as it connects, while its
child still imports and warms up: an unreserved one would be taken back by a sweep as a dead worker's),
and a job's next one is the first listed that is not that job. The child is a real fork: the ids cross in
shared memory, the wake-ups through the semaphore."""

from __future__ import annotations

import multiprocessing
import threading

from dsocr_workers.farm.celery.worker import NextMessage


def _follow_in_child(lane: NextMessage, reserved, done) -> None:
    stopping = threading.Event()
    thread = threading.Thread(target=lane.follow, args=(reserved.put, stopping), daemon=True)
    thread.start()
    done.wait(30)
    stopping.set()
    thread.join(5)


def test_the_child_reserves_every_listed_job_once_and_learns_the_next_one():
    context = multiprocessing.get_context("fork")
    lane = NextMessage()
    reserved, done = context.Queue(), context.Event()
    child = context.Process(target=_follow_in_child, args=(lane, reserved, done))
    child.start()
    try:
        lane.fetched("a")
        lane.fetched("b")  # both at once, before the child started either
        assert {reserved.get(timeout=10), reserved.get(timeout=10)} == {"a", "b"}
        assert lane.after("a", wait_s=0) == "b" and lane.after("z", wait_s=0) == "a"
        lane.gone("a")  # the child started it
        lane.fetched("c")
        assert reserved.get(timeout=10) == "c"  # b is not reserved again
        assert lane.after("b", wait_s=0) == "c"
        lane.gone("b")
        lane.gone("c")
        assert lane.after("c", wait_s=0.05) is None
        assert reserved.empty()
    finally:
        done.set()
        child.join(10)
    assert child.exitcode == 0
