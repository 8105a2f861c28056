"""The farm's retry policies (farm/retries.py): the ledger's outages are retried with backoff, nothing
else is; a job's next delivery backs off within the configured ceiling."""

from __future__ import annotations

import threading

import pytest

from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.retries import job_retry_in_s, ledger_retrying
from dsocr_workers.settings import Settings


def test_ledger_outages_are_retried_then_the_last_error_raised() -> None:
    waits: list[float] = []
    calls: list[int] = []

    def out_of_reach() -> None:
        calls.append(1)
        raise TransientError("database down")

    with pytest.raises(TransientError):
        ledger_retrying(attempts=4, sleep=waits.append)(out_of_reach)
    assert len(calls) == 4 and waits == [2, 4, 8]


def test_a_closing_caller_stops_retrying_and_other_errors_are_not_retried() -> None:
    closing, calls_before_close = threading.Event(), []

    def down_then_closed() -> None:
        calls_before_close.append(1)
        closing.set()
        raise TransientError("database down")

    with pytest.raises(TransientError):
        ledger_retrying(until=closing, sleep=lambda _: None)(down_then_closed)
    assert calls_before_close == [1]
    calls: list[int] = []

    def bad_input() -> None:
        calls.append(1)
        raise InputError("not an image")

    with pytest.raises(InputError):
        ledger_retrying(attempts=5, sleep=lambda _: None)(bad_input)
    assert calls == [1]


def test_a_failed_job_is_delivered_again_within_the_ceiling() -> None:
    settings = Settings(retry_backoff_max_s=5)
    delays = [job_retry_in_s(attempt, settings) for attempt in range(1, 8) for _ in range(20)]
    assert all(1 <= delay <= 6 for delay in delays)
