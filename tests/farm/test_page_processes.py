"""The page-preparing processes (farm/job/page_processes.py: batched jobs' pages, batch-1 prefetches on a
GPU), on real sessions of both families and real images: a page they send back is
`DeepSeekOCRSession.prepare`'s bit for bit, out of shared memory, its `preprocess` stage on its clock; a
bad image fails its page alone with its message; a process that dies is replaced; none outlives the
pool's close, nor a process that held one killed with -9."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.errors import InputError
from dsocr_workers.farm.job.page_processes import ORDERS_PER_PROCESS, PageProcesses
from dsocr_workers.farm.job.prefetch import PagePlan
from dsocr_workers.farm.run_options import ModelKey
from dsocr_workers.model.preprocess import PreparedPage

DEMO = Path(os.environ.get("OMNIDOCBENCH_DEMO_DIR")
            or Path(__file__).resolve().parents[3] / "shared" / "data" / "omnidocbench-demo")  # fmt: skip
# Three of OmniDocBench's demo pages where they are (tiles 3x2 and 2x3 in gundam), and pages drawn here:
# one that fits a tile, a wide and a tall one.
DEMO_PAGES = sorted((DEMO / "images").glob("*.jpg"))[:3] if (DEMO / "images").is_dir() else []
DRAWN = {"small.png": (320, 420), "wide.png": (1600, 900), "tall.png": (700, 2000)}
# Each family's gundam cuts tiles; these modes do not.
NO_TILES = {"tiny": "base", "ocr2-tiny": "small"}


def child_pids(pid: int) -> set[int]:
    """The processes `pid` started (any of its threads), as /proc lists them."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids.update(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue
    return pids


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def assert_same_page(got: PreparedPage, expected: PreparedPage) -> None:
    for field in dataclasses.fields(expected):
        ours, theirs = getattr(got, field.name), getattr(expected, field.name)
        if isinstance(theirs, torch.Tensor):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), field.name
            assert not ours.is_shared(), f"{field.name} is still in shared memory"
        else:
            assert ours == theirs, field.name


@pytest.fixture(scope="module", params=["tiny", "ocr2-tiny"])
def pooled(request):
    """A session of the preset and a pool of two processes for it."""
    session = DeepSeekOCRSession.from_local(request.param)
    pool = PageProcesses(session, 2)
    pool.wait_ready()
    yield session, pool
    pool.kill()


@pytest.fixture
def pages(make_png) -> list[Path]:
    return [*DEMO_PAGES, *(make_png(name, size) for name, size in DRAWN.items())]


@pytest.mark.parametrize("tiles", [True, False], ids=["gundam", "no-tiles"])
def test_a_page_from_the_processes_is_the_sessions_own_bit_for_bit(pooled, pages, tiles):
    session, pool = pooled
    mode = "gundam" if tiles else NO_TILES[session.source.name]
    clocks = [session.new_clock(str(i), marks_steps=False) for i in range(len(pages))]
    futures = [pool.submit(str(page), None, mode, clock) for page, clock in zip(pages, clocks, strict=True)]
    grids = set()
    for page, clock, future in zip(pages, clocks, futures, strict=True):
        prepared = future.result()
        assert prepared.clock is clock
        with torch.inference_mode():  # as `prepare_job` prepares a page
            expected = session.prepare(str(page), None, mode)
        assert_same_page(prepared.page, expected)
        clock.finish()
        assert clock.count("preprocess") == 1 and clock.ms("preprocess") > 0
        grids.add(prepared.page.crop_grid)
    assert (len(grids) > 1) == tiles  # tiles, of more than one grid, in the mode that cuts them


def test_a_prefetched_page_comes_from_the_processes_and_is_prepared_here_once_they_are_gone(
    pooled, make_png, monkeypatch, caplog
):
    """A batch-1 job's page prefetched on a GPU (`PagePlan.prepare` with the processes) is the session's
    own, prepared in a process on the job's clock; with the processes stopped it is prepared here."""
    session, pool = pooled
    image = make_png("prefetched.png", (1600, 900))
    plan = PagePlan("job-7", image, None, "gundam", ModelKey(session.source.name))
    with torch.inference_mode():
        expected = session.prepare(str(image), None, "gundam")
    with monkeypatch.context() as patch:
        patch.setattr(session, "prepare_job", lambda *a, **k: pytest.fail("prepared in this process"))
        prepared = plan.prepare(session, pool)
    assert_same_page(prepared.page, expected)
    assert prepared.clock.job_id == "job-7"
    prepared.clock.finish()
    assert prepared.clock.count("preprocess") == 1 and prepared.clock.ms("preprocess") > 0
    stopped = PageProcesses(session, 1)
    stopped.kill()
    with caplog.at_level("WARNING", logger="dsocr.worker"):
        here = plan.prepare(session, stopped)
    assert_same_page(here.page, expected)
    assert "job job-7: no page-preparing process; its page is prepared here" in caplog.text


def test_a_pool_is_ready_once_every_process_started_and_not_once_it_stopped(pooled):
    """`ready`: what a batch-1 prefetch asks before handing a page over (a pool still starting would make
    the page wait seconds for it; the thread prepares it instead)."""
    session, _ = pooled
    starting = PageProcesses(session, 1)
    try:
        assert not starting.ready
        starting.wait_ready()
        assert starting.ready
    finally:
        starting.kill()
    assert not starting.ready


def test_a_bad_image_fails_its_page_alone_with_its_message(pooled, make_png, tmp_path):
    session, pool = pooled
    good = make_png("good.png", (640, 800))
    not_an_image = tmp_path / "text.png"
    not_an_image.write_bytes(b"no image here")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:600])
    paths = [good, not_an_image, truncated, good]
    futures = [pool.submit(str(path), None, "gundam", session.new_clock()) for path in paths]
    with pytest.raises(InputError, match=r"text\.png: not an image"):
        futures[1].result()
    with pytest.raises(InputError, match=r"truncated\.png: cannot decode image \(truncated or corrupt\)"):
        futures[2].result()
    expected = session.prepare(str(good), None, "gundam")
    for future in (futures[0], futures[3]):
        assert_same_page(future.result().page, expected)
    # An option the family refuses fails its page the same way.
    with pytest.raises(InputError, match="mode 'huge'"):
        pool.submit(str(good), None, "huge", session.new_clock()).result()


def test_a_page_cancelled_before_a_process_takes_it_is_dropped(pooled, make_png):
    session, pool = pooled
    big, small = make_png("big.png", (3000, 4000)), make_png("small.png")
    most = pool.processes * ORDERS_PER_PROCESS
    taken = [pool.submit(str(big), None, "gundam", session.new_clock()) for _ in range(most)]
    dropped = pool.submit(
        str(small), None, "gundam", session.new_clock()
    )  # waits: each process holds its most
    assert dropped.cancel() and not any(future.cancel() for future in taken)
    after = pool.submit(str(small), None, "gundam", session.new_clock())
    for future in (*taken, after):
        assert future.result().page.prompt_tokens > 0
    assert dropped.cancelled()


def test_a_process_that_dies_fails_only_its_page_and_another_takes_its_place(make_png):
    session = DeepSeekOCRSession.from_local("tiny")
    before = child_pids(os.getpid())
    pool = PageProcesses(session, 1)
    try:
        pool.wait_ready()
        (first,) = child_pids(os.getpid()) - before
        held, page = make_png("held.png", (3000, 4000)), make_png("page.png", (900, 1200))
        lost = pool.submit(str(held), None, "gundam", session.new_clock())  # handed to the one process
        os.kill(first, signal.SIGKILL)  # long before a page of 12 MP is prepared
        with pytest.raises(RuntimeError, match=r"the process preparing this page ended \(exit status -9\)"):
            lost.result()
        after = pool.submit(str(page), None, "gundam", session.new_clock())  # waits for the next process
        assert_same_page(after.result().page, session.prepare(str(page), None, "gundam"))
        (second,) = child_pids(os.getpid()) - before
        assert second != first and not running(first)
    finally:
        pool.close()


def test_the_processes_are_gone_after_close_and_later_pages_fail(make_png):
    session = DeepSeekOCRSession.from_local("tiny")
    before = child_pids(os.getpid())
    pool = PageProcesses(session, 2)
    pool.wait_ready()
    page = make_png("page.png")
    prepared = pool.submit(str(page), None, "gundam", session.new_clock())
    started = child_pids(os.getpid()) - before
    assert len(started) == 2
    pool.close()
    assert prepared.done() and prepared.exception() is None  # the page in flight came back first
    assert not [pid for pid in started if running(pid)]
    with pytest.raises(RuntimeError, match="page preparation stopped"):
        pool.submit(str(page), None, "gundam", session.new_clock()).result()



def test_a_start_past_its_time_fails_the_pool_and_close_kills_its_processes(make_png):
    session = DeepSeekOCRSession.from_local("tiny")
    before = child_pids(os.getpid())
    pool = PageProcesses(session, 2)
    with pytest.raises(RuntimeError, match="not ready within 0 s"):
        pool.wait_ready(timeout_s=0.0)  # no process imports torch in no time
    started = child_pids(os.getpid()) - before
    with pytest.raises(RuntimeError, match="not ready within"):
        pool.submit(str(make_png("page.png")), None, "gundam", session.new_clock()).result()
    assert not pool.serves(session)
    pool.close()
    assert not [pid for pid in started if running(pid)]

HOLDER = """
import time

from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.farm.job.page_processes import PageProcesses

pool = PageProcesses(DeepSeekOCRSession.from_local("tiny"), 2)
pool.wait_ready()
print("ready", flush=True)
time.sleep(600)
"""


def test_the_processes_die_with_a_process_killed_with_minus_9(tmp_path, subprocess_env):
    holder = tmp_path / "holder.py"
    holder.write_text(HOLDER)
    process = subprocess.Popen(
        [sys.executable, str(holder)], env=subprocess_env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        started = child_pids(process.pid)
        assert len(started) == 2
        process.kill()
        process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if running(pid)]
    finally:
        process.kill()
