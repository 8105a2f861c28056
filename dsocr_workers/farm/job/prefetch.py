"""The next job's page, prepared while this job has the device: on a thread, or on a GPU in the
page-preparing processes (farm/job/page_processes.py), the thread waiting for it off the GIL.

Which job: `Upcoming` reads it from the ledger in the thread's own transaction (`dsocr run` knows its
line; a Celery child is told by its lane's parent which message it fetched for it next). Nothing is
claimed: the page is kept for its job id and taken only by that job as it is claimed (same image,
prompt, mode and model: `PagePlan`); any other job drops it. The page's `preprocess` stage is timed on
the job's own clock (in a process: from its hand-over to its page back); the time it then waits
(`page_wait_ms`) stays outside its e2e. A page whose preparation fails keeps its error, which its job
raises when it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from dsocr_workers.farm.job.page_processes import PagesUnavailable
from dsocr_workers.farm.run_options import ModelKey, RunOptions
from dsocr_workers.store.db import Database
from dsocr_workers.store.ledger import WaitingJob
from dsocr_workers.store.models import Job, Run

if TYPE_CHECKING:
    from dsocr_workers.engine.session import PreparedJob
    from dsocr_workers.farm.job.claims import Claiming
    from dsocr_workers.farm.job.page_processes import PageProcesses

log = logging.getLogger("dsocr.worker")

# Reads, in the caller's transaction, the job whose page to prepare next; None: none known.
Upcoming = Callable[[Session], WaitingJob | None]


class JobFacts(Protocol):
    """A job as read from the ledger: its claim, or as a waiting job before its claim."""

    @property
    def job_id(self) -> str: ...
    @property
    def image_path(self) -> Path: ...
    @property
    def model(self) -> str: ...
    @property
    def parameters(self) -> dict[str, Any]: ...
    @property
    def profile(self) -> bool: ...


@dataclass(frozen=True)
class PagePlan:
    """What a job's prepared page depends on: a page prepared for one plan serves no other."""

    job_id: str
    image_path: Path
    prompt: str | None
    mode: str
    model: ModelKey  # the tokenizer that made the prompt's ids

    @classmethod
    def of_job(cls, job: JobFacts) -> PagePlan:
        options = RunOptions.from_parameters(job.model, job.parameters)
        return cls(job.job_id, job.image_path, options.prompt, options.mode_name, options.model_key)

    def prepare(self, session: Any, pages: PageProcesses | None = None) -> PreparedJob:
        """The page, prepared here or, given `pages`, in one of those processes (here if none can)."""
        clock = session.new_clock(self.job_id)
        if pages is not None:
            try:
                return pages.submit(str(self.image_path), self.prompt, self.mode, clock).result()
            except PagesUnavailable:
                log.warning("job %s: no page-preparing process; its page is prepared here", self.job_id)
        return session.prepare_job(str(self.image_path), self.prompt, self.mode, clock=clock)


@dataclass(frozen=True)
class Prefetched:
    """A page prepared ahead for `plan`, or the error preparing it met, and its job as read then."""

    plan: PagePlan
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

    def start(
        self, upcoming: Upcoming, model: ModelKey, session: Any, pages: PageProcesses | None = None
    ) -> None:
        """Prepare the page of the job `upcoming` names with `session` (the loaded `model`; a job of
        another model is left to prepare its own, after that model is loaded), in one of `pages`' processes
        where given, the thread waiting for it. A page prefetched earlier and not taken is dropped."""
        self._next = self._thread.submit(self._prepare, upcoming, model, session, pages)

    def job(self, job_id: str) -> WaitingJob | None:
        """The job whose page is being prefetched, as the thread read it, if it is `job_id` (waiting for
        the thread if it is still at work: the job's own run would wait for its page anyway). Its
        run's model and parameters then need no second read before the claim."""
        prefetched = None if self._next is None else self._next.result()
        return prefetched.job if prefetched is not None and prefetched.plan.job_id == job_id else None

    def run_of(self, job_id: str) -> RunOptions | None:
        """The options of `job_id`'s run: as read with its prefetched page, else from the ledger; None for
        a job that is gone or unknown."""
        run: Any = self.job(job_id)  # a WaitingJob or a row: both have .model, .parameters
        if run is None:
            with self._db.transaction() as tx:
                run = tx.execute(select(Run.model, Run.parameters).join(Job).where(Job.id == job_id)).first()
        return None if run is None else RunOptions.from_parameters(run.model, run.parameters)

    def job_to_run(
        self, claiming: Claiming, open_model: ModelKey | None, before_claim_wait: Callable[[], None]
    ) -> tuple[JobFacts, Prefetched | None]:
        """The job `claiming` claims, and its page if one was prefetched for it as it is. A job whose page
        was prefetched for the open model starts before its claim is written, from what the prefetch
        read (a run's settings and a job's image never change); any other waits for its claim here,
        after `before_claim_wait()`."""
        prefetched = self.take_job(claiming.job_id)
        if (
            prefetched is not None
            and not claiming.claim.done()
            and not isinstance(prefetched.outcome, Exception)
            and prefetched.plan.model == open_model
        ):
            return prefetched.job, prefetched
        before_claim_wait()
        claim = claiming.result()
        if prefetched is not None and prefetched.plan != PagePlan.of_job(claim):
            prefetched = None
        return claim, prefetched

    def take_job(self, job_id: str) -> Prefetched | None:
        """The page prefetched for `job_id` (waiting for the thread if it is still at work), or None;
        either way nothing stays prefetched. The caller checks that it was prepared for the job as it
        is claimed (`Prefetched.plan`)."""
        future, self._next = self._next, None
        if future is None:
            return None
        prefetched = future.result()
        return prefetched if prefetched is not None and prefetched.plan.job_id == job_id else None

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _prepare(
        self, upcoming: Upcoming, model: ModelKey, session: Any, pages: PageProcesses | None
    ) -> Prefetched | None:
        try:
            with self._db.transaction() as tx:
                waiting = upcoming(tx)
        except Exception:  # a ledger outage: the next job prepares its own page
            log.warning("could not read the next job to prefetch its page", exc_info=True)
            return None
        if waiting is None:
            return None
        plan = PagePlan.of_job(waiting)
        if plan.model != model:
            return None
        try:
            prepared = plan.prepare(session, pages)
        except Exception as exc:  # the job raises it when it runs (a bad image: its InputError)
            return Prefetched(plan, exc, waiting)
        return Prefetched(plan, prepared, waiting)
