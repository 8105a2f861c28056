"""Security: JSON-only messages (a pickled message is refused and runs nothing), credentials only from
the environment and never printed, logged or stored, a Redis password end to end, and model output that
is parsed, never evaluated; a TLS broker verified and given the same transport fix. (Images are opened with a format allowlist and a pixel limit: R6.)"""

from __future__ import annotations

import ast
import json
import os
import ssl
from pathlib import Path

from reliability_harness import FAST_JOB, REPO, ThrowawayRedis, check_invariants, make_pages, record
from sqlalchemy import text

from dsocr_workers.farm.celery.app import create_app
from dsocr_workers.farm.celery.broker import TRANSPORT
from dsocr_workers.farm.celery.messages import RUN_JOB
from dsocr_workers.model.postprocess import parse_markup
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import open_database


class MakesADirectoryWhenUnpickled:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (str(self.path),))


def test_pickled_message_is_refused_and_the_worker_keeps_going(new_farm, tmp_path):
    farm = new_farm()
    marker = tmp_path / "unpickled-and-ran"
    app = create_app(Settings.from_env(farm.env))
    # A well-formed Celery message for our task whose body is a pickle that would run code when loaded.
    app.send_task(RUN_JOB, args=[MakesADirectoryWhenUnpickled(marker)], queue=farm.queue, serializer="pickle")
    assert farm.backlog() == (1, 0)
    worker = farm.start_worker("--warmup", "tiny")  # no run open yet: auto would warm gundam
    farm.wait_drained(timeout=60)
    listing = make_pages(tmp_path / "pages", 3)
    run_id = farm.submit(listing, *FAST_JOB)
    farm.wait_until_final(run_id, timeout=120)
    tally = check_invariants(farm, run_id, max_attempts=3)
    assert tally.done == 3 and worker.alive()
    assert not marker.exists()
    assert "untrusted content" in farm.logs() or "ContentDisallowed" in farm.logs(), farm.logs()[-3000:]
    record("Security: pickled message", workers=1, faults="1 pickled message pushed into the queue",
           lost=3 - tally.done, duplicated=tally.duplicates, tally=tally)  # fmt: skip


def test_credentials_never_printed_logged_or_stored(new_farm, tmp_path, postgres_url):
    pg_secret, redis_secret = "pg-S3cret-5e1f", "redis-S3cret-9a7b"
    broker = ThrowawayRedis(tmp_path / "redis", password=redis_secret)
    try:
        # The local PostgreSQL trusts local connections: the password travels but is not checked, which
        # is enough to see where it could leak. Redis checks its password.
        secret_db = postgres_url.replace("postgres@", f"postgres:{pg_secret}@")
        farm = new_farm(database_url=secret_db, broker_url=broker.url)
        listing = make_pages(tmp_path / "pages", 4)
        outputs = []

        no_password = farm.dsocr("submit", str(listing), *FAST_JOB, DSOCR_BROKER_URL=broker.url.replace(f":{redis_secret}@", ""),
                                 CELERY_BROKER_CONNECTION_MAX_RETRIES="0")  # fmt: skip
        wrong = farm.dsocr("submit", str(listing), *FAST_JOB, DSOCR_BROKER_URL=broker.url.replace(redis_secret, "wrong-Pa55"),
                           CELERY_BROKER_CONNECTION_MAX_RETRIES="0")  # fmt: skip
        assert no_password.returncode == 3 and wrong.returncode == 3, (no_password.stderr, wrong.stderr)
        assert "wrong-Pa55" not in wrong.stdout + wrong.stderr

        submitted = farm.dsocr("submit", str(listing), *FAST_JOB)
        assert submitted.returncode == 0, submitted.stderr
        run_id = submitted.stdout.split()[-1]
        client = farm.redis()
        queued = client.lrange(farm.prefix + farm.queue, 0, -1)
        assert len(queued) == 4
        farm.start_worker("--loglevel", "DEBUG")
        farm.wait_until_final(run_id, timeout=120)
        tally = check_invariants(farm, run_id, max_attempts=3)
        assert tally.done == 4
        for args in (["status", "--run", run_id], ["runs"], ["reconcile", "--run", run_id], ["db", "upgrade"],
                     ["report", "--run", run_id], ["report", "--run", run_id, "--format", "json"]):  # fmt: skip
            done = farm.dsocr(*args)
            assert done.returncode == 0, (args, done.stderr)
            outputs.append(done.stdout + done.stderr)

        db = open_database(secret_db)
        with db.engine.connect() as conn:
            rows = [
                json.dumps(row)
                for table in ("runs", "jobs", "workers", "results")
                for (row,) in conn.execute(text(f"SELECT row_to_json(t) FROM {table} t"))
            ]
        db.dispose()
        everything = "\n".join([no_password.stdout, no_password.stderr, wrong.stdout, wrong.stderr,
                                submitted.stdout, submitted.stderr, *outputs, farm.logs(), *rows,
                                *(m.decode() for m in queued)])  # fmt: skip
        for secret in (pg_secret, redis_secret):
            assert secret not in everything
        assert "schema at revision" in "".join(outputs) and "***@" in "".join(outputs)  # masked, not absent
        record("Security: credentials", workers=1, faults="passwords in DSOCR_DATABASE_URL and DSOCR_BROKER_URL "
               "(Redis --requirepass)", lost=4 - tally.done, duplicated=tally.duplicates,
               scanned_bytes=len(everything), leaks=0, tally=tally)  # fmt: skip
    finally:
        broker.close()


def test_rediss_broker_verifies_the_server_and_keeps_the_ack_fix(new_farm, tmp_path):
    """A TLS broker (`rediss://`) gets the same transport as `redis://` (kombu's, with the acknowledgement
    fix of farm/celery/broker.py) and still speaks TLS, verifying the server's certificate."""
    broker = ThrowawayRedis(tmp_path / "redis", tls=True)
    try:
        connection = create_app(Settings(broker_url=broker.url)).connection_for_write()
        assert connection.transport_cls == TRANSPORT and connection.ssl["ssl_cert_reqs"] == ssl.CERT_REQUIRED
        farm = new_farm(broker_url=broker.url)
        listing = make_pages(tmp_path / "pages", 4)
        unverified = broker.url.split("&ssl_ca_certs=")[0]  # no CA: the self-signed server is refused
        refused = farm.dsocr("submit", str(listing), *FAST_JOB, DSOCR_BROKER_URL=unverified,
                             CELERY_BROKER_CONNECTION_MAX_RETRIES="0")  # fmt: skip
        assert refused.returncode == 3, refused.stdout + refused.stderr
        run_id = farm.submit(listing, *FAST_JOB)
        farm.start_worker()
        farm.wait_until_final(run_id, timeout=120)
        tally = check_invariants(farm, run_id, max_attempts=3)
        assert tally.done == tally.results == 4
        record("Security: TLS broker", workers=1, faults="rediss:// with a self-signed certificate; no CA given",
               lost=4 - tally.done, duplicated=tally.duplicates, tally=tally)  # fmt: skip
    finally:
        broker.close()


def test_model_output_is_parsed_never_evaluated(tmp_path):
    marker = tmp_path / "evaluated"
    hostile = (
        f"<|ref|>text<|/ref|><|det|>__import__('os').makedirs('{marker}')<|/det|>title\n"
        f"<|ref|>text<|/ref|><|det|>[[1, 2, 3, (__import__('os').makedirs('{marker}'), 4)[1]]]<|/det|>x"
    )
    parsed = parse_markup(hostile, 100, 100)
    assert parsed.regions == [] or all(not r.boxes for r in parsed.regions)
    assert parsed.skipped_spans == 2 and not marker.exists()


def test_no_eval_exec_or_unpickling_in_the_package():
    """Nothing in dsocr_workers evaluates text or unpickles bytes (model output, messages, files)."""
    forbidden = {"eval", "exec", "compile", "loads", "load"}
    modules = {"pickle", "marshal", "yaml", "dill", "shelve"}
    found = []
    for path in (REPO / "dsocr_workers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in {"eval", "exec", "compile"}:
                    found.append(f"{path}:{node.lineno}: {f.id}()")
                if (
                    isinstance(f, ast.Attribute)
                    and f.attr in forbidden
                    and isinstance(f.value, ast.Name)
                    and f.value.id in modules
                ):
                    found.append(f"{path}:{node.lineno}: {f.value.id}.{f.attr}()")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                )
                found += [f"{path}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in modules]
    assert not found, found
