"""Farm settings, read from the environment (flags override them where a command offers one).

Every process of the farm — `dsocr submit`, `dsocr worker`, `dsocr report` — reads the same variables, so a
deployment sets them once (compose file, systemd unit, Kubernetes manifest):

    DSOCR_DATABASE_URL        SQLAlchemy URL of the ledger            sqlite:///./dsocr.db
    DSOCR_BROKER_URL          Celery broker (Redis)                   redis://127.0.0.1:6379/0
    DSOCR_BROKER_KEY_PREFIX   prefix of every Redis key the farm uses  "" (none)
    DSOCR_QUEUE               queue that jobs are sent to and read from dsocr
    DSOCR_LEASE_SECONDS       how long a claim holds a job without    60
                              its worker's heartbeat renewing it
    DSOCR_HEARTBEAT_SECONDS   how often a worker renews its leases,   10
                              records that it lives, and requeues
                              jobs whose holder stopped beating
    DSOCR_MAX_ATTEMPTS        attempts before a job is poisoned        3
    DSOCR_SOFT_TIME_LIMIT     seconds before a job is asked to stop    hard limit - 10 %
    DSOCR_HARD_TIME_LIMIT     seconds before its process is killed     600
    DSOCR_RETRY_BACKOFF_MAX   ceiling of the retry backoff (seconds)   60
    DSOCR_VISIBILITY_TIMEOUT  seconds before Redis redelivers an       max(3600, 2 x lease)
                              unacknowledged message

Credentials live only in the two URLs; `redacted()` is what may be printed or stored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from dsocr_workers.errors import InputError

DEFAULT_DATABASE_URL = "sqlite:///./dsocr.db"
# Queue names travel comma-separated to Celery's --queues: a comma would split one name into two.
_QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}")


def check_queue_name(name: str) -> str:
    if not _QUEUE_NAME.fullmatch(name):
        raise InputError(
            f"queue name {name!r}: use letters, digits and . _ : @ - (no commas or spaces), at most 200"
        )
    return name
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
BROKER_URL_FORMS = "redis://[:PASSWORD@]HOST[:PORT]/DB, or rediss://… for TLS (e.g. redis://127.0.0.1:6379/0)"


def check_broker_url(url: str) -> str:
    """The broker URL, checked before anything is recorded or sent: Redis (or Redis over TLS), a host, a
    numeric port and database."""
    parsed = urlsplit(url)
    problem = None
    if parsed.scheme not in ("redis", "rediss"):
        problem = "is not a Redis URL"
    elif not parsed.hostname:
        problem = "names no host"
    else:
        try:
            parsed.port  # noqa: B018 (parsing it raises on a port that is not a number)
        except ValueError:
            problem = "has a port that is not a number"
        if not (parsed.path.strip("/") or "0").isdigit():
            problem = "has a database that is not a number"
    if problem:
        raise InputError(f"DSOCR_BROKER_URL {redacted(url)!r} {problem}; expected {BROKER_URL_FORMS}")
    return url


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str = DEFAULT_BROKER_URL
    broker_key_prefix: str = ""
    queue: str = "dsocr"
    soft_time_limit_s: int = 540
    hard_time_limit_s: int = 600
    lease_s: int = 60
    heartbeat_s: int = 10
    max_attempts: int = 3
    retry_backoff_max_s: int = 60
    visibility_timeout_override_s: int | None = None

    def __post_init__(self) -> None:
        check_queue_name(self.queue)
        check_broker_url(self.broker_url)
        if self.max_attempts < 1:
            raise InputError("DSOCR_MAX_ATTEMPTS must be at least 1")
        if not 0 < self.soft_time_limit_s <= self.hard_time_limit_s:
            raise InputError("DSOCR_SOFT_TIME_LIMIT must be positive and at most DSOCR_HARD_TIME_LIMIT")
        if self.heartbeat_s < 1:
            raise InputError("DSOCR_HEARTBEAT_SECONDS must be at least 1, e.g. 10")
        # The heartbeat renews a running job's lease; two beats may be missed (a slow database, a busy
        # host) before the lease runs out and another worker takes the job.
        if self.lease_s < 3 * self.heartbeat_s:
            raise InputError(
                f"DSOCR_LEASE_SECONDS ({self.lease_s}) must be at least 3 x DSOCR_HEARTBEAT_SECONDS "
                f"({self.heartbeat_s}), e.g. 60 with 10"
            )
        if self.visibility_timeout_override_s is not None and self.visibility_timeout_override_s < 1:
            raise InputError("DSOCR_VISIBILITY_TIMEOUT must be at least 1")

    @property
    def requeue_within_s(self) -> int:
        # A holder's last beat renews its lease to lease_s; a surviving worker's sweep (every heartbeat)
        # finds it expired at most one interval later.
        return self.lease_s + self.heartbeat_s

    @property
    def visibility_timeout_s(self) -> int:
        # Redis redelivers an unacknowledged message after this long; it must outlast any job (acks_late)
        # or a long job would be delivered twice while it still runs (the claim then refuses the copy).
        # The override exists for tests and for farms that want a dead worker's message back sooner
        # than an hour; below the hard time limit it causes such duplicate deliveries on purpose.
        if self.visibility_timeout_override_s is not None:
            return self.visibility_timeout_override_s
        return max(3600, 2 * self.lease_s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        hard = _int(env, "DSOCR_HARD_TIME_LIMIT", cls.hard_time_limit_s)
        # The soft limit leaves a tenth of the hard one to record the timeout before the kill.
        soft = _int(env, "DSOCR_SOFT_TIME_LIMIT", max(1, hard - max(1, hard // 10)))
        return cls(
            database_url=env.get("DSOCR_DATABASE_URL") or DEFAULT_DATABASE_URL,
            broker_url=env.get("DSOCR_BROKER_URL") or DEFAULT_BROKER_URL,
            broker_key_prefix=env.get("DSOCR_BROKER_KEY_PREFIX", ""),
            queue=env.get("DSOCR_QUEUE") or "dsocr",
            soft_time_limit_s=soft,
            hard_time_limit_s=hard,
            lease_s=_int(env, "DSOCR_LEASE_SECONDS", cls.lease_s),
            heartbeat_s=_int(env, "DSOCR_HEARTBEAT_SECONDS", cls.heartbeat_s),
            max_attempts=_int(env, "DSOCR_MAX_ATTEMPTS", cls.max_attempts),
            retry_backoff_max_s=_int(env, "DSOCR_RETRY_BACKOFF_MAX", cls.retry_backoff_max_s),
            visibility_timeout_override_s=(
                _int(env, "DSOCR_VISIBILITY_TIMEOUT", 0) if env.get("DSOCR_VISIBILITY_TIMEOUT") else None
            ),
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"{name} must be an integer, got {raw!r}") from None


def redacted(url: str) -> str:
    """The URL with its password masked: the only form of a URL that is printed, logged or stored."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: show nothing that could be a secret
        return url.split("@")[-1]
