"""The reliability suite's harness.

- `Farm`: one isolated farm per scenario — its own Redis key prefix and queue, the session's PostgreSQL
  database (or a URL the scenario gives), real `python -m dsocr_workers worker` subprocesses, each in its
  own process group so that a scenario can `kill -9` a child or a whole worker. Given `faults`, its
  workers are started through the test-only entry point faulty_dsocr.py instead.
- `check_invariants`: what every scenario ends with (every job final; results = distinct done jobs; no
  job beyond the attempt cap unless poisoned; `dsocr report` totals = the tables; the queue drained).
- Fault tools: `TcpProxy` (PostgreSQL that can be cut and restored) and `ThrowawayRedis` (a redis-server of
  our own on another port: restartable, optionally with a password) — the shared services are never
  stopped.
- `NetnsLab`: several hosts on this machine (R11): a services namespace with a throwaway Redis and
  PostgreSQL, and worker hosts in namespaces of their own (own hostname too), each linked to the services
  by a veth pair in the RFC 2544 range 198.18.0.0/15; a host can be killed whole or have its link cut.
- `record`: prints a scenario's figures and appends them to $DSOCR_RELIABILITY_FIGURES (JSON lines), the
  source of docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from faulty_dsocr import NO_FAULTS, Faults
from sqlalchemy import func, select

from dsocr_workers.settings import Settings
from dsocr_workers.store.db import Database, open_database
from dsocr_workers.store.models import Job, Result, WorkerProcess, WorkerSession, utcnow

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"
FINAL_STATES = ("done", "failed", "poisoned")

# Short limits so that every recovery path runs in seconds; scenarios override what they exercise.
TEST_SETTINGS = {
    "DSOCR_HARD_TIME_LIMIT": "30",
    "DSOCR_LEASE_SECONDS": "40",
    "DSOCR_HEARTBEAT_SECONDS": "2",
    "DSOCR_MAX_ATTEMPTS": "3",
    "DSOCR_RETRY_BACKOFF_MAX": "4",
    # Several CPU workers share 2 cores: one thread per child, or spinning OpenMP threads slow jobs ~5x.
    "OMP_NUM_THREADS": "1",
}
# What no setting bounds, with the margin of a 2-core machine under a load of 6: a worker's (or a
# replacement child's) start — Celery's boot, the fork, the tiny model's load and warm-up — and how late
# a live worker's sweep may come past the heartbeat it is due at.
WORKER_START_S = 60
SWEEP_MARGIN_S = 10
# The job of every scenario: the tiny preset (random weights) in `tiny` mode on a small page.
FAST_JOB = ("--mode", "tiny", "--max-new-tokens", "2")
# About a second of real decoding on this CPU: long enough to be killed mid-job.
SECOND_JOB = ("--mode", "tiny", "--max-new-tokens", "300", "--ignore-eos")


def make_pages(folder: Path, count: int, prefix: str = "p", size: tuple[int, int] = (96, 128)) -> Path:
    """`count` small distinct PNG pages and their file list."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        name = f"{prefix}{i:04d}.png"
        page = Image.new("RGB", size, "white")
        ImageDraw.Draw(page).text((4, 4), str(i), fill="black")
        page.save(folder / name)
        names.append(name)
    listing = folder / f"{prefix}-list.txt"
    listing.write_text("\n".join(names) + "\n")
    return listing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise LookupError(field_name)


@dataclass
class Worker:
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def child_pids(self) -> set[int]:
        """The prefork children (every thread of the parent can fork; read them all)."""
        pids: set[int] = set()
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                pids.update(int(p) for p in (task / "children").read_text().split())
            except OSError:
                continue
        return pids

    def kill_all(self) -> None:
        """`kill -9` of the whole worker: the parent and its children (its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def begin_stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)  # warm shutdown

    def finish_stop(self, deadline: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
            os.killpg(self.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(timeout=30)


@dataclass
class Farm:
    root: Path
    database_url: str  # where the checks read the ledger (always direct)
    env: dict[str, str]
    prefix: str
    queue: str
    broker_url: str
    faults: Faults = NO_FAULTS  # jobs its workers crash or hang on (faulty_dsocr.py)
    workers: list[Worker] = field(default_factory=list)
    # One engine for every read of the checks: the polls run several times a second, and a fresh engine
    # (and PostgreSQL backend) for each cost more CPU than the scenario's jobs on a 2-core machine.
    _ledger: Database | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        root: Path,
        database_url: str,
        base_env: dict[str, str],
        *,
        broker_url: str = REDIS_URL,
        worker_database_url: str | None = None,
        faults: Faults = NO_FAULTS,
        **settings: str,
    ) -> Farm:
        tag = uuid.uuid4().hex[:10]
        prefix, queue = f"dsocr-rel-{tag}:", f"dsocr-rel-{tag}"
        root.mkdir(parents=True, exist_ok=True)
        env = {
            **base_env,
            **TEST_SETTINGS,
            "DSOCR_DATABASE_URL": worker_database_url or database_url,
            "DSOCR_BROKER_URL": broker_url,
            "DSOCR_BROKER_KEY_PREFIX": prefix,
            "DSOCR_QUEUE": queue,
            **settings,
        }
        return cls(root, database_url, env, prefix, queue, broker_url, faults)

    def settings(self) -> Settings:
        """The settings its workers run with."""
        return Settings.from_env(self.env)

    def run_budget_s(self, attempts: int, workers: int, starts: int = 1, waits_s: float = 0) -> float:
        """How long a run may take before a wait for it fails: `starts` worker (or child) starts one after
        the other, each worker's share of the run's `attempts` (each one ended by the hard time limit at
        the latest), and `waits_s` spent waiting out leases."""
        hard = self.settings().hard_time_limit_s
        return starts * WORKER_START_S + math.ceil(attempts / workers) * hard + waits_s

    # --- commands ---------------------------------------------------------------------------------------

    def dsocr(self, *args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dsocr_workers", *args],
            env={**self.env, "DSOCR_DATABASE_URL": self.database_url, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def submit(self, listing: Path, *args: str) -> str:
        done = self.dsocr("submit", str(listing), *args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.strip().splitlines()[-1]

    def reconcile(self, run_id: str) -> str:
        done = self.dsocr("reconcile", "--run", run_id)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def start_worker(self, *args: str, wrap: Sequence[str] = (), **env: str) -> Worker:
        """A `dsocr worker --gpus cpu` subprocess (with the farm's faults); `wrap` is a command prefix that
        runs it elsewhere (on a host of a `NetnsLab`: `lab.host_argv(host)`), `env` overrides the farm's
        environment."""
        log = self.root / f"worker-{len(self.workers)}.log"
        with open(log, "w") as out:
            popen = subprocess.Popen(
                [*wrap, *self.faults.dsocr_command(), "worker", "--gpus", "cpu", *args],
                env={**self.env, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: kill_all takes the children too
            )
        worker = Worker(popen, log)
        self.workers.append(worker)
        return worker

    def stop(self, timeout: float = 40) -> None:
        """Warm shutdown of every worker at once (each takes seconds: one after the other, a farm of
        three spent most of a scenario's teardown waiting), then `kill -9` of whatever is left."""
        for worker in self.workers:
            worker.begin_stop()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.finish_stop(deadline)
        if self._ledger is not None:
            self._ledger.dispose()
            self._ledger = None

    def logs(self) -> str:
        return "".join(w.log.read_text(errors="replace") for w in self.workers if w.log.exists())

    # --- ledger and broker --------------------------------------------------------------------------------

    def ledger(self) -> Database:
        """The ledger as the checks read it (`database_url`, never through a scenario's proxy)."""
        if self._ledger is None:
            self._ledger = open_database(self.database_url)
        return self._ledger

    def jobs(self, run_id: str) -> list[Any]:
        with self.ledger().transaction() as session:
            return list(session.execute(select(Job).where(Job.run_id == run_id)).scalars())

    def open_jobs(self, jobs: list[Any]) -> str:
        """What a scenario that timed out needs to be diagnosed: each open job's ledger row, and the job
        ids of the messages Redis holds (waiting, delivered and unacknowledged)."""
        lines = [
            f"open job {j.id} {j.image}: {j.state}, attempts {j.attempts}, owner {j.lease_owner} until "
            f"{j.lease_expires_at}, reserved by {j.reserved_by} until {j.reserved_until}, last error "
            f"{j.last_error_class}: {(j.last_error_message or '')[:200]}"
            for j in jobs if j.state not in FINAL_STATES
        ]  # fmt: skip
        try:
            waiting = [json.loads(raw)["headers"]["id"] for raw in self.redis().lrange(self.prefix + self.queue, 0, -1)]
            lines.append(f"messages waiting: {waiting}; delivered, unacknowledged: {sorted(self.unacked_job_ids())}")
        except Exception as exc:  # the broker is what the scenario cut
            lines.append(f"messages: unreadable ({exc})")
        lines.append(f"now {utcnow()}")
        return "\n".join(lines)

    def processes(self) -> list[WorkerProcess]:
        """Every `worker_processes` row (the heartbeats)."""
        with self.ledger().transaction() as session:
            return list(session.execute(select(WorkerProcess)).scalars())

    def counts(self, run_id: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs(run_id):
            counts[job.state] = counts.get(job.state, 0) + 1
        return counts

    def wait_until_final(
        self, run_id: str, timeout: float, tick: Callable[[list[Any]], None] | None = None, poll: float = 0.3
    ) -> float:
        """Seconds until every job of the run is final; `tick(jobs)` runs at every poll (fault injection)."""
        start = time.monotonic()
        while True:
            jobs = self.jobs(run_id)
            if tick is not None:
                tick(jobs)
            if all(j.state in FINAL_STATES for j in jobs):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                states = {s: sum(j.state == s for j in jobs) for s in {j.state for j in jobs}}
                limits = self.settings()
                raise AssertionError(
                    f"run {run_id} not final after {timeout:.0f} s (hard time limit {limits.hard_time_limit_s} s, "
                    f"lease {limits.lease_s} s, heartbeat {limits.heartbeat_s} s): {states}\n{self.open_jobs(jobs)}\n"
                    f"{self.logs()[-4000:]}"
                )
            time.sleep(poll)

    def wait_for_state(self, run_id: str, state: str, timeout: float) -> list[Any]:
        """The run's jobs in `state`, as soon as there is one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [j for j in self.jobs(run_id) if j.state == state]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no job of run {run_id} {state} after {timeout:.0f} s\n{self.logs()[-3000:]}")

    def wait_for_ready_workers(self, count: int, timeout: float) -> None:
        """Until `count` worker children on this farm's queue (or a queue named after it) have loaded and
        warmed their model."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.ledger().transaction() as session:
                ready = session.scalar(
                    select(func.count()).select_from(WorkerSession).join(WorkerProcess)
                    .where(WorkerProcess.queues.startswith(self.queue, autoescape=True), WorkerSession.ready_at.is_not(None))
                )  # fmt: skip
            if ready >= count:
                return
            time.sleep(0.2)
        raise AssertionError(f"{count} workers not ready after {timeout:.0f} s\n{self.logs()[-3000:]}")

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.broker_url)

    def backlog(self) -> tuple[int, int]:
        """(messages waiting in the queue, messages delivered but not acknowledged) under our prefix."""
        client = self.redis()
        return client.llen(self.prefix + self.queue), client.hlen(self.prefix + "unacked")

    def unacked_job_ids(self) -> set[str]:
        raw = self.redis().hvals(self.prefix + "unacked")
        return {json.loads(message)[0]["headers"]["id"] for message in raw}

    def wait_drained(self, timeout: float) -> float:
        start = time.monotonic()
        while True:
            waiting, unacked = self.backlog()[0], self.unacked_job_ids()
            if not waiting and not unacked:
                break
            if time.monotonic() - start > timeout:
                raise AssertionError(
                    f"queue not drained after {timeout:.0f} s: {waiting} waiting, unacked {unacked}"
                )
            time.sleep(0.5)
        return time.monotonic() - start

    def delete_keys(self) -> None:
        try:
            client = self.redis()
            keys = list(client.scan_iter(match=f"{self.prefix}*"))
            if keys:
                client.delete(*keys)
        except redis.RedisError:
            pass


def owner_pid(owner: str | None) -> int | None:
    """The pid in a lease owner name `host:pid:nonce`."""
    if not owner:
        return None
    parts = owner.split(":")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


@dataclass(frozen=True)
class Tally:
    jobs: int
    done: int
    failed: int
    poisoned: int
    results: int
    duplicates: int
    max_attempts_seen: int
    retried_jobs: int  # jobs that needed more than one attempt
    drain_s: float


def check_invariants(farm: Farm, run_id: str, *, max_attempts: int, drain_timeout: float = 60) -> Tally:
    """The checks every scenario ends with; returns the run's tally for the figures."""
    jobs = farm.jobs(run_id)
    with farm.ledger().transaction() as session:
        result_jobs = list(session.scalars(select(Result.job_id).where(Result.run_id == run_id)))
    assert jobs, f"run {run_id} has no jobs"

    # 1. Every job is in a final state.
    open_jobs = [(j.image, j.state) for j in jobs if j.state not in FINAL_STATES]
    assert not open_jobs, f"jobs not final: {open_jobs}"
    # Job identity is (run, image, repeat): no job twice.
    assert len({(j.image, j.repeat) for j in jobs}) == len(jobs)

    # 2. Results = the distinct done jobs: one result per done job, none for any other job.
    done = {j.id for j in jobs if j.state == "done"}
    duplicates = len(result_jobs) - len(set(result_jobs))
    assert duplicates == 0, f"{duplicates} duplicate results"
    assert set(result_jobs) == done, (
        f"results without a done job: {set(result_jobs) - done}; done jobs without a result: {done - set(result_jobs)}"
    )

    # 3. No job beyond the attempt cap unless poisoned; every final job was attempted.
    over = [
        (j.image, j.attempts, j.state) for j in jobs if j.attempts > max_attempts and j.state != "poisoned"
    ]
    assert not over, f"jobs beyond the cap of {max_attempts}: {over}"
    assert all(j.attempts >= 1 for j in jobs if j.state in ("done", "failed")), [
        (j.image, j.state, j.attempts) for j in jobs if j.attempts < 1
    ]

    # 4. `dsocr report` totals equal the tables.
    report = farm.dsocr("report", "--run", run_id, "--format", "json")
    assert report.returncode == 0, report.stderr
    facts = {row["field"]: row["value"] for row in json.loads(report.stdout)["tables"]["Run"]}
    by_state = {s: sum(j.state == s for j in jobs) for s in FINAL_STATES}
    assert (facts["jobs"], facts["ok"], facts["failed"], facts["poisoned"], facts["results"], facts["not finished"]) == (
        len(jobs), by_state["done"], by_state["failed"], by_state["poisoned"], len(result_jobs), 0,
    ), facts  # fmt: skip

    # 5. The queue is drained: nothing waiting, nothing delivered and unacknowledged (a killed worker's
    #    messages are put back by the sweep that takes its jobs back, farm/liveness.py).
    drain_s = farm.wait_drained(drain_timeout)

    return Tally(
        jobs=len(jobs),
        done=by_state["done"],
        failed=by_state["failed"],
        poisoned=by_state["poisoned"],
        results=len(result_jobs),
        duplicates=duplicates,
        max_attempts_seen=max(j.attempts for j in jobs),
        retried_jobs=sum(j.attempts > 1 for j in jobs),
        drain_s=round(drain_s, 1),
    )


def record(scenario: str, **facts: Any) -> None:
    """Print a scenario's figures and append them to $DSOCR_RELIABILITY_FIGURES when it is set."""
    entry = {"scenario": scenario, "at": datetime.now().isoformat(timespec="seconds"), **facts}
    line = json.dumps(entry, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o))
    print(line)
    target = os.environ.get("DSOCR_RELIABILITY_FIGURES")
    if target:
        with open(target, "a") as out:
            out.write(line + "\n")


def seconds_since(moment: datetime) -> float:
    return (utcnow() - moment).total_seconds()


# --- fault tools -------------------------------------------------------------------------------------------


class TcpProxy:
    """A TCP proxy to 127.0.0.1:`target_port` that the test can cut (listener closed, every connection
    dropped: clients see "connection refused" and broken connections) and restore on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._running = False
        self._listener: threading.Thread | None = None
        self.restore()

    @property
    def up(self) -> bool:
        return self._running

    def restore(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        server.settimeout(0.2)
        self._running = True
        self._listener = threading.Thread(target=self._accept, args=(server,), daemon=True)
        self._listener.start()

    def cut(self) -> None:
        self._running = False
        if self._listener is not None:
            self._listener.join()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, server: socket.socket) -> None:
        with server:
            while self._running:
                try:
                    client, _ = server.accept()
                except TimeoutError:
                    continue
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.target_port))
                except OSError:
                    client.close()
                    continue
                with self._lock:
                    self._sockets.update((client, upstream))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class ThrowawayRedis:
    """A redis-server of the test's own on a free port, keeping nothing on disk (like the local one)."""

    def __init__(self, folder: Path, password: str | None = None, tls: bool = False) -> None:
        self.folder = folder
        self.password = password
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)
        self.ca_cert = self._self_signed_certificate() if tls else None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.ca_cert is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.ca_cert}"

    def _self_signed_certificate(self) -> Path:
        """A certificate for 127.0.0.1 that is its own CA: clients verify the server against it."""
        cert, key = self.folder / "redis.crt", self.folder / "redis.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)  # fmt: skip
        return cert

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder), "--logfile", str(self.folder / "redis.log")]  # fmt: skip
        if self.ca_cert is not None:
            key = self.folder / "redis.key"
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.ca_cert),
                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.ca_cert), "--tls-auth-clients", "no"]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def shutdown_nosave(self) -> None:
        """What `redis-cli shutdown nosave` does to the local Redis: the queue and every message are gone."""
        with contextlib.suppress(redis.ConnectionError):  # the server drops the connection as it exits
            redis.Redis.from_url(self.url).shutdown(nosave=True)
        assert self.process is not None
        self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


# --- several hosts: network namespaces (R11) -----------------------------------------------------------------

NETNS_RANGE = "198.18.0.0/15"  # RFC 2544 (benchmark testing): never routed, on no link of this machine
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def netns_unavailable() -> str | None:
    """Why the network-namespace scenario cannot run on this machine; None when it can."""
    if os.geteuid() != 0:
        return "needs root: it creates network namespaces and veth pairs (ip netns)"
    tools = ("ip", "unshare", "setpriv", "redis-server", "initdb", "postgres")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"not on the PATH: {', '.join(missing)}"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no system user `postgres` to run the throwaway PostgreSQL as (it refuses to run as root)"
    probe = f"dsocr-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (OSError, RuntimeError) as exc:
        return f"`ip netns` does not work here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class NetnsHost:
    """A worker host: a network namespace whose only link leads to the services namespace."""

    hostname: str  # in a UTS namespace of its own: the host part of its processes' lease owner names
    netns: str
    veth: str  # its end of the link
    services_veth: str  # the services' end: where the link is cut and restored
    address: str
    services_address: str  # the address of Redis and PostgreSQL that this host's URLs name

    def owns(self, owner: str | None) -> bool:
        """Whether a lease owner name (`host:pid:nonce`) is a process of this host."""
        return bool(owner) and str(owner).startswith(self.hostname + ":")


class NetnsLab:
    """Several hosts on this machine, for real networking: a services namespace (a throwaway redis-server
    and PostgreSQL cluster, listening on its loopback and on its end of every link) and `hosts` worker
    namespaces, host i linked to the services by a veth pair with a /30 of its own (services 198.18.i.1,
    host 198.18.i.2). A host namespace has its loopback and its link, no other interface and no default
    route: its processes can reach the services and nothing else. The test reaches them over the
    services' loopback: `entered()` moves the calling thread into the services namespace, so the
    harness's ledger and Redis reads and its `dsocr` subprocesses run there unchanged.

    Names carry a random tag (several runs at once never meet); `close()` kills every process in the
    namespaces and deletes them (their veths go with them) and the cluster's folder, and is safe to call
    after a failure at any step. The machine's own Redis and PostgreSQL are never touched: the services
    namespace has ports 6379 and 5432 of its own, and PostgreSQL's socket lives in the cluster's folder."""

    REDIS_PORT, POSTGRES_PORT, DATABASE = 6379, 5432, "dsocr"

    def __init__(self, root: Path, hosts: int = 2) -> None:
        self.root = root
        self.tag = uuid.uuid4().hex[:6]
        self.services = f"dsocr-svc-{self.tag}"
        self.hosts = [
            NetnsHost(
                hostname=f"dsocr-h{i}", netns=f"dsocr-h{i}-{self.tag}", veth=f"dh{i}-{self.tag}",
                services_veth=f"ds{i}-{self.tag}", address=f"198.18.{i}.2", services_address=f"198.18.{i}.1",
            )  # fmt: skip
            for i in range(1, hosts + 1)
        ]
        self._namespaces: list[str] = []
        self._services: list[subprocess.Popen] = []  # redis-server, postgres
        self._pg_dir: Path | None = None

    # --- URLs ---------------------------------------------------------------------------------------------

    def database_url(self, host: NetnsHost | None = None) -> str:
        """The ledger as `host` reaches it over its link; None: over the services' loopback (the test)."""
        address = host.services_address if host else "127.0.0.1"
        return f"postgresql+psycopg://postgres@{address}:{self.POSTGRES_PORT}/{self.DATABASE}"

    def broker_url(self, host: NetnsHost | None = None) -> str:
        address = host.services_address if host else "127.0.0.1"
        return f"redis://{address}:{self.REDIS_PORT}/0"

    def host_env(self, host: NetnsHost) -> dict[str, str]:
        return {"DSOCR_DATABASE_URL": self.database_url(host), "DSOCR_BROKER_URL": self.broker_url(host)}

    def host_argv(self, host: NetnsHost) -> list[str]:
        """The command prefix that runs a program on `host`: in its network namespace, under its own
        hostname (a UTS namespace of its own), so that its lease owners name it and the farm's
        same-host shortcut (`owners.owner_is_dead`, farm/owners.py) never judges another host's processes."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', host.hostname]  # fmt: skip

    # --- set-up -------------------------------------------------------------------------------------------

    def up(self) -> None:
        for netns in (self.services, *(h.netns for h in self.hosts)):
            _ip("netns", "add", netns)
            self._namespaces.append(netns)
            _ip("-n", netns, "link", "set", "lo", "up")
        for h in self.hosts:
            # Both ends are born in their namespaces: the root namespace never holds them, not even briefly.
            _ip("link", "add", h.services_veth, "netns", self.services, "type", "veth",
                "peer", "name", h.veth, "netns", h.netns)  # fmt: skip
            _ip("-n", self.services, "addr", "add", f"{h.services_address}/30", "dev", h.services_veth)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/30", "dev", h.veth)
            _ip("-n", self.services, "link", "set", h.services_veth, "up")
            _ip("-n", h.netns, "link", "set", h.veth, "up")

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread (and the subprocesses it starts) in the services namespace."""
        here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            there = os.open(f"/run/netns/{self.services}", os.O_RDONLY)
            try:
                _setns(there)
                try:
                    yield
                finally:
                    _setns(here)
            finally:
                os.close(there)
        finally:
            os.close(here)

    def _start_in(self, netns: str, argv: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
        with open(log, "w") as out:
            popen = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdout=out, stderr=subprocess.STDOUT,
                                     cwd=cwd, start_new_session=True)  # fmt: skip
        self._services.append(popen)
        return popen

    def start_services(self) -> None:
        """Redis (nothing on disk) and a fresh PostgreSQL cluster (trust auth for loopback and the test
        range only) in the services namespace; the ledger database migrated."""
        listen = ["127.0.0.1", *(h.services_address for h in self.hosts)]
        folder = self.root / "redis"
        folder.mkdir(parents=True, exist_ok=True)
        self._start_in(self.services, [
            "redis-server", "--port", str(self.REDIS_PORT), "--bind", " ".join(listen), "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--dir", str(folder), "--logfile", str(folder / "redis.log"),
        ], folder / "stdout.log")  # fmt: skip

        # PostgreSQL refuses to run as root; its folder must be its user's and reachable by it (pytest's
        # tmp dirs are root's alone).
        user = pwd.getpwnam("postgres")
        self._pg_dir = Path(tempfile.mkdtemp(prefix=f"dsocr-netns-{self.tag}-"))
        os.chown(self._pg_dir, user.pw_uid, user.pw_gid)
        as_postgres = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
        data = self._pg_dir / "data"
        done = subprocess.run(
            [*as_postgres, "initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync", "--no-instructions"],
            cwd=self._pg_dir, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stdout}{done.stderr}")
        (data / "pg_hba.conf").write_text(
            "local all all trust\nhost all all 127.0.0.1/32 trust\n"
            f"host all all {NETNS_RANGE} trust\n"
        )
        self._start_in(self.services, [
            *as_postgres, "postgres", "-D", str(data), "-c", f"listen_addresses={','.join(listen)}",
            "-c", f"port={self.POSTGRES_PORT}", "-c", f"unix_socket_directories={self._pg_dir}",
            "-c", "fsync=off", "-c", "max_connections=60",
        ], self._pg_dir / "postgres.log", cwd=self._pg_dir)  # fmt: skip

        import psycopg

        from dsocr_workers.store.db import upgrade

        with self.entered():
            client = redis.Redis.from_url(self.broker_url())
            admin = f"host=127.0.0.1 port={self.POSTGRES_PORT} user=postgres dbname=postgres connect_timeout=2"
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.ping()
                    with psycopg.connect(admin, autocommit=True) as conn:
                        conn.execute(f"CREATE DATABASE {self.DATABASE}")
                    break
                except (redis.RedisError, psycopg.OperationalError):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in self._services):
                        raise RuntimeError(f"the services did not start; see {folder} and {self._pg_dir}") from None
                    time.sleep(0.2)
            db = open_database(self.database_url())
            try:
                upgrade(db)
            finally:
                db.dispose()

    # --- faults -------------------------------------------------------------------------------------------

    @staticmethod
    def pids(netns: str) -> set[int]:
        done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
        return {int(pid) for pid in done.stdout.split()}

    def kill_host(self, host: NetnsHost) -> set[int]:
        """`kill -9` of every process on `host` (a machine lost with everything on it). Returns the pids."""
        return self._kill_all(host.netns)

    def _kill_all(self, netns: str) -> set[int]:
        killed: set[int] = set()
        for _ in range(100):  # until nothing is left (a process may fork while the others die)
            pids = self.pids(netns)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            time.sleep(0.05)
        return killed

    def cut(self, host: NetnsHost) -> None:
        """Take the services' end of `host`'s link down: no packet passes, nobody is told (no RST)."""
        _ip("-n", self.services, "link", "set", host.services_veth, "down")

    def restore(self, host: NetnsHost) -> None:
        _ip("-n", self.services, "link", "set", host.services_veth, "up")

    def forgetful_services(self, retransmissions: int = 3) -> None:
        """Make the services' TCP give up on an unanswered connection after `retransmissions` tries (a few
        seconds) instead of the kernel's 15 (about 15 min): during a cut, a server that has something to
        send to the cut-off host drops that connection, as it would in a partition of a quarter of an
        hour, and nothing tells the host (no packet passes): its end is left half-open."""
        _ip("netns", "exec", self.services, "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={retransmissions}")

    # --- tear-down ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill everything in the namespaces, delete them and the cluster's folder. Idempotent."""
        postgres = self._services[1] if len(self._services) > 1 else None
        if postgres is not None and postgres.poll() is None:
            postgres.send_signal(signal.SIGQUIT)  # PostgreSQL's immediate shutdown: frees its shared memory
            with contextlib.suppress(subprocess.TimeoutExpired):
                postgres.wait(timeout=20)
        for netns in reversed(self._namespaces):
            self._kill_all(netns)
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)
        self._namespaces.clear()
        for popen in self._services:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=10)
        if self._pg_dir is not None:
            shutil.rmtree(self._pg_dir, ignore_errors=True)
            self._pg_dir = None
