"""A report of a run whose submit could not reach the broker: it says first that the jobs were never
sent and how to send them, rather than print empty tables and plots scaled to nothing. The run is made
by a real `dsocr submit` against a port where no broker listens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from browser import chromium_path, layout
from click.testing import CliRunner

from dsocr_workers.cli import main

UNREACHABLE_BROKER = "redis://127.0.0.1:1/0"  # port 1: nothing listens there


@pytest.fixture
def unsent_run(tmp_path, make_png, subprocess_env) -> tuple[str, str, str]:
    """(database URL, run id, queue) of a run recorded by a submit whose broker was unreachable."""
    for name in ("a.png", "b.png", "c.png"):
        make_png(name, folder=tmp_path / "pages")
    listing = tmp_path / "pages" / "list.txt"
    listing.write_text("a.png\nb.png\nc.png\n")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url, "DSOCR_BROKER_URL": UNREACHABLE_BROKER, "DSOCR_QUEUE": "q1"}
    upgraded = subprocess.run([sys.executable, "-m", "dsocr_workers", "db", "upgrade"], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert upgraded.returncode == 0, upgraded.stderr
    submitted = subprocess.run([sys.executable, "-m", "dsocr_workers", "submit", str(listing), "--mode", "tiny"],
                               env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert submitted.returncode == 3, submitted.stderr  # the broker is unavailable: a transient error
    run_id = submitted.stdout.split()[1].rstrip(":")  # "run ID: 3 jobs recorded"
    return url, run_id, "q1"


def report(url: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["report", "--run", "latest", *args], env={"DSOCR_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_report_says_the_jobs_were_never_sent(unsent_run):
    url, run_id, queue = unsent_run
    expected = (f"NOT SENT: 3 of 3 jobs of run {run_id} were never sent to the broker (3 pending: its submit could "
                f"not reach it); run `dsocr reconcile --run {run_id}` once it is reachable, then a worker on queue "
                f"{queue} takes them")  # fmt: skip
    document = json.loads(report(url, "--format", "json"))
    assert document["warnings"][0] == expected
    text = report(url, "--format", "md")
    assert expected in text and text.index(expected) < text.index("Latency and output")


def test_html_of_a_run_never_sent_draws_no_empty_plot(unsent_run, tmp_path):
    chromium_path()  # skips where there is no Chromium
    url, run_id, _ = unsent_run
    page = tmp_path / "unsent.html"
    report(url, "--html", str(page))
    seen = layout(page, tmp_path)
    assert seen.images == []  # no axis from -0.04 to 0.04 ms over nothing
    assert seen.warnings[0].startswith(f"WARNING: NOT SENT: 3 of 3 jobs of run {run_id} were never sent")
    assert "No plots: no job of this report has a result yet." in page.read_text(encoding="utf-8")


@pytest.mark.redis
def test_report_of_a_run_sent_but_not_run_says_so(tmp_path, make_png, subprocess_env, broker_env):
    make_png("a.png", folder=tmp_path / "pages")
    listing = tmp_path / "pages" / "list.txt"
    listing.write_text("a.png\n")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": url}
    for args in (["db", "upgrade"], ["submit", str(listing), "--mode", "tiny"]):
        done = subprocess.run([sys.executable, "-m", "dsocr_workers", *args], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip().splitlines()[-1]
    warnings = json.loads(report(url, "--format", "json"))["warnings"]
    assert warnings[0] == f"NO RESULT YET: 1 of 1 jobs of run {run_id} are waiting or running (`dsocr status --run {run_id}`)"
