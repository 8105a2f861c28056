"""Every environment variable the package reads, once: its name, type, default and meaning
(`VARIABLES`), in the manner of vLLM's `envs.py`. Code reads a variable through `read(VARIABLE)`, never
through `os.environ`; the README's configuration table is checked against this registry by a test
(tests/test_settings.py), and so is the package's source (no `DSOCR_*` name outside this file).

`Settings` is the farm's part, read once per process (`Settings.from_env`) and handed down: every process
of the farm — `dsocr submit`, `dsocr worker`, `dsocr report` — reads the same variables, so a deployment
sets them once (compose file, systemd unit, Kubernetes manifest). Credentials live only in the two URLs;
`redacted()` is what may be printed or stored.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from dsocr_workers.errors import InputError

T = TypeVar("T")

DEFAULT_DATABASE_URL = "sqlite:///./dsocr.db"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
BROKER_URL_FORMS = "redis://[:PASSWORD@]HOST[:PORT]/DB, or rediss://… for TLS (e.g. redis://127.0.0.1:6379/0)"
# Queue names travel comma-separated to Celery's --queues: a comma would split one name into two.
_QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}")


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: `parse` turns its text into a value (raising InputError on bad text);
    unset or empty means `default`. `shown_default` is how the README's table states the default."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    shown_default: str


def _integer(name: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            return int(raw)
        except ValueError:
            raise InputError(f"{name} must be an integer, got {raw!r}") from None

    return parse


def _count(name: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        count = _integer(name)(raw)
        if count < 1:
            raise InputError(f"{name} must be at least 1, got {raw!r}")
        return count

    return parse


def _switch(name: str) -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        if raw not in ("0", "1"):
            raise InputError(f"{name} must be 0 or 1, got {raw!r}")
        return raw == "1"

    return parse


def _path(raw: str) -> Path | None:
    return Path(raw).expanduser()


DATABASE_URL = Variable("DSOCR_DATABASE_URL", str, DEFAULT_DATABASE_URL,
                        "SQLAlchemy URL of the ledger", f"`{DEFAULT_DATABASE_URL}`")
BROKER_URL = Variable("DSOCR_BROKER_URL", str, DEFAULT_BROKER_URL,
                      "Celery broker (Redis)", f"`{DEFAULT_BROKER_URL}`")
BROKER_KEY_PREFIX = Variable("DSOCR_BROKER_KEY_PREFIX", str, "",
                             "prefix of every Redis key the farm uses", "none")
QUEUE = Variable("DSOCR_QUEUE", str, "dsocr", "queue jobs are sent to and read from", "`dsocr`")
MAX_ATTEMPTS = Variable("DSOCR_MAX_ATTEMPTS", _integer("DSOCR_MAX_ATTEMPTS"), 3,
                        "attempts before a job is poisoned", "`3`")
HARD_TIME_LIMIT = Variable("DSOCR_HARD_TIME_LIMIT", _integer("DSOCR_HARD_TIME_LIMIT"), 600,
                           "seconds before a job's process is killed", "`600`")
SOFT_TIME_LIMIT = Variable("DSOCR_SOFT_TIME_LIMIT", _integer("DSOCR_SOFT_TIME_LIMIT"), None,
                           "seconds before a job is asked to stop", "hard − 10 %")
LEASE_SECONDS = Variable(
    "DSOCR_LEASE_SECONDS",
    _integer("DSOCR_LEASE_SECONDS"),
    60,
    "how long a claim holds a job without a heartbeat renewing it; a dead worker's jobs are requeued by "
    "the live ones within lease + heartbeat",
    "`60`",
)
HEARTBEAT_SECONDS = Variable(
    "DSOCR_HEARTBEAT_SECONDS",
    _integer("DSOCR_HEARTBEAT_SECONDS"),
    10,
    "how often each worker renews its leases, records that it lives, and requeues jobs whose holder "
    "stopped beating (lease ≥ 3 × heartbeat)",
    "`10`",
)
RETRY_BACKOFF_MAX = Variable("DSOCR_RETRY_BACKOFF_MAX", _integer("DSOCR_RETRY_BACKOFF_MAX"), 60,
                             "ceiling of the retry backoff, seconds", "`60`")
VISIBILITY_TIMEOUT = Variable(
    "DSOCR_VISIBILITY_TIMEOUT",
    _integer("DSOCR_VISIBILITY_TIMEOUT"),
    None,
    "seconds before Redis redelivers an unacknowledged job (below the job length, running jobs are "
    "delivered twice: safe, the claim refuses the copy, but wasteful)",
    "max(3600, 2 × lease)",
)
MODEL = Variable("DSOCR_MODEL", str, "tiny", "default `--model` of `dsocr infer` / `dsocr verify`", "`tiny`")
FLOWER_BASIC_AUTH = Variable("DSOCR_FLOWER_BASIC_AUTH", str, "",
                             "`USER:PASSWORD` that `dsocr flower` asks for", "none")
GIT_SHA = Variable("DSOCR_GIT_SHA", str, None,
                   "the commit recorded in results where there is no git checkout (set by image builds)",
                   "the checkout's commit")
INSTRUMENTATION = Variable("DSOCR_INSTRUMENTATION", _switch("DSOCR_INSTRUMENTATION"), True,
                           "`0` turns NVTX ranges and stage timers off (overhead benchmarks)", "`1`")
COMPILE_CACHE_DIR = Variable(
    "DSOCR_COMPILE_CACHE_DIR",
    _path,
    None,
    "where the fast engine's compiled kernels persist (torch's inductor and Triton caches) and what "
    "`dsocr precompile` builds (`dsocr-artifacts/`: AOTInductor packages and a manifest per plan and GPU type): a directory per host "
    "that outlives the worker, so a start loads instead of compiling. Where the Python installation ships "
    "no bytecode and may not write it (`PYTHONDONTWRITEBYTECODE`, a read-only image), also Python's "
    "bytecode (`python-bytecode/`, written by `dsocr precompile`). docker-compose.yml and the Kubernetes "
    "manifest mount one",
    "torch's default, in /tmp",
)


def _match_time_limit(raw: str) -> float | None:
    if raw.strip().lower() == "none":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise InputError(f"DSOCR_MATCH_TIME_LIMIT={raw!r}: expected seconds above 0, or none for no limit")
    return seconds


# OmniDocBench's evaluator gives quick_match 30 s a page; past them, a page is matched one-to-one.
MATCH_TIME_LIMIT: Variable[float | None] = Variable(
    "DSOCR_MATCH_TIME_LIMIT",
    _match_time_limit,
    30.0,
    "seconds OmniDocBench's `quick_match` may take to match one page's text and formulas before the page "
    "is matched one-to-one instead, as the official evaluator does (a result's `matched_by` says which "
    "scored it); `none`: no limit, for scores that do not depend on the machine's speed",
    "`30` (the evaluator's)",
)

PAGE_PROCESSES = Variable(
    "DSOCR_PAGE_PROCESSES",
    _count("DSOCR_PAGE_PROCESSES"),
    None,
    "processes a worker child prepares its pages in (image decoding, resizes and tiles, the prompt's "
    "ids), off the GIL its device's launches need: a batch's pages, and on a GPU batch-1 jobs' prefetched ones",
    "half the CPUs, 1 to 4",
)
CPU_THREADS = Variable("OMP_NUM_THREADS", _integer("OMP_NUM_THREADS"), None,
                       "CPU threads per CPU worker child; set it when several CPU workers share a host",
                       "cores ÷ CPU children")

# Other programs' variables the package reads (and, where it says so, sets for a process it starts).
VISIBLE_GPUS = Variable(
    "CUDA_VISIBLE_DEVICES",
    str,
    None,
    "CUDA's: the GPUs this host's worker may use (`--gpus` indices count within them); a worker child is "
    "given its own GPU as its only visible one",
    "every GPU",
)
TORCH_CACHE_DIR = Variable(
    "TORCHINDUCTOR_CACHE_DIR",
    _path,
    None,
    "torch's compile cache; set from DSOCR_COMPILE_CACHE_DIR for the commands that open a model",
    "under /tmp",
)
BYTECODE_PREFIX = Variable(
    "PYTHONPYCACHEPREFIX", _path, None,
    "Python's: where bytecode is kept; set to DSOCR_COMPILE_CACHE_DIR/python-bytecode where the "
    "installation ships none and may not write it", "beside the sources")
CXX = Variable(
    "CXX", str, None,
    "the C++ compiler `dsocr precompile` builds AOTInductor packages with (recorded in the manifest); "
    "/usr/bin/g++ on the lent GPU image, whose /opt/gcc builds packages that crash at load", "c++")

# In the README's order (its configuration table is `markdown_table()`, checked by a test).
VARIABLES: tuple[Variable, ...] = (
    DATABASE_URL,
    BROKER_URL,
    BROKER_KEY_PREFIX,
    QUEUE,
    MAX_ATTEMPTS,
    HARD_TIME_LIMIT,
    SOFT_TIME_LIMIT,
    LEASE_SECONDS,
    HEARTBEAT_SECONDS,
    RETRY_BACKOFF_MAX,
    MODEL,
    VISIBILITY_TIMEOUT,
    INSTRUMENTATION,
    COMPILE_CACHE_DIR,
    MATCH_TIME_LIMIT,
    FLOWER_BASIC_AUTH,
    GIT_SHA,
    PAGE_PROCESSES,
    CPU_THREADS,
    VISIBLE_GPUS,
    TORCH_CACHE_DIR,
    BYTECODE_PREFIX,
    CXX,
)


def markdown_table() -> str:
    """The README's configuration table: one row per variable, from this registry."""
    rows = ["| variable | meaning | default |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.doc} | {v.shown_default} |" for v in VARIABLES]
    return "\n".join(rows)


def read(variable: Variable[T], environ: Mapping[str, str] | None = None) -> T:
    """The variable's value in `environ` (default: this process's environment); unset or empty: its
    default."""
    raw = (os.environ if environ is None else environ).get(variable.name, "")
    return variable.default if raw == "" else variable.parse(raw)


def check_queue_name(name: str) -> str:
    if not _QUEUE_NAME.fullmatch(name):
        raise InputError(
            f"queue name {name!r}: use letters, digits and . _ : @ - (no commas or spaces), at most 200"
        )
    return name


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
    # Redis redelivers an unacknowledged message after this long; it must outlast any job (acks_late)
    # or a long job is delivered twice while it still runs (the claim then refuses the copy). Default
    # (`from_env`): max(3600, 2 x lease); shorter gets a dead worker's message back sooner.
    visibility_timeout_s: int = 3600

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
        if self.visibility_timeout_s < 1:
            raise InputError("DSOCR_VISIBILITY_TIMEOUT must be at least 1")

    @property
    def requeue_within_s(self) -> int:
        # A holder's last beat renews its lease to lease_s; a surviving worker's sweep (every heartbeat)
        # finds it expired at most one interval later.
        return self.lease_s + self.heartbeat_s

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        hard = read(HARD_TIME_LIMIT, environ)
        # The soft limit leaves a tenth of the hard one to record the timeout before the kill.
        soft = read(SOFT_TIME_LIMIT, environ)
        lease = read(LEASE_SECONDS, environ)
        visibility = read(VISIBILITY_TIMEOUT, environ)
        return cls(
            database_url=read(DATABASE_URL, environ),
            broker_url=read(BROKER_URL, environ),
            broker_key_prefix=read(BROKER_KEY_PREFIX, environ),
            queue=read(QUEUE, environ),
            soft_time_limit_s=max(1, hard - max(1, hard // 10)) if soft is None else soft,
            hard_time_limit_s=hard,
            lease_s=lease,
            heartbeat_s=read(HEARTBEAT_SECONDS, environ),
            max_attempts=read(MAX_ATTEMPTS, environ),
            retry_backoff_max_s=read(RETRY_BACKOFF_MAX, environ),
            visibility_timeout_s=max(3600, 2 * lease) if visibility is None else visibility,
        )


def redacted(url: str) -> str:
    """The URL with its password masked: the only form of a URL that is printed, logged or stored."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: show nothing that could be a secret
        return url.split("@")[-1]
