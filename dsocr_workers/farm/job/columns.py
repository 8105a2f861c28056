"""The `results` columns a job's result row adds to its engine result: accuracy against its reference,
its device times on the ledger's clock, and a profiled job's trace."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dsocr_workers.engine.result import DeviceSpan, InferenceResult, ProfileCapture
from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.settings import MATCH_TIME_LIMIT, read
from dsocr_workers.store import ledger
from dsocr_workers.store.models import utcnow

# A job's accuracy columns from its markup and reference: `accuracy_columns` or a worker's scoring process.
Score = Callable[[str, dict[str, Any] | None], dict[str, float | str | None]]
# A job without a reference: every accuracy column empty.
NO_ACCURACY: dict[str, float | str | None] = dict.fromkeys(
    ("text_edit", "formula_edit", "table_edit", "reading_order_edit", "table_teds", "table_teds_structure",
     "matched_by")
)  # fmt: skip


def accuracy_columns(markup: str, reference: dict[str, Any] | None) -> dict[str, float | str | None]:
    """The job's edit distances and table TEDS to its reference (quality/scoring.py), on the markdown
    the model's markup renders to (its `result.mmd`), and the matching that paired them (quick_match
    within DSOCR_MATCH_TIME_LIMIT, or one-to-one past it); all None without a reference. A worker runs
    it in its scoring process (scoring_process.py); the scorer is imported at the first reference."""
    if reference is None:
        return dict(NO_ACCURACY)
    from dsocr_workers.quality.omnidocbench import PageReference
    from dsocr_workers.quality.scoring import score_page

    scores = score_page(render_mmd(markup), PageReference.from_json(reference), read(MATCH_TIME_LIMIT))
    return {"text_edit": scores.text, "formula_edit": scores.formula, "table_edit": scores.table,
            "reading_order_edit": scores.reading_order, "table_teds": scores.table_teds,
            "table_teds_structure": scores.table_teds_structure, "matched_by": scores.matched_by}  # fmt: skip


def device_columns(span: DeviceSpan | None, claimed_s: float) -> dict[str, Any]:
    """TTFT from the claim (`claimed_s`, this process's perf_counter like the span) and when the device
    began and finished the job, as UTC times; None without timings."""
    if span is None:
        return {"ttft_from_claim_ms": None, "device_started_at": None, "device_finished_at": None}
    now_s, now = time.perf_counter(), utcnow()
    return {
        "ttft_from_claim_ms": (span.first_token_s - claimed_s) * 1e3,
        "device_started_at": now - timedelta(seconds=now_s - span.started_s),
        "device_finished_at": now - timedelta(seconds=now_s - span.finished_s),
    }


def profile_columns(result: InferenceResult) -> dict[str, Any]:
    """A profiled job's trace and kernel summary, as its `profiles` row (under ledger.PROFILE: written
    with the result, in its transaction); nothing for any other job."""
    return {} if result.profile is None else {ledger.PROFILE: profile_row(result.profile)}


def profile_row(profile: ProfileCapture) -> dict[str, Any]:
    """A profile's `profiles` columns, less its ids (its job's or batch step's, and its run's)."""
    return {"activity": profile.summary.activity, "trace_gz": profile.trace_gz, "trace_bytes": profile.trace_bytes,
            "summary": profile.summary.to_json()}  # fmt: skip
