"""Submitting a run: the ledger first (run + one job per image and repeat), then the broker.

If the broker fails halfway, the jobs not yet sent stay `pending` in the ledger and
`dsocr reconcile --run ID` sends them; nothing is lost.

"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import insert

from dsocr_workers.engine.result import ModelSource
from dsocr_workers.errors import InputError, TransientError
from dsocr_workers.farm.celery.app import create_app
from dsocr_workers.farm.celery.broker import job_ids_in_broker
from dsocr_workers.farm.celery.messages import bring_back_job_messages, job_labels, send_job_messages
from dsocr_workers.farm.filelist import BadLine, FileList, read_filelist
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.model.families import all_presets, family_of_checkpoint, run_mode
from dsocr_workers.settings import Settings, check_queue_name, redacted
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, open_ledger
from dsocr_workers.store.models import Job, Run, job_id_for, utcnow
from dsocr_workers.store.runs import resolve_run


@dataclass(frozen=True)
class SubmittedRun:
    run_id: str
    job_ids: list[str]
    queue: str
    skipped: list[str] = field(default_factory=list)  # bad lines left out with --skip-invalid


@dataclass(frozen=True)
class ModelNames:
    """How a run names its model: its label, whether its weights are random (a preset), its family."""

    label: str
    random_weights: bool
    family: str


def model_names(model: str, seed: int) -> ModelNames:
    """A run's `--model` (a preset or a checkpoint directory of a known family), named."""
    presets = all_presets()
    if model in presets:
        label = ModelSource("preset", model, random_weights=True, seed=seed).label
        return ModelNames(label, True, presets[model].name)
    directory = Path(model)
    if not directory.is_dir():
        raise InputError(
            f"--model {model!r} is neither a preset ({', '.join(presets)}) nor a checkpoint directory"
        )
    label = ModelSource("checkpoint", str(directory.resolve()), random_weights=False).label
    return ModelNames(label, False, family_of_checkpoint(directory).name)


def attach_ground_truth(filelist: FileList, path: Path) -> tuple[FileList, dict[str, dict[str, Any]]]:
    """Each listed image's reference from an OmniDocBench annotation file, by file name. An image the
    annotation lacks becomes a bad line of the list (refused, or left out with --skip-invalid); a file
    that is not a valid annotation is an InputError."""
    from dsocr_workers.quality.omnidocbench import load_annotation, reference_for

    annotation = load_annotation(path)
    references: dict[str, dict[str, Any]] = {}
    missing: list[BadLine] = []
    for image in filelist.images:
        reference = reference_for(annotation, image.image)
        if reference is None:
            missing.append(BadLine(image.line, image.image, f"not in the ground truth {path}"))
        else:
            references[image.image] = reference.to_json()
    kept = [image for image in filelist.images if image.image in references]
    bad = sorted([*filelist.bad, *missing], key=lambda b: b.line)
    return replace(filelist, images=kept, bad=bad), references


def parse_tags(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    tags = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"--tag {pair!r}: expected key=value")
        tags[key] = value
    return tags


def record_run(
    db: Database,
    filelist: FileList,
    options: RunOptions,
    *,
    queue: str,
    name: str | None = None,
    tags: dict[str, str] | None = None,
    ground_truth: Path | None = None,
    references: dict[str, dict[str, Any]] | None = None,
) -> SubmittedRun:
    """Write the run and its jobs (state `pending`) in one transaction; with a ground truth, each job
    carries its page's reference (`attach_ground_truth`)."""
    check_queue_name(queue)
    if not filelist.images:
        raise InputError(f"{filelist.path}: no valid image in the file list")
    names = model_names(options.model, options.seed)
    options = replace(options, mode=run_mode(options.model, options.mode))
    run_id = uuid.uuid4().hex[:12]
    now = utcnow()
    jobs: list[dict[str, Any]] = [
        {
            "id": job_id_for(run_id, image.image, repeat),
            "run_id": run_id,
            "image": image.image,
            "line": image.line,
            "repeat": repeat,
            "state": "pending",
            "attempts": 0,
            "created_at": now,
            "reference": (references or {}).get(image.image),
        }
        for image in filelist.images
        for repeat in range(options.repeats)
    ]
    for ordinal, job in enumerate(jobs, start=1):  # file-list order: the N-th, 2N-th, ... job is profiled
        job["profile"] = options.profiles(ordinal)
    with db.transaction() as tx:
        tx.add(
            Run(
                id=run_id,
                name=name or filelist.path.stem,
                created_at=now,
                filelist=str(filelist.path.absolute()),
                root=str(filelist.root),
                model=options.model,
                model_label=names.label,
                random_weights=names.random_weights,
                model_family=names.family,
                queue=queue,
                parameters=options.parameters,
                tags=tags or {},
                ground_truth=None if ground_truth is None else str(ground_truth.absolute()),
            )
        )
        tx.flush()
        tx.execute(insert(Job), jobs)
    skipped = [f"line {b.line}: {b.text}: {b.reason}" for b in filelist.bad]
    return SubmittedRun(run_id, [j["id"] for j in jobs], queue, skipped=skipped)


@dataclass(frozen=True)
class RunRequest:
    """A run as `dsocr submit` and `dsocr run` are asked for one."""

    filelist: Path
    options: RunOptions
    root: Path | None = None  # None: the list's dataset source-data/, else its folder (farm/filelist.py)
    name: str | None = None  # None: the list's file name
    tags: tuple[str, ...] = ()  # KEY=VALUE
    ground_truth: Path | None = None  # an OmniDocBench annotation file: every page is scored against it
    skip_invalid: bool = False  # leave bad lines out instead of refusing the list


@dataclass(frozen=True)
class PreparedRun:
    """A checked file list and run options, ready to be recorded."""

    listed: FileList
    options: RunOptions
    name: str | None
    tags: dict[str, str]
    ground_truth: Path | None
    references: dict[str, dict[str, Any]]  # by image, with a ground truth

    def record(self, db: Database, queue: str) -> SubmittedRun:
        return record_run(
            db,
            self.listed,
            self.options,
            queue=queue,
            name=self.name,
            tags=self.tags,
            ground_truth=self.ground_truth,
            references=self.references,
        )


def prepare_run(request: RunRequest, on_bad_lines: Callable[[str], None]) -> PreparedRun:
    """Check the whole file list (with a ground truth, also that it has every page) before anything is
    recorded. Bad lines are described to `on_bad_lines`; then the list is refused (InputError) unless
    `skip_invalid` leaves them out."""
    tags = parse_tags(request.tags)
    # The model and its family's mode first: a list is read only for a run that can be made.
    options = replace(request.options, mode=run_mode(request.options.model, request.options.mode))
    listed = read_filelist(request.filelist, request.root)
    references: dict[str, dict[str, Any]] = {}
    if request.ground_truth is not None:
        listed, references = attach_ground_truth(listed, request.ground_truth)
    if listed.bad:
        on_bad_lines(f"{len(listed.bad)} bad line(s) in {request.filelist}:\n{listed.describe_bad()}")
        if not request.skip_invalid:
            raise InputError(
                f"{request.filelist}: refused, nothing was recorded or enqueued (--skip-invalid to leave them out)"
            )
    return PreparedRun(listed, options, request.name, tags, request.ground_truth, references)


@dataclass(frozen=True)
class Submission:
    run: SubmittedRun
    enqueued: int  # messages sent; fewer than the jobs only where the broker failed (then TransientError)


def submit_run(
    settings: Settings,
    request: RunRequest,
    *,
    queue: str | None,
    on_bad_lines: Callable[[str], None],
    on_recorded: Callable[[SubmittedRun], None],
) -> Submission:
    """`dsocr submit`: check the list, record the run and its jobs on `queue` (None: the settings'
    queue), then enqueue them. `on_recorded` hears of the run before the broker is tried: if it fails,
    the run is in the ledger and `dsocr reconcile` sends its jobs."""
    prepared = prepare_run(request, on_bad_lines)
    db = open_ledger(settings.database_url)
    run = prepared.record(db, queue or settings.queue)
    on_recorded(run)
    return Submission(run, enqueue(db, create_app(settings), [(job_id, run.queue) for job_id in run.job_ids]))


def enqueue(db: Database, app: Any, jobs: list[tuple[str, str]]) -> int:
    """Send one JSON message (the job id) per job, then mark them queued. Returns how many were sent;
    raises TransientError when the broker fails (the rest stay pending for `dsocr reconcile`)."""
    from kombu.exceptions import OperationalError

    with db.transaction() as tx:
        labels = job_labels(tx, [job_id for job_id, _ in jobs])
    sent: list[str] = []
    try:
        send_job_messages(app, jobs, sent, labels)
    except (OperationalError, OSError) as exc:
        raise TransientError(
            f"broker unavailable after sending {len(sent)} of {len(jobs)} jobs: {exc}; "
            "the rest are recorded as pending, run `dsocr reconcile` when the broker is back"
        ) from exc
    finally:
        with db.transaction() as tx:
            ledger.mark_queued(tx, sent)
    return len(sent)


def reconcile_and_enqueue(
    db: Database, app: Any, settings: Settings, *, run_id: str | None = None
) -> tuple[ledger.ReconcilePlan, int]:
    """Expire stale leases and reservations, then send a message for every open job that Redis holds none
    for; a delivered message whose holder just expired is put back at the head of its queue. Returns the
    plan and the messages sent or put back."""
    with db.transaction() as tx:
        plan = ledger.reconcile(tx, max_attempts=settings.max_attempts, run_id=run_id)
    try:
        waiting, delivered = job_ids_in_broker(
            settings.broker_url, settings.broker_key_prefix, (queue for _, queue in plan.requeue)
        )
    except (redis.RedisError, ValueError, KeyError, IndexError) as exc:
        raise TransientError(
            f"cannot read the broker's queues ({redacted(settings.broker_url)}): {exc}"
        ) from exc
    abandoned = [
        (job_id, queue)
        for job_id, queue in plan.requeue
        if job_id in plan.expired_ids and job_id not in waiting
    ]
    if abandoned:
        from kombu.exceptions import OperationalError

        try:
            with db.transaction() as tx:
                bring_back_job_messages(app, tx, abandoned)
        except (OperationalError, OSError, redis.RedisError) as exc:
            raise TransientError(
                f"broker unavailable while putting back {len(abandoned)} messages: {exc}"
            ) from exc
    held = waiting | delivered | plan.expired_ids
    sent = enqueue(db, app, [(job_id, queue) for job_id, queue in plan.requeue if job_id not in held])
    return plan, len(abandoned) + sent


def reconcile_run(settings: Settings, run_ref: str | None) -> tuple[ledger.ReconcilePlan, int]:
    """`dsocr reconcile`: `reconcile_and_enqueue` on the ledger of `settings`, for the run named by
    `run_ref` (id, unique prefix or latest; None: every run)."""
    db = open_ledger(settings.database_url)
    run_id = None
    if run_ref:
        with db.transaction() as tx:
            run_id = resolve_run(tx, run_ref).id
    return reconcile_and_enqueue(db, create_app(settings), settings, run_id=run_id)
