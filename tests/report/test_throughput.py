"""Steady-state and wall-clock throughput on constructed timestamps (report/throughput.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pytest
from fakes import Page, add_session, make_run, session_pid, set_times
from sqlalchemy import select

from dsocr_workers.report.build import comparison_report, single_report
from dsocr_workers.report.queries import load_run
from dsocr_workers.report.stats import rate_sum
from dsocr_workers.report.throughput import (
    batched_rates,
    device_busy_share,
    device_idle_ms,
    device_ms_per_page,
    services,
    steady_state_throughput,
    throughput_ratio,
    wall_clock_s,
)
from dsocr_workers.store.models import BatchStep, Job, Result, job_id_for

T0 = datetime(2026, 11, 23, 8, 0, 0)


def back_to_back(database, folder, make_png, sessions: dict[str, float], jobs: int, durations=None) -> str:
    """A run whose sessions (id → how long its model took to load and warm up, from T0) each do `jobs` jobs
    back to back from their ready time, of `durations(session, k)` seconds (1 s by default)."""
    for sid, ready_s in sessions.items():
        add_session(database, sid, T0, T0 + timedelta(seconds=ready_s))
    pages = {(f"{sid}-{k}.png", 0): Page(1.0, session=sid) for sid in sessions for k in range(jobs)}
    run = make_run(database, folder, make_png, pages)
    times = {}
    for sid, ready_s in sessions.items():
        at = ready_s
        for k in range(jobs):
            d = durations(sid, k) if durations else 1.0
            # claimed (started) at T0: the prefetched job waited behind loading and the previous job
            times[(f"{sid}-{k}.png", 0)] = (0.0, at + d)
            at += d
    set_times(database, run, T0, times)
    return run


def load(database, run):
    with database.transaction() as session:
        return load_run(session, run)


def test_two_sessions_back_to_back_make_two_pages_per_second(database, tmp_path, make_png):
    quick = back_to_back(database, tmp_path / "quick", make_png, {"q1": 1.0, "q2": 1.0}, jobs=5)
    slow = back_to_back(database, tmp_path / "slow", make_png, {"s1": 60.0, "s2": 60.0}, jobs=5)
    data_quick, data_slow = load(database, quick), load(database, slow)

    for data in (data_quick, data_slow):  # a long load before the first job does not lower it
        steady = steady_state_throughput(data)
        assert steady.value == pytest.approx(2.0) and steady.n == 10
        assert steady.low is None  # every job took exactly 1 s: no spread, no interval
    assert wall_clock_s(data_quick) == pytest.approx(6.0) and wall_clock_s(data_slow) == pytest.approx(65.0)

    document = single_report(data_slow)
    throughput = {row[0]: row[1] for row in document.tables[1].rows}
    assert throughput["pages/s (steady state)"].value == pytest.approx(2.0)
    assert throughput["pages/s (wall clock)"] == pytest.approx(10 / 65)
    lanes = {row[1]: row for row in next(t for t in document.tables if t.title == "Worker processes").rows}
    assert lanes[session_pid("s1")][4:10] == [1, 45.0, 15.0, "gundam", 5, 0]  # sessions, load s, warm-up s, …


def test_idle_time_and_cold_jobs_are_not_steady_state(database, tmp_path, make_png):
    # s1: its first job is cold (30 s: a compilation), then 1-s jobs; s2: 1-s jobs with 10 s of idle
    # (an empty queue) before each.
    add_session(database, "s1", T0, T0 + timedelta(seconds=5))
    add_session(database, "s2", T0, T0 + timedelta(seconds=5))
    pages = {("c.png", 0): Page(1.0, cold_reason="compile: gundam 2x3", session="s1")}
    pages |= {(f"a{k}.png", 0): Page(1.0, session="s1") for k in range(4)}
    pages |= {(f"b{k}.png", 0): Page(1.0, session="s2") for k in range(4)}
    run = make_run(database, tmp_path, make_png, pages)
    times = {("c.png", 0): (5.0, 35.0)} | {(f"a{k}.png", 0): (0.0, 36.0 + k) for k in range(4)}
    times |= {(f"b{k}.png", 0): (5.0 + 11 * k + 10, 5.0 + 11 * k + 11) for k in range(4)}
    set_times(database, run, T0, times)
    data = load(database, run)

    assert steady_state_throughput(data).value == pytest.approx(2.0)
    with_cold = steady_state_throughput(data, include_cold=True)
    assert with_cold.value == pytest.approx(5 / 34 + 1.0) and with_cold.n == 9
    assert with_cold.low is not None and with_cold.low < with_cold.value < with_cold.high


def test_interval_and_ratio_of_runs(database, tmp_path, make_png):
    rng = np.random.default_rng(7)

    def noisy(_sid, _k):
        return float(rng.uniform(0.8, 1.2))

    two = back_to_back(database, tmp_path / "b", make_png, {"b1": 2.0, "b2": 2.0}, jobs=8, durations=noisy)
    one = back_to_back(database, tmp_path / "a", make_png, {"a1": 2.0}, jobs=8, durations=noisy)
    b, a = load(database, two), load(database, one)
    steady = steady_state_throughput(b)
    assert steady.low < steady.value < steady.high and 1.6 < steady.value < 2.4

    ratio = throughput_ratio(b, a)
    assert 1.6 < ratio.value < 2.4 and 1 < ratio.low < ratio.value < ratio.high
    row = next(t for t in comparison_report(a, b).tables if t.title == "Throughput").rows[0]
    assert row[0] == "pages/s (steady state)" and row[3] == ratio and row[4] == "B higher"

    same = throughput_ratio(a, a)
    assert same.value == pytest.approx(1.0) and same.low < 1 < same.high


def test_results_without_sessions_are_grouped_by_worker(database, tmp_path, make_png):
    run = make_run(database, tmp_path, make_png, {(f"p{k}.png", 0): Page(1.0) for k in range(4)})
    set_times(database, run, T0, {(f"p{k}.png", 0): (0.5 * k, 0.5 * k + 0.5) for k in range(4)})
    data = load(database, run)
    assert steady_state_throughput(data).value == pytest.approx(2.0)
    assert wall_clock_s(data) == pytest.approx(2.0)


def test_sessions_of_one_process_are_one_lane(database, tmp_path, make_png):
    # One worker process warms a model (w1), runs 3 one-second jobs, warms another mode for 20 s (w2, a
    # new session in the same process) and runs 3 more: one lane at 1 page/s, not two lanes summed.
    add_session(database, "w1", T0, T0 + timedelta(seconds=5), pid=777)
    add_session(database, "w2", T0 + timedelta(seconds=8), T0 + timedelta(seconds=28), pid=777)
    pages = {(f"a{k}.png", 0): Page(1.0, session="w1") for k in range(3)}
    pages |= {(f"b{k}.png", 0): Page(1.0, session="w2") for k in range(3)}
    run = make_run(database, tmp_path, make_png, pages)
    times = {(f"a{k}.png", 0): (0.0, 6.0 + k) for k in range(3)}
    times |= {(f"b{k}.png", 0): (0.0, 29.0 + k) for k in range(3)}
    set_times(database, run, T0, times)
    data = load(database, run)
    assert steady_state_throughput(data).value == pytest.approx(1.0)
    lanes = next(t for t in single_report(data).tables if t.title == "Worker processes").rows
    assert [(row[1], row[4], row[5] + row[6], row[8]) for row in lanes] == [(777, 2, 25.0, 6)]


def test_the_device_idles_between_jobs_only_while_work_waits_within_a_session(database, tmp_path, make_png):
    # One worker process: four jobs back to back on its device, a fifth submitted only after the fourth had
    # finished (the worker waited for work, the device was not kept waiting), then a sixth after it loaded
    # another model (a new session).
    add_session(database, "m1", T0, T0 + timedelta(seconds=1), pid=901)
    add_session(database, "m2", T0 + timedelta(seconds=7), T0 + timedelta(seconds=9), pid=901)
    spans = {"a0": (0.0, 1.0), "a1": (1.004, 2.0), "a2": (2.010, 3.0), "a3": (3.002, 4.0), "late": (5.5, 6.0),
             "b0": (10.0, 11.0)}  # fmt: skip
    pages = {(f"{name}.png", 0): Page(1.0, session="m2" if name == "b0" else "m1") for name in spans}
    run = make_run(database, tmp_path, make_png, pages)
    with database.transaction() as session:
        for name, (started, finished) in spans.items():
            job_id = job_id_for(run, f"{name}.png", 0)
            session.get_one(Job, job_id).created_at = T0 + timedelta(seconds=5.0 if name == "late" else 0.0)
            result = session.scalars(select(Result).where(Result.job_id == job_id)).one()
            result.device_started_at = T0 + timedelta(seconds=started)
            result.device_finished_at = T0 + timedelta(seconds=finished)
    data = load(database, run)
    ((lane, idle),) = device_idle_ms(data).items()
    assert idle == pytest.approx([4.0, 10.0, 2.0])
    assert sorted(device_ms_per_page(data)[lane]) == pytest.approx([500.0, 990.0, 996.0, 998.0, 1000.0, 1000.0])
    table = next(t for t in single_report(data).tables if t.title == "Worker processes")
    (row,) = [dict(zip(table.columns, r, strict=True)) for r in table.rows]
    assert row["prefetched"] == 0 and row["device idle between jobs p50 ms"].value == pytest.approx(4.0)


def queued_at(database, run: str, at: datetime) -> None:
    with database.transaction() as session:
        for job in session.scalars(select(Job).where(Job.run_id == run)):
            job.queued_at = at


def test_the_farm_between_jobs_counts_while_work_waits(database, tmp_path, make_png):
    # Every job queued at T0; the worker, ready at 1 s, claims each job 0.1 s after the previous one
    # finished (result written, message delivered, claim) and runs it for 0.9 s: one page a second, not
    # the 1.11 that counting from the claim made of it.
    add_session(database, "f1", T0, T0 + timedelta(seconds=1))
    pages = {(f"p{k}.png", 0): Page(1.0, session="f1") for k in range(4)}
    run = make_run(database, tmp_path, make_png, pages)
    set_times(database, run, T0, {(f"p{k}.png", 0): (1.1 + k, 2.0 + k) for k in range(4)})
    queued_at(database, run, T0)
    assert steady_state_throughput(load(database, run)).value == pytest.approx(1.0)


def test_a_lanes_work_for_another_run_is_not_this_runs(database, tmp_path, make_png):
    # One worker process alternates between run A's jobs and run B's, all queued at T0, one second each:
    # each run's own pace on that lane is one page a second, whatever the other run took in between.
    add_session(database, "x1", T0, T0 + timedelta(seconds=1))
    run_a = make_run(database, tmp_path / "a", make_png, {(f"a{k}.png", 0): Page(1.0, session="x1") for k in range(3)})
    run_b = make_run(database, tmp_path / "b", make_png, {(f"b{k}.png", 0): Page(1.0, session="x1") for k in range(3)})
    set_times(database, run_a, T0, {(f"a{k}.png", 0): (1.0 + 2 * k, 2.0 + 2 * k) for k in range(3)})
    set_times(database, run_b, T0, {(f"b{k}.png", 0): (2.0 + 2 * k, 3.0 + 2 * k) for k in range(3)})
    queued_at(database, run_a, T0)
    queued_at(database, run_b, T0)
    for run in (run_a, run_b):
        assert steady_state_throughput(load(database, run)).value == pytest.approx(1.0)


def test_the_device_share_pairs_each_job_between_jobs_with_its_own_device_time(database, tmp_path, make_png):
    # One session, six 1-s jobs back to back; the device ran 0.5 s of the first (its page read with
    # nothing to overlap: not between jobs) and 0.90 … 0.98 s of the others, which then run at 94% of
    # 1 / (device time per page) whatever the spread of those times.
    run = back_to_back(database, tmp_path, make_png, {"s": 1.0}, jobs=6)
    busy = [0.5, 0.90, 0.92, 0.94, 0.96, 0.98]
    with database.transaction() as session:
        for k, seconds in enumerate(busy):
            result = session.scalars(select(Result).where(Result.job_id == job_id_for(run, f"s-{k}.png", 0))).one()
            result.device_finished_at = T0 + timedelta(seconds=1.0 + k + 0.99)
            result.device_started_at = result.device_finished_at - timedelta(seconds=seconds)
    share = device_busy_share(load(database, run))
    assert share.value == pytest.approx(0.94) and share.n == 5
    assert share.low is not None and share.low < 0.94 < share.high < 0.98
    table = next(t for t in single_report(load(database, run)).tables if t.title == "Worker processes")
    (row,) = [dict(zip(table.columns, r, strict=True)) for r in table.rows]
    assert row["device share of a job between jobs"] == share


def batched_run(database, folder, make_png, sids: list[str], generations: int, drain_s: float) -> tuple[str, float]:
    """A run at concurrency 8 on each of `sids`' lanes: `generations` batches of 8 pages of 5 tokens each,
    one decode step every 10 ms (8 tokens), a batch every 50 ms, each batch's pages claimed when the one
    before finished; the last batch's finishes are spread over `drain_s` more (a slow drain). Returns the
    run and the pages/s a lane's steps make: 8 pages every 50 ms."""
    pages = {}
    for sid in sids:
        add_session(database, sid, T0, T0 + timedelta(seconds=1))
        pages |= {(f"{sid}-{k}.png", 0): Page(1.0, session=sid, steps=4) for k in range(8 * generations)}  # 5 tokens
    run = make_run(database, folder, make_png, pages)
    times = {}
    for sid in sids:
        for k in range(8 * generations):
            g = k // 8
            finish = 1 + 0.05 * (g + 1) + (drain_s * (k % 8) / 7 if g == generations - 1 else 0.0)
            times[(f"{sid}-{k}.png", 0)] = (1 + 0.05 * g, finish)
    set_times(database, run, T0, times)
    with database.transaction() as session:
        session.add_all(BatchStep(run_id=run, worker_session_id=sid, step_index=i, kind="decode", occupancy=8, bucket=8,
                                  started_at=T0 + timedelta(seconds=1 + 0.01 * i), duration_ms=10.0)
                        for sid in sids for i in range(5 * generations))  # fmt: skip
    return run, 8 / 0.05


def test_a_batched_runs_steady_state_is_its_steps_tokens_between_its_first_finish_and_last_claim(
    database, tmp_path, make_png
):  # fmt: skip
    """The jobs of a batched run overlap: their service times would be bursts and pauses (and a slow drain
    would count); its steps' tokens between the lane's first finish and its last claim, over the tokens a
    page makes, are its rate, with an interval from the window's bins."""
    run, expected = batched_run(database, tmp_path / "b", make_png, ["c1"], generations=12, drain_s=2.0)
    data = load(database, run)
    binned = batched_rates(data)
    assert list(binned) == list(services(data)) and len(next(iter(binned.values()))) >= 8
    steady = steady_state_throughput(data)
    assert steady.value == pytest.approx(expected, rel=0.05), steady
    # The service times' rate holds the drain: 96 pages over 0.6 s of batches and 2 s of draining.
    assert rate_sum([[(s.finished - s.began).total_seconds() for s in lane]
                     for lane in services(data).values()]).value < expected / 2  # fmt: skip
    # Two such lanes side by side: twice the rate.
    two, _ = batched_run(database, tmp_path / "b2", make_png, ["d1", "d2"], generations=12, drain_s=2.0)
    both = load(database, two)
    assert steady_state_throughput(both).value == pytest.approx(2 * expected, rel=0.05)
    ratio = throughput_ratio(both, data)
    assert ratio.value == pytest.approx(2.0, rel=0.05)
    assert ratio.low is None or ratio.low <= 2.0 <= ratio.high


def test_a_batch_whose_pages_join_together_is_binned_by_its_turnover(database, tmp_path, make_png):
    """A batch of 8 whose pages joined together finishes together: every 2.5 s, 0.5 s of its successors'
    prefills (a token each) then 2 s of decode steps (8 tokens every 50 ms). Bins of one second would
    rise and fall with that period; bins of a turnover each hold one of it: the rate, 8 pages every
    2.5 s, with a narrow interval."""
    add_session(database, "t1", T0, T0 + timedelta(seconds=1))
    generations, period = 12, 2.5
    pages = {(f"t-{k}.png", 0): Page(1.0, session="t1", steps=40) for k in range(8 * generations)}  # 41 tokens
    run = make_run(database, tmp_path, make_png, pages)
    times, steps = {}, []
    for g in range(generations):
        begin = 1 + period * g
        for k in range(8):  # claimed at the batch's start, a prefill each 62.5 ms, finished together
            times[(f"t-{8 * g + k}.png", 0)] = (begin, begin + period)
            steps.append(("prefill", 1, begin + 0.0625 * (k + 1)))
        steps += [("decode", 8, begin + 0.5 + 0.05 * (i + 1)) for i in range(40)]
    set_times(database, run, T0, times)
    with database.transaction() as session:
        session.add_all(BatchStep(run_id=run, worker_session_id="t1", step_index=i, kind=kind, occupancy=occupancy,
                                  bucket=8, started_at=T0 + timedelta(seconds=ended - 0.01), duration_ms=10.0)
                        for i, (kind, occupancy, ended) in enumerate(steps))  # fmt: skip
    data = load(database, run)
    (binned,) = batched_rates(data).values()
    assert len(binned) == 10  # the window, from the first finish to the last claim: 10 turnovers
    steady = steady_state_throughput(data)
    assert steady.value == pytest.approx(8 / period, rel=0.02), steady
    assert steady.high - steady.low < 0.04 * steady.value, steady
    # The same steps in one-second bins: their rates rise and fall with the batch.
    seconds = np.zeros(int(period * (generations - 1)))
    for _, occupancy, ended in steps:
        offset = ended - (1 + period)
        if 0 < offset <= len(seconds):
            seconds[min(int(offset), len(seconds) - 1)] += occupancy
    assert np.ptp(seconds / 41) > 0.5 * 8 / period
