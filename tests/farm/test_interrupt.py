"""`dsocr run` interrupted as Ctrl-C does (SIGINT to the real process), on SQLite with the tiny preset: it
hands back the jobs it holds, marks the run interrupted, exits 130 and prints `dsocr resume RUN`, which
`dsocr status` and `dsocr report` repeat; that command then runs the rest."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from test_workers import dsocr

from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, JobAttempt, Run, WorkerProcess

SAMPLES = Path(__file__).resolve().parents[2] / "datasets" / "samples" / "samples.txt"  # 7 pages
JOBS = 7
# Long enough a job (most of a second here) that a job is still in hand when the signal lands.
RUN_OPTIONS = ("--mode", "tiny", "--max-new-tokens", "48", "--gpus", "cpu", "--format", "json")


# `dsocr run` with SIGINT at its default, as a terminal's foreground process has it: a suite started in
# the background (`cmd &`) passes SIGINT on ignored, and Python then never raises KeyboardInterrupt.
AS_IN_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); import dsocr_workers.__main__"


def start_run(env: dict[str, str], *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", AS_IN_A_TERMINAL, "run", str(SAMPLES), *RUN_OPTIONS, *options],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(db_path: Path, query: str, process: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until `query` (one value) is true in the ledger the run writes; fails if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            with sqlite3.connect(db_path, timeout=5) as connection:
                if connection.execute(query).fetchone()[0]:
                    return
        except sqlite3.OperationalError:  # no schema yet
            pass
        time.sleep(0.02)
    raise AssertionError(f"not seen in {timeout} s: {query}")


def interrupted(process: subprocess.Popen[str]) -> tuple[str, str]:
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err  # not click's "Aborted!" (1)
    return out, err


def warnings_of(run_id: str, env: dict[str, str]) -> list[str]:
    report = dsocr("report", "--run", run_id, "--format", "json", env=env)
    assert report.returncode == 0, report.stderr
    return json.loads(report.stdout)["warnings"]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_an_interrupted_run_hands_back_its_jobs_says_so_and_resumes(concurrency, tmp_path, subprocess_env):
    db_path = tmp_path / "embedded.db"
    url = f"sqlite:///{db_path}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    process = start_run(env, "--concurrency", str(concurrency))
    # A result written and a job just claimed (most of its time ahead of it): the signal lands mid-run, the job in hand.
    wait_for(db_path, "select (select count(*) from results) > 0 and (select count(*) from jobs where state = "
                      "'running' and julianday('now') - julianday(started_at) < 0.25 / 86400) > 0", process)  # fmt: skip
    _, err = interrupted(process)

    db = open_database(url)
    with db.transaction() as session:
        (run,) = session.scalars(select(Run)).all()
        jobs = session.scalars(select(Job)).all()
        (beating,) = session.scalars(select(WorkerProcess)).all()
        run_id, interrupted_at = run.id, run.interrupted_at
        states = [(job.state, job.attempts, job.lease_owner, job.last_error_class) for job in jobs]
    assert f"interrupted; {sum(s != 'done' for s, *_ in states)} of {JOBS} jobs not final" in err
    assert f"\n  dsocr resume {run_id}\n" in err
    # Nothing left running under the stopped process: the jobs it held are queued again, their attempt not
    # counted, and the others never started.
    # The run's stderr with it: a clean stop not recorded is logged there ("could not record the stop").
    # The run's warnings and errors first (a long traceback after one pushes it out of the tail), then the tail.
    warned = [line for line in err.splitlines() if line.startswith(("could not", "heartbeat of")) or "Error: " in line]
    assert interrupted_at is not None and beating.stopped_at is not None, "\n".join([*warned, err[-4000:]])
    assert 0 < sum(state == "done" for state, *_ in states) < JOBS
    handed_back = [s for s in states if s[0] == "queued"]
    assert handed_back and all(s == ("queued", 0, None, "Interrupted") for s in handed_back), states
    assert all(s[:3] in (("done", 1, None), ("queued", 0, None), ("pending", 0, None)) for s in states), states

    status = dsocr("status", "--run", run_id, env=env)
    assert status.returncode == 0 and f"interrupted: its jobs were handed back; `dsocr resume {run_id}`" in status.stdout
    assert "running 0" in status.stdout
    (warning,) = [w for w in warnings_of(run_id, env) if not w.startswith("RANDOM WEIGHTS")]
    assert warning.startswith(f"INTERRUPTED: run {run_id} was interrupted with ") and f"dsocr resume {run_id}" in warning

    resumed = dsocr("resume", run_id, "--gpus", "cpu", "--format", "json", env=env)
    assert resumed.returncode == 0, resumed.stderr
    facts = {row["field"]: row["value"] for row in json.loads(resumed.stdout)["tables"]["Run"]}
    assert (facts["jobs"], facts["ok"], facts["not finished"]) == (JOBS, JOBS, 0)
    with db.transaction() as session:
        assert session.get_one(Run, run_id).interrupted_at is None
        # One counted attempt each: the interrupted one was given back, not failed.
        assert {(job.state, job.attempts) for job in session.scalars(select(Job))} == {("done", 1)}
        claims = len(session.scalars(select(JobAttempt)).all())
    db.dispose()
    assert claims == JOBS + len(handed_back)
    assert all(w.startswith("RANDOM WEIGHTS") for w in warnings_of(run_id, env))


def test_ctrl_c_during_the_warm_up_exits_130_and_the_run_waits_to_be_resumed(tmp_path, subprocess_env):
    db_path = tmp_path / "embedded.db"
    url = f"sqlite:///{db_path}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    process = start_run(env)
    # Its process beats: it opens and warms its model now, before its first claim.
    wait_for(db_path, "select count(*) from worker_processes", process)
    _, err = interrupted(process)

    db = open_database(url)
    with db.transaction() as session:
        (run,) = session.scalars(select(Run)).all()
        run_id, interrupted_at = run.id, run.interrupted_at
        jobs = [(job.state, job.attempts, job.reserved_by) for job in session.scalars(select(Job))]
        claims = session.scalars(select(JobAttempt)).all()
    db.dispose()
    assert claims == [] and jobs == [("pending", 0, None)] * JOBS  # nothing claimed, its reservation dropped
    assert interrupted_at is not None
    assert f"interrupted; {JOBS} of {JOBS} jobs not final, handed back. To run them:\n  dsocr resume {run_id}\n" in err
    (warning,) = [w for w in warnings_of(run_id, env) if not w.startswith("RANDOM WEIGHTS")]
    assert warning.startswith(f"INTERRUPTED: run {run_id} was interrupted with {JOBS} of {JOBS} jobs not finished")
