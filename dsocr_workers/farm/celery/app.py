"""The one place that creates the Celery app. Messages carry a job id as JSON and nothing else; the SQL
ledger holds everything else, so losing the broker loses no work (`dsocr reconcile`).

Delivery is at-least-once: a message is acknowledged only after its task returns (`acks_late`), a
child killed mid-job puts its message back (`reject_on_worker_lost`), and a worker, which has one child
(farm/celery/worker.py), holds two messages at most: its child's job and the next one (prefetch 2). The
ledger's claim makes the results exactly-once.
"""

from __future__ import annotations

import socket
import ssl
from importlib.util import find_spec
from urllib.parse import urlparse

from celery import Celery
from kombu.utils.url import parse_url

from dsocr_workers.errors import InputError
from dsocr_workers.farm.celery.broker import TRANSPORT
from dsocr_workers.settings import Settings


def create_app(settings: Settings, *, events: bool = False) -> Celery:
    """The farm's app. `events`: a worker that Flower can show (`dsocr worker --events`, see below)."""
    app = Celery("dsocr", broker=settings.broker_url, include=["dsocr_workers.farm.celery.tasks"])
    transport_options: dict[str, object] = {
        "visibility_timeout": settings.visibility_timeout_s,
        **restore_sweep(settings.visibility_timeout_s),
        **broker_keepalive(),
    }
    if settings.broker_key_prefix:
        transport_options["global_keyprefix"] = settings.broker_key_prefix
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # The running job's message and the next one, which the worker's one child prepares meanwhile
        # (farm/celery/worker.py `NextMessage`).
        worker_prefetch_multiplier=2,
        task_default_queue=settings.queue,
        task_soft_time_limit=settings.soft_time_limit_s,
        task_time_limit=settings.hard_time_limit_s,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        # A worker must not take its siblings' or its own previous incarnation's state: no gossip, no
        # mingle (farm/celery/worker.py). Monitoring is opt-in: Flower lists workers and tasks from task events
        # and event heartbeats, and fills its worker pages (pool, queues, registered tasks) through
        # remote-control inspection. Without a monitor nothing would listen, so by default workers send
        # no events and keep no broadcast queue in Redis; with one, the cost is three small pub/sub
        # messages per job (received, started, succeeded) and a heartbeat every 2 s, nothing next to
        # jobs that take seconds. Both use the broker key prefix, so farms sharing a Redis stay apart.
        worker_enable_remote_control=events,
        worker_send_task_events=events,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    # Settings accept Redis URLs only (settings.check_broker_url): every one gets kombu's Redis transport
    # with acknowledgements that survive a Redis restart (broker.py).
    app.conf.broker_transport = TRANSPORT
    if urlparse(settings.broker_url).scheme == "rediss":
        # kombu sets TLS up from the URL's scheme only when it picks the transport itself; naming ours
        # skips that, so the URL's TLS options (ssl_cert_reqs, ssl_ca_certs, ...) are handed over here.
        # Without any, the server's certificate is verified (kombu's own fallback verifies nothing).
        app.conf.broker_use_ssl = parse_url(settings.broker_url).get("ssl") or {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    return app


def restore_sweep(visibility_timeout_s: int) -> dict[str, int]:
    """How often a worker looks for messages whose consumer died (kombu's `restore_visible`): about every
    quarter of the visibility timeout, and never less often than kombu's default of 10 s x 10 polls. With
    the default hour-long timeout nothing changes; a short one (tests, impatient farms) gets its
    abandoned messages back in about the timeout rather than 100 s later."""
    interval = max(1, min(10, visibility_timeout_s // 4))
    throttle = max(1, min(10, visibility_timeout_s // 4 // interval))
    return {"unacked_restore_interval": interval, "unacked_restore_throttle": throttle}


# TCP keepalive on the broker connections: probes after this many idle seconds, this often, this many.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 5, 3


def broker_keepalive() -> dict[str, object]:
    """TCP keepalive for every Redis connection of the farm's Celery app. kombu passes
    `socket_keepalive=None` to redis-py, so without this a connection whose server side is gone — the
    server gave up on it during a network partition (its retransmissions time out after ~15 min by
    default), a NAT or firewall forgot it — is never noticed by a client that only waits: an idle worker's
    BRPOP (kombu < 5.7 has no BRPOP watchdog; with kombu 5.6.2 an idle worker cut off for 30 s while the
    server dropped its connection never took a job again: R11), or a command whose reply was lost. With
    keepalive the first probe after the partition gets a reset (or the probes time out) within
    idle + interval x probes (45 s) of silence, the call fails, and Celery reconnects. A live connection
    is never idle that long: BRPOP returns every second."""
    options = {
        getattr(socket, name): value
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        )
        if hasattr(socket, name)
    }
    return {"socket_keepalive": True, "socket_keepalive_options": options}


def start_flower(
    settings: Settings, *, port: int, address: str, basic_auth: str | None, flower_args: tuple[str, ...] = ()
) -> None:
    """Run Celery Flower on the farm's broker until it is stopped (`dsocr flower`); `basic_auth`
    (USER:PASSWORD) turns its login on, `flower_args` go to Flower as they are."""
    if find_spec("flower") is None:
        raise InputError("dsocr flower needs Flower: pip install 'dsocr-workers[flower]'")
    # Flower is a `celery` subcommand (an entry point it installs); `start` runs it with this app.
    login = [f"--basic-auth={basic_auth}"] if basic_auth else []
    create_app(settings).start(["flower", f"--port={port}", f"--address={address}", *login, *flower_args])
