"""File list validation and `dsocr submit` against the real Redis and PostgreSQL."""

from __future__ import annotations

import base64
import json
import os
import re

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import func, select

from dsocr_workers.cli import main
from dsocr_workers.farm.filelist import default_root, read_filelist
from dsocr_workers.store.db import open_database
from dsocr_workers.store.models import Job, Run, job_id_for


@pytest.fixture
def bad_list(tmp_path, make_png):
    root = tmp_path / "root"
    make_png("good.png", folder=root)
    make_png("name with spaces é.png", folder=root)
    make_png("outside.png", folder=tmp_path)
    (root / "empty.png").write_bytes(b"")
    (root / "text.png").write_text("not an image at all")
    (root / "truncated.png").write_bytes((root / "good.png").read_bytes()[:20])
    (root / "escape.png").symlink_to(tmp_path / "outside.png")
    (root / "sub").mkdir()
    listing = tmp_path / "list.txt"
    listing.write_text(
        "# a comment\n"
        "good.png\n"
        "\n"
        "missing.png\n"
        "empty.png\n"
        "text.png\n"
        "truncated.png\n"
        "../outside.png\n"
        "escape.png\n"
        "sub\n"
        "./good.png\n"
        "name with spaces é.png\n"
        f"{tmp_path / 'outside.png'}\n"
    )
    return listing, root


def test_every_bad_line_is_reported_with_its_reason(bad_list):
    listing, root = bad_list
    listed = read_filelist(listing, root)
    outside = (root.parent / "outside.png").resolve().as_posix()  # listed absolute: taken as written
    assert [(i.line, i.image) for i in listed.images] == [
        (2, "good.png"), (12, "name with spaces é.png"), (13, outside)
    ]
    reasons = {b.line: b.reason for b in listed.bad}
    assert set(reasons) == {4, 5, 6, 7, 8, 9, 10, 11}
    assert "no such file" in reasons[4]
    assert "empty" in reasons[5]
    assert "not an image" in reasons[6]
    assert reasons[7]  # truncated header: refused by its bytes
    assert reasons[8].startswith("is outside the root")
    assert "through a symlink" in reasons[9]
    assert "not a regular file" in reasons[10]
    assert reasons[11] == "duplicate of line 2"
    assert "--root DIR" in reasons[8]  # the way to a root that holds it


def test_a_line_the_file_system_refuses_is_one_short_bad_line(tmp_path, sqlite_url, monkeypatch):
    """A 200,000-character line and a 304-character file name: one line each, exit 2, nothing recorded."""
    listing = tmp_path / "odd.txt"
    listing.write_text("a" * 200_000 + "\n" + "b" * 300 + ".png\n")
    listed = read_filelist(listing, tmp_path)
    assert [b.line for b in listed.bad] == [1, 2] and not listed.images
    assert all(b.reason.startswith("cannot be opened: ") for b in listed.bad), listed.bad
    monkeypatch.setenv("DSOCR_DATABASE_URL", sqlite_url)
    runs_before = _count(sqlite_url, Run)
    for command in ("submit", "run"):
        result = CliRunner().invoke(main, [command, str(listing)])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and max(map(len, result.output.splitlines())) < 300, result.output
    assert _count(sqlite_url, Run) == runs_before


def test_default_root_is_the_datasets_source_data(tmp_path):
    subsets = tmp_path / "datasets" / "omni" / "subsets"
    subsets.mkdir(parents=True)
    assert default_root(subsets / "dev.txt") == subsets.resolve()
    (tmp_path / "datasets" / "omni" / "source-data").mkdir()
    assert default_root(subsets / "dev.txt") == (tmp_path / "datasets" / "omni" / "source-data").resolve()


def _queue_length(env: dict[str, str], queue: str) -> int:
    return redis.Redis.from_url(env["DSOCR_BROKER_URL"]).llen(env["DSOCR_BROKER_KEY_PREFIX"] + queue)


def _count(url: str, model) -> int:
    db = open_database(url)
    with db.transaction() as session:
        n = session.scalar(select(func.count()).select_from(model)) or 0
    db.dispose()
    return n


@pytest.mark.postgres
@pytest.mark.redis
def test_bad_list_refused_nothing_recorded_or_enqueued(bad_list, postgres_url, broker_env, monkeypatch):
    listing, root = bad_list
    queue = broker_env["DSOCR_QUEUE"] + "-refused"
    monkeypatch.setenv("DSOCR_DATABASE_URL", postgres_url)
    for key, value in broker_env.items():
        monkeypatch.setenv(key, value)
    runs_before = _count(postgres_url, Run)
    result = CliRunner().invoke(main, ["submit", str(listing), "--root", str(root), "--queue", queue])
    assert result.exit_code == 2, result.output
    for line in (4, 5, 6, 7, 8, 9, 10, 11):
        assert re.search(rf"list\.txt:{line}: ", result.output), result.output
    assert "nothing was recorded or enqueued" in result.output
    assert _count(postgres_url, Run) == runs_before
    assert _queue_length(broker_env, queue) == 0


@pytest.mark.postgres
@pytest.mark.redis
def test_submit_records_then_enqueues_json_job_ids(bad_list, postgres_url, broker_env, monkeypatch):
    listing, root = bad_list
    queue = broker_env["DSOCR_QUEUE"] + "-submit"
    monkeypatch.setenv("DSOCR_DATABASE_URL", postgres_url)
    for key, value in broker_env.items():
        monkeypatch.setenv(key, value)
    args = ["submit", str(listing), "--root", str(root), "--queue", queue, "--skip-invalid", "--repeats", "2",
            "--tag", "purpose=test", "--max-new-tokens", "8"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    run_id = result.output.strip().splitlines()[-1]
    assert f"dsocr status --run {run_id} --watch" in result.output

    db = open_database(postgres_url)
    with db.transaction() as session:
        run = session.get_one(Run, run_id)
        jobs = session.scalars(select(Job).where(Job.run_id == run_id)).all()
    db.dispose()
    assert run.random_weights and "RANDOM WEIGHTS" in run.model_label
    assert run.tags == {"purpose": "test"} and run.parameters["max_new_tokens"] == 8
    assert "postgres" not in json.dumps(run.parameters)  # no URL, no credential in the run row
    outside = (root.parent / "outside.png").resolve().as_posix()
    expected = {
        job_id_for(run_id, image, r) for image in ("good.png", "name with spaces é.png", outside) for r in (0, 1)
    }
    assert {j.id for j in jobs} == expected
    assert {j.state for j in jobs} == {"queued"}

    client = redis.Redis.from_url(broker_env["DSOCR_BROKER_URL"])
    messages = client.lrange(broker_env["DSOCR_BROKER_KEY_PREFIX"] + queue, 0, -1)
    assert len(messages) == 6
    bodies = []
    for raw in messages:
        message = json.loads(raw)
        assert message["content-type"] == "application/json"
        args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        assert kwargs == {}
        bodies.extend(args)
    assert sorted(bodies) == sorted(expected)
    client.delete(broker_env["DSOCR_BROKER_KEY_PREFIX"] + queue)


def test_broker_down_leaves_jobs_pending_for_reconcile(tmp_path, make_png, sqlite_url, monkeypatch):
    make_png("a.png", folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\n")
    monkeypatch.setenv("DSOCR_DATABASE_URL", sqlite_url)
    # A port nobody listens on: the broker is "down". Connection retries are bounded by Celery's defaults.
    monkeypatch.setenv("DSOCR_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CELERY_BROKER_CONNECTION_MAX_RETRIES", "0")
    result = CliRunner().invoke(main, ["submit", str(listing)])
    assert result.exit_code == 3, result.output
    assert "dsocr reconcile" in result.output
    db = open_database(sqlite_url)
    with db.transaction() as session:
        assert session.scalars(select(Job.state)).all() == ["pending"]
    db.dispose()
    assert os.environ["DSOCR_BROKER_URL"].endswith(":1/0")


@pytest.mark.redis
def test_reconcile_enqueues_what_the_broker_missed_and_status_counts(
    tmp_path, make_png, sqlite_url, broker_env, monkeypatch
):
    for name in ("a.png", "b.png"):
        make_png(name, folder=tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("a.png\nb.png\n")
    monkeypatch.setenv("DSOCR_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("DSOCR_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CELERY_BROKER_CONNECTION_MAX_RETRIES", "0")
    assert CliRunner().invoke(main, ["submit", str(listing)]).exit_code == 3

    queue = broker_env["DSOCR_QUEUE"] + "-reconcile"
    for key, value in broker_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DSOCR_QUEUE", queue)
    status = CliRunner().invoke(main, ["status", "--run", "latest"])
    assert status.exit_code == 0 and "0/2 final" in status.output and "pending 2" in status.output
    reconciled = CliRunner().invoke(main, ["reconcile", "--run", "latest"])
    assert reconciled.exit_code == 0, reconciled.output
    assert "enqueued: 2" in reconciled.output
    # The run remembers its queue (the default one when it was submitted), not today's DSOCR_QUEUE.
    client = redis.Redis.from_url(broker_env["DSOCR_BROKER_URL"])
    assert client.llen(broker_env["DSOCR_BROKER_KEY_PREFIX"] + "dsocr") == 2
    # Run again while the messages wait in their queue: nothing is sent twice.
    again = CliRunner().invoke(main, ["reconcile", "--run", "latest"])
    assert again.exit_code == 0 and "enqueued: 0" in again.output, again.output
    assert client.llen(broker_env["DSOCR_BROKER_KEY_PREFIX"] + "dsocr") == 2
    client.delete(broker_env["DSOCR_BROKER_KEY_PREFIX"] + "dsocr")
    runs = CliRunner().invoke(main, ["runs"])
    assert runs.exit_code == 0 and "list" in runs.output
    assert "queued 2" in CliRunner().invoke(main, ["status", "--run", "latest"]).output


def test_submit_needs_no_torch(bad_list, postgres_url, broker_env, subprocess_env):
    """A queue host submits with Pillow, SQLAlchemy and the broker client only: no torch import."""
    import subprocess
    import sys

    queue, (listing, root) = broker_env["DSOCR_QUEUE"] + "-no-torch", bad_list
    code = (
        "import sys; from click.testing import CliRunner; from dsocr_workers.cli import main; "
        f"r = CliRunner().invoke(main, ['submit', {str(listing)!r}, '--root', {str(root)!r}, '--skip-invalid', "
        f"'--mode', 'tiny', '--queue', {queue!r}]); "
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    env = {**subprocess_env, **broker_env, "DSOCR_DATABASE_URL": postgres_url}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    redis.Redis.from_url(broker_env["DSOCR_BROKER_URL"]).delete(broker_env["DSOCR_BROKER_KEY_PREFIX"] + queue)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_dataset_list_without_its_images_says_where_they_go_and_how_to_get_them(tmp_path):
    dataset = tmp_path / "mydata"
    (dataset / "subsets").mkdir(parents=True)
    (dataset / "source-data").mkdir()
    (dataset / "source-data" / "README.md").write_text("download the images into images/\n")
    listing = dataset / "subsets" / "dev.txt"
    listing.write_text("images/a.png\nimages/b.jpg\n")
    refused = CliRunner().invoke(main, ["submit", str(listing)])
    assert refused.exit_code == 2
    assert f"images are looked for under {dataset / 'source-data'}/" in refused.output
    assert f"{dataset / 'source-data' / 'README.md'} says how to get them" in refused.output
