"""Liveness without a command: every process that runs jobs beats a heart in a thread of its own.

Each beat (every `DSOCR_HEARTBEAT_SECONDS`) renews the lease of every job this process holds and stamps
its `worker_processes` row, so a job whose worker lives never loses its lease. In a Celery worker it
also sweeps its queues: a job whose lease expired (its holder stopped beating) is queued again or
poisoned at the attempt cap; a reservation that expired is dropped; a message delivered long ago whose
job nobody reserved or claimed is taken back; a process found dead has the messages it may have taken
from Redis sent again. The dead worker's messages go back to the head of their
queues rather than waiting out the visibility timeout, inside the sweep's transaction (a broker error
rolls the change back for the next sweep). A dead worker's job is back in its queue at most lease +
heartbeat after its last beat. A beat is one short transaction.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import WorkerProcess, utcnow
from dsocr_workers.store.upsert import upsert

log = logging.getLogger("dsocr.worker")

# Puts the message of each (job id, queue) back in its queue, or raises; called inside the sweep's
# transaction, with its session.
Publish = Callable[[Session, list[tuple[str, str]]], None]


@dataclass(frozen=True)
class Sweep:
    """What a Celery worker sweeps: the runs on its queues, how it sends their messages, and the messages
    the broker holds as delivered."""

    queues: tuple[str, ...]
    publish: Publish
    # Job id → since when (epoch seconds) its message has been delivered and unacknowledged (and due).
    delivered: Callable[[], dict[str, float]]
    # Puts these jobs' unacknowledged messages back at the head of their queues; returns those it moved.
    take_back: Callable[[list[str]], set[str]]
    # The job ids of every message Redis holds for these queues: waiting in them, or delivered.
    held: Callable[[tuple[str, ...]], set[str]]


@dataclass(frozen=True)
class Beat:
    renewed: int  # leases of this process's jobs extended
    requeued: list[tuple[str, str]]  # (job id, queue) taken back from a dead holder and sent again
    poisoned: list[str]  # the same at the attempt cap
    unreserved: list[tuple[str, str]]  # (job id, queue) fetched by a dead worker to run next, sent again
    orphaned: list[str]  # jobs whose message a worker held past `orphaned_after_s`, nobody on the job
    resent: list[tuple[str, str]] = field(default_factory=list)  # (job id, queue) lost with a dead process


# A lane fetches its first two messages while its child still imports, which can take longer than a
# short lease: its reservations come only once the child is up, and taking such a message back would
# hand a live lane's job to another worker as well.
ORPHAN_FLOOR_S = 120


def orphaned_after_s(settings: Settings) -> float:
    """How long a message may sit delivered, its job waiting and unreserved, before a sweep takes it back:
    two leases, and never under ORPHAN_FLOOR_S."""
    return max(2 * settings.lease_s, ORPHAN_FLOOR_S)


class Heartbeat:
    def __init__(
        self,
        db: Database,
        owner: str,
        settings: Settings,
        *,
        device: str,
        queues: tuple[str, ...],
        sweep: Sweep | None = None,
    ) -> None:
        self.db, self.owner, self.settings = db, owner, settings
        self.device, self.queues, self.sweep = device, queues, sweep
        self.registered = False  # this process has its `worker_processes` row
        self._let_go: set[str] = set()  # jobs whose leases are no longer renewed (`let_go`)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, now: datetime | None = None) -> Beat:
        """One beat, in the caller's thread (the heartbeat thread, or a test, whose `now` stands for the
        clock)."""
        beat_at = now or utcnow()
        row = {
            "id": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": self.device,
            "queues": ",".join(self.queues),
            "started_at": beat_at,
            "heartbeat_at": beat_at,
            "found_dead_at": None,  # a process that beats again is alive: it can be found dead again
        }
        with self.db.transaction() as tx:
            upsert(tx, WorkerProcess, row, ["id"], ["heartbeat_at", "found_dead_at"])
            renewed = ledger.renew_leases(
                tx, self.owner, self.settings.lease_s, beat_at, let_go=list(self._let_go)
            )
        self.registered = True
        if self.sweep is None:
            return Beat(renewed, [], [], [], [])
        with self.db.transaction() as tx:
            # The clock read again once the transaction has begun (on SQLite: holds the write lock), so
            # a job brought back is `queued_at` just before its message is published, not a lock wait
            # before it, while other lanes fetch and claim.
            tx.connection()
            swept_at = now or utcnow()
            expired = ledger.expire_leases(
                tx,
                max_attempts=self.settings.max_attempts,
                now=swept_at,
                queues=self.sweep.queues,
                spare_owner=self.owner,
            )
            if expired.to_bring_back:
                self.sweep.publish(
                    tx, expired.to_bring_back
                )  # raises: rolled back, the next sweep tries again
            resent = self._resend_lost(tx, swept_at)
        for job_id, queue in expired.requeued:
            log.warning("job %s: its worker stopped beating; queued again on %s", job_id, queue)
        for job_id, queue in expired.unreserved:
            log.warning("job %s: the worker that fetched it stopped beating; back on %s", job_id, queue)
        for job_id in expired.poisoned:
            log.warning("job %s: its worker stopped beating at the attempt cap; poisoned", job_id)
        orphaned = self._take_back_orphans(beat_at, brought_back={job_id for job_id, _ in expired.to_bring_back})
        for job_id in orphaned:
            log.warning(
                "job %s: its message sat with a worker that never took the job up; back on its queue", job_id
            )
        for job_id, queue in resent:
            log.warning("job %s: its message was lost with a dead worker; sent again on %s", job_id, queue)
        return Beat(renewed, expired.requeued, expired.poisoned, expired.unreserved, orphaned, resent)

    def _resend_lost(self, tx: Session, now: datetime) -> list[tuple[str, str]]:
        """kombu pops a message from its queue before it records it as delivered: a worker killed in
        between takes the message with it, and only the ledger still knows the job as queued. A process
        found dead (silent for a lease, never stopped) has its queues' queued jobs checked against Redis
        once, and each one Redis holds no message for is sent again (a duplicate is refused by the claim).
        In the sweep's transaction `tx`: a broker error rolls the finding back, and the next sweep repeats it."""
        assert self.sweep is not None
        queues = ledger.find_dead_processes(tx, self.sweep.queues, silent_for_s=self.settings.lease_s, now=now)
        if not queues:
            return []
        queued = ledger.queued_on(tx, queues)  # read before the broker; claimed since: dropped below
        held = self.sweep.held(tuple(sorted(queues)))
        lost = ledger.waiting_on_queues(tx, [job_id for job_id, _ in queued if job_id not in held])
        if lost:
            self.sweep.publish(tx, lost)
        return lost

    def _take_back_orphans(self, now: datetime, brought_back: set[str]) -> list[str]:
        """The messages a worker died holding before its child reserved or claimed their jobs, which only
        the broker knows of: one held `orphaned_after_s` whose job is still waiting and unreserved goes
        back to the head of its queue (a merely slow worker's copy is refused by the claim)."""
        assert self.sweep is not None
        cutoff = now.replace(tzinfo=UTC).timestamp() - orphaned_after_s(
            self.settings
        )  # the ledger's times are naive UTC
        held = [
            job_id
            for job_id, since in self.sweep.delivered().items()
            if since <= cutoff and job_id not in brought_back
        ]
        if not held:
            return []
        with self.db.transaction() as tx:
            orphans = ledger.unattended(tx, held, now)
        return sorted(self.sweep.take_back(orphans)) if orphans else []

    def let_go(self, job_id: str) -> None:
        """Stop renewing the lease of `job_id`, which this process holds but can no longer finish (its
        result could not be written): the lease runs out and a sweep puts the job back in line, rather
        than a live heartbeat keeping it `running` for good."""
        self._let_go.add(job_id)

    def start(self) -> None:
        """Beat once now (registering this process), then every heartbeat interval until `stop`."""
        self._beat_logged()
        self._thread = threading.Thread(target=self._run, name="dsocr-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and record a clean stop, so `dsocr status` does not wait for this process."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.heartbeat_s + 5)
        try:
            with self.db.transaction() as tx:
                tx.execute(
                    update(WorkerProcess).where(WorkerProcess.id == self.owner).values(stopped_at=utcnow())
                )
        except Exception:  # the ledger is down: the row goes silent and reads as dead after the lease
            log.warning("could not record the stop of %s", self.owner, exc_info=True)

    def _run(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_s):
            self._beat_logged()

    def _beat_logged(self) -> None:
        try:
            self.beat()
        except Exception:  # a database or broker outage: the next beat tries again
            log.warning("heartbeat of %s failed", self.owner, exc_info=True)
