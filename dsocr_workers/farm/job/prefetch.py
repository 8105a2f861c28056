"""The next job's page, prepared while this job has the device (issue 10).

A job process (farm/job/process.py) runs one job at a time, and a job begins with host work: reading the
image, EXIF, tiling, normalising to bytes, the prompt's tokens (`model.preprocess.prepare_page`, about
100 ms for a gundam page) before the device has anything to do. So while a job runs, one background
thread prepares the page of the job this process runs next:

- Which job: `Upcoming` reads it from the ledger, in the thread's own transaction. `dsocr run` knows
  its line (`ledger.waiting_job`); a Celery child is told by its lane's parent which message it has
  fetched for it next (farm/celery/worker.py `NextMessage`), which another thread of the child has
  reserved (`ledger.reserve_job`: so that a sweep brings the message back if the lane dies with it).
- Nothing is claimed or leased: the page is kept for its job id, and a job takes it only if it is
  its own (same job, image, prompt, mode and model); any other job drops it (a retry whose countdown
  ended in between), costing one page of host work. A process that dies loses a page, never a job.
- Timing: the page's `preprocess` stage is timed on the job's own clock where it ran, on this thread
  (engine `prepare_job`); the job records that it was prefetched, and the time its page then waited
  (`page_wait_ms`) stays outside its e2e.
- Errors: a page whose preparation fails (a bad image) keeps its error, and its job raises it when it
  runs, as if it had prepared the page itself. Nothing the thread meets reaches the running job.

The thread takes the GIL only between PIL's and torch's own work (both release it while decoding,
resizing and copying), while the running job mostly waits on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from dsocr_workers.farm.run_options import ModelKey, RunOptions
from dsocr_workers.store.db import Database
from dsocr_workers.store.ledger import WaitingJob

if TYPE_CHECKING:
    from dsocr_workers.engine.session import PreparedJob

log = logging.getLogger("dsocr.worker")

# Reads, in the caller's transaction, the job whose page to prepare next; None: none known.
Upcoming = Callable[[Session], WaitingJob | None]


@dataclass(frozen=True)
class PageRequest:
    """What a job's prepared page depends on: a page prepared for one request serves no other."""

    job_id: str
    image_path: Path
    prompt: str | None
    mode: str
    model: ModelKey  # the tokenizer that made the prompt's ids

    @classmethod
    def of_job(cls, job_id: str, image_path: Path, options: RunOptions) -> PageRequest:
        return cls(job_id, image_path, options.prompt, options.mode, options.model_key)


@dataclass(frozen=True)
class Prefetched:
    """A page prepared ahead for `request`, or the error preparing it met, and its job as read then."""

    request: PageRequest
    outcome: PreparedJob | Exception
    job: WaitingJob

    def page(self) -> PreparedJob:
        """The prepared page; the error, raised here, in the job's own run."""
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class Prefetcher:
    """One page at a time, prepared on a thread of its own."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsocr-prefetch")
        self._next: Future[Prefetched | None] | None = None

    def start(self, upcoming: Upcoming, model: ModelKey, session: Any) -> None:
        """Prepare the page of the job `upcoming` names with `session` (the loaded `model`; a job of
        another model is left to prepare its own, after that model is loaded). A page prefetched earlier
        and not taken is dropped."""
        self._next = self._thread.submit(self._prepare, upcoming, model, session)

    def job(self, job_id: str) -> WaitingJob | None:
        """The job whose page is being prefetched, as the thread read it, if it is `job_id` (waiting for
        the thread if it is still at work: the job's own run would wait for its page anyway). Its
        run's model and parameters then need no second read before the claim."""
        prefetched = None if self._next is None else self._next.result()
        return prefetched.job if prefetched is not None and prefetched.request.job_id == job_id else None

    def take_job(self, job_id: str) -> Prefetched | None:
        """The page prefetched for `job_id` (waiting for the thread if it is still at work), or None;
        either way nothing stays prefetched. The caller checks that it was prepared for the job as it
        is claimed (`Prefetched.request`)."""
        future, self._next = self._next, None
        if future is None:
            return None
        prefetched = future.result()
        return prefetched if prefetched is not None and prefetched.request.job_id == job_id else None

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _prepare(self, upcoming: Upcoming, model: ModelKey, session: Any) -> Prefetched | None:
        try:
            with self._db.transaction() as tx:
                waiting = upcoming(tx)
        except Exception:  # a ledger outage: the next job prepares its own page
            log.warning("could not read the next job to prefetch its page", exc_info=True)
            return None
        if waiting is None:
            return None
        options = RunOptions.from_parameters(waiting.model, waiting.parameters)
        request = PageRequest.of_job(waiting.job_id, waiting.image_path, options)
        if request.model != model:
            return None
        try:
            prepared = session.prepare_job(str(request.image_path), request.prompt, request.mode, job_id=request.job_id)
        except Exception as exc:  # the job raises it when it runs (a bad image: its InputError)
            return Prefetched(request, exc, waiting)
        return Prefetched(request, prepared, waiting)
