"""What the batched jobs (farm/job/batched.py) read of the job process that holds them: its open model
(`OpenModel`) and the process itself (`JobHost`), apart from farm/job/process.py so that they read
them without importing it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dsocr_workers.farm.job.ledger_threads import LedgerThreads
from dsocr_workers.farm.run_options import ModelKey, NGram, RunOptions
from dsocr_workers.model.config import dtype_name
from dsocr_workers.settings import Settings
from dsocr_workers.store.db import Database

if TYPE_CHECKING:
    from dsocr_workers.farm.job.columns import Score
    from dsocr_workers.farm.job.page_processes import PageProcesses
    from dsocr_workers.store.ledger import Claim


@dataclass
class OpenModel:
    """A job process's open model: its session, what it is (its key, its environment fingerprint, its
    latest worker session) and the warm-ups it has run."""

    key: ModelKey
    session: Any  # DeepSeekOCRSession
    worker_id: str  # the environment fingerprint
    worker_session_id: str  # the latest `worker_sessions` row: the state the next job runs in
    # (mode, token budget, n-gram ban)
    warmed: set[tuple[str, int | None, NGram]] = field(default_factory=set)

    @property
    def dtype(self) -> str:
        """The session's dtype by name, as the ledger records it."""
        return dtype_name(self.session.dtype)


class Batch(Protocol):
    """What a job's task uses of its process's batch (farm/job/batched.py `BatchedJobs`)."""

    @property
    def jobs(self) -> Mapping[str, object]: ...

    def add(self, claim: Claim, claimed_s: float, options: RunOptions) -> None: ...

    def wait_for_room(self) -> None: ...

    def drain(self) -> None: ...


class JobHost(Protocol):
    """What the batched jobs use of their job process (farm/job/process.py `JobProcess`)."""

    db: Database
    settings: Settings
    owner: str
    device: str
    ledger_threads: LedgerThreads
    @property
    def score(self) -> Score: ...

    @property
    def batch(self) -> Batch | None: ...

    def joinable_batch(self, options: RunOptions) -> Batch: ...

    def pages_for(self, session: Any) -> PageProcesses: ...

    def send_again(self, job_ids: list[str]) -> None: ...
