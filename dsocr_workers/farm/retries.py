"""The farm's retry policies, one per kind of failure:

- **The ledger is out of reach** (`TransientError` from a database call: the job is unchanged, or still
  held under this process's lease): the same call again after 2 s, then 4, 8, 16 and 30 s at most
  (`ledger_retrying`). `dsocr run` gives up after a number of tries and raises; a Celery child's ledger
  threads keep trying until the child closes. A Celery task that meets it before its job started asks
  Celery to deliver its message again after `job_retry_in_s`.
- **A job's attempt failed** (its error recorded, the job queued again): delivered again after an
  exponential backoff with full jitter, 2 s doubling up to `DSOCR_RETRY_BACKOFF_MAX` (`job_retry_in_s`,
  Celery's own helper), until the ledger poisons it after `DSOCR_MAX_ATTEMPTS`.

Input errors are final and never retried (errors.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    stop_when_event_set,
    wait_exponential,
)
from tenacity.stop import stop_base

from dsocr_workers.errors import TransientError
from dsocr_workers.settings import Settings


def ledger_retrying(
    *,
    attempts: int | None = None,
    until: threading.Event | None = None,
    sleep: Callable[[float], None] | None = None,
) -> Retrying:
    """Calls again after a TransientError, `attempts` tries in all (None: no limit) or until the event
    `until` is set; the last error is raised. `sleep`: how to wait (e.g. an event's wait, cut short when
    the caller closes)."""
    stop: stop_base = stop_never if attempts is None else stop_after_attempt(attempts)
    if until is not None:
        stop = stop | stop_when_event_set(until)
    return Retrying(
        retry=retry_if_exception_type(TransientError),
        wait=wait_exponential(multiplier=2, max=30),
        stop=stop,
        reraise=True,
        sleep=sleep or time.sleep,
    )


def job_retry_in_s(attempt: int, settings: Settings) -> float:
    """When a job whose attempt `attempt` failed is delivered again."""
    from celery.utils.time import get_exponential_backoff_interval

    return float(
        get_exponential_backoff_interval(2, attempt, settings.retry_backoff_max_s, full_jitter=True) + 1
    )
