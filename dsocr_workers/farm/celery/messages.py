"""The farm's one kind of message: a job id, sent to its queue as the task `RUN_JOB` (JSON, nothing
else; the ledger holds the rest), labelled for monitors with the job's run, image and repeat."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from dsocr_workers.farm.celery.broker import take_back_messages
from dsocr_workers.store.models import Job

RUN_JOB = "dsocr.run_job"
LABEL_BATCH = 500  # job ids per IN (...) when labelling messages: well below every dialect's limit


def job_labels(tx: Session, job_ids: list[str]) -> dict[str, str]:
    """What monitors show as each job's task keyword arguments (Celery's `kwargsrepr`): its run, image
    and repeat. Read in the caller's transaction: a second one would wait on SQLite's write lock."""
    labels: dict[str, str] = {}
    for start in range(0, len(job_ids), LABEL_BATCH):
        batch = job_ids[start : start + LABEL_BATCH]
        for job in tx.execute(
            select(Job.id, Job.run_id, Job.image, Job.repeat).where(Job.id.in_(batch))
        ):
            labels[job.id] = repr({"run": job.run_id, "image": job.image, "repeat": job.repeat})
    return labels


def send_job_messages(
    app: Any, jobs: list[tuple[str, str]], sent: list[str], labels: Mapping[str, str]
) -> None:
    """One message per (job id, queue), its task id the job id and its label `labels[job id]`; appends
    each job id to `sent` once its message is out. Raises the broker's error."""
    with app.producer_or_acquire() as producer:
        for job_id, queue in jobs:
            app.send_task(
                RUN_JOB,
                args=[job_id],
                kwargsrepr=labels.get(job_id),
                queue=queue,
                task_id=job_id,
                producer=producer,
            )
            sent.append(job_id)


def bring_back_job_messages(app: Any, tx: Session, jobs: list[tuple[str, str]]) -> None:
    """Jobs (job id, queue) taken back from a worker that stopped beating: the messages it held go back to
    the head of their queues; a job whose message is no longer held (acknowledged before its result was
    written) gets a new one, at the back. Raises the broker's error."""
    taken = take_back_messages(app, [job_id for job_id, _ in jobs])
    if missing := [(job_id, queue) for job_id, queue in jobs if job_id not in taken]:
        send_job_messages(app, missing, [], job_labels(tx, [job_id for job_id, _ in missing]))
