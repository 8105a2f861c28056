"""A job process's model: the session it opened and what that session is (its key, its fingerprint, its
latest worker session, the warm-ups it has run). Apart from farm/job/process.py so that the batched
jobs (farm/job/batched.py), which the process drives, read it without importing the process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsocr_workers.farm.run_options import ModelKey, NGram


@dataclass
class LoadedSession:
    key: ModelKey
    session: Any  # DeepSeekOCRSession
    worker_id: str  # the environment fingerprint
    worker_session_id: str  # the latest `worker_sessions` row: the state the next job runs in
    warmed: set[tuple[str, int | None, NGram]] = field(default_factory=set)  # (mode, token budget, n-gram ban)
