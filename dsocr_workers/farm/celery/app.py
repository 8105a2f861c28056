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
        # Monitoring is opt-in: Flower needs task events and remote control, and without a monitor
        # nothing listens, so by default workers send no events and keep no broadcast queue in Redis.
        worker_enable_remote_control=events,
        worker_send_task_events=events,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    # Settings accept Redis URLs only: every one gets the Redis transport of broker.py.
    app.conf.broker_transport = TRANSPORT
    if urlparse(settings.broker_url).scheme == "rediss":
        # kombu sets TLS up from the URL only when it picks the transport itself, so the URL's options
        # are handed over here; without any, the server's certificate is verified (kombu's are not).
        app.conf.broker_use_ssl = parse_url(settings.broker_url).get("ssl") or {
            "ssl_cert_reqs": ssl.CERT_REQUIRED
        }
    return app


def restore_sweep(visibility_timeout_s: int) -> dict[str, int]:
    """How often a worker looks for messages whose consumer died (kombu's `restore_visible`): about every
    quarter of the visibility timeout, never less often than kombu's default, so that a short timeout
    gets its abandoned messages back in about the timeout."""
    interval = max(1, min(10, visibility_timeout_s // 4))
    throttle = max(1, min(10, visibility_timeout_s // 4 // interval))
    return {"unacked_restore_interval": interval, "unacked_restore_throttle": throttle}


# TCP keepalive on the broker connections: probes after this many idle seconds, this often, this many.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 5, 3


def broker_keepalive() -> dict[str, object]:
    """TCP keepalive for every Redis connection of the farm's Celery app. kombu passes no keepalive to
    redis-py, so a connection whose server side is gone (a partition, a forgetful NAT) is never noticed
    by a client that only waits, such as an idle worker's BRPOP; with it, the call fails within
    idle + interval x probes of silence and Celery reconnects."""
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
