"""`dsocr submit | worker | flower | run | runs | status | reconcile | db upgrade`."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dsocr_workers.cli import F, exits_on_errors, stdout_console
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.model.config import DTYPES, ENGINES, MODES


def run_options(command: F) -> F:
    """The options that decide what a run computes, shared by `submit` and `run`."""
    options = [
        click.option("--root", type=click.Path(file_okay=False, path_type=Path),
                     help="Folder relative paths resolve against (default: the dataset's source-data/, "
                     "else the list's folder)."),
        click.option("--name", help="Run name (default: the list's file name)."),
        click.option("--model", default="tiny", show_default=True,
                     help="Preset (tiny, full: RANDOM weights) or a checkpoint directory."),
        click.option("--mode", type=click.Choice(tuple(MODES)), default="gundam", show_default=True,
                     help="Resolution mode (tiny 512, small 640, base 1024, large 1280; gundam: 1024 + 640 tiles)."),
        click.option("--max-new-tokens", type=int, help="Decode at most this many tokens."),
        click.option("--ignore-eos", is_flag=True, help="Keep decoding past EOS (fixed-length timing)."),
        click.option("--stop-on-repetition", is_flag=True,
                     help="End a decode once its output ends in a repetition loop (stop reason: repetition)."),
        click.option("--no-repeat-ngram-size", type=click.IntRange(min=0),
                     default=DecodeOptions.no_repeat_ngram_size, show_default=True,
                     help="Ban repeated n-grams of this size (the vendor's HF path: 20); 0: off."),
        click.option("--ngram-window", type=click.IntRange(min=1),
                     help="Search n-grams only in the last N generated tokens (vendor vLLM); default: all."),
        click.option("--repeats", type=int, default=1, show_default=True, help="Jobs per image."),
        click.option("--prompt", help="Prompt (default: the mode's document-to-markdown prompt)."),
        click.option("--engine", type=click.Choice(ENGINES), default="eager", show_default=True),
        click.option("--dtype", type=click.Choice(DTYPES),
                     help="Default: bfloat16 on GPU, float32 on CPU."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of preset weights."),
        click.option("--tag", "tags", multiple=True, metavar="KEY=VALUE", help="Label the run (repeatable)."),
        click.option("--skip-invalid", is_flag=True, help="Leave bad lines out instead of refusing the list."),
        click.option("--ground-truth", type=click.Path(dir_okay=False, path_type=Path),
                     help="OmniDocBench annotation file (OmniDocBench.json): score each page against it."),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


@dataclass(frozen=True)
class PreparedRun:
    """A checked file list and run options, ready to be recorded."""

    listed: Any  # farm.filelist.FileList
    options: Any  # farm.submit.RunOptions
    name: str | None
    tags: dict[str, str]
    ground_truth: Path | None
    references: dict[str, dict[str, Any]]  # by image, with --ground-truth

    def record(self, db: Any, queue: str) -> Any:
        from dsocr_workers.farm.submit import record_run

        return record_run(db, self.listed, self.options, queue=queue, name=self.name, tags=self.tags,
                          ground_truth=self.ground_truth, references=self.references)  # fmt: skip


def _prepare(filelist: Path, kw: dict[str, Any]) -> PreparedRun:
    from dsocr_workers.errors import InputError
    from dsocr_workers.farm.filelist import read_filelist
    from dsocr_workers.farm.submit import RunOptions, attach_ground_truth, parse_tags

    options = RunOptions(
        model=kw["model"], mode=kw["mode"], prompt=kw["prompt"], max_new_tokens=kw["max_new_tokens"],
        ignore_eos=kw["ignore_eos"], engine=kw["engine"], dtype=kw["dtype"], repeats=kw["repeats"], seed=kw["seed"],
        stop_on_repetition=kw["stop_on_repetition"], no_repeat_ngram_size=kw["no_repeat_ngram_size"],
        ngram_window=kw["ngram_window"],
    )  # fmt: skip
    tags = parse_tags(kw["tags"])
    listed = read_filelist(filelist, kw["root"])
    references: dict[str, dict[str, Any]] = {}
    if kw["ground_truth"] is not None:
        listed, references = attach_ground_truth(listed, kw["ground_truth"])
    if listed.bad:
        click.echo(f"{len(listed.bad)} bad line(s) in {filelist}:\n{listed.describe_bad()}", err=True)
        if not kw["skip_invalid"]:
            raise InputError(
                f"{filelist}: refused, nothing was recorded or enqueued (--skip-invalid to leave them out)"
            )
    return PreparedRun(listed, options, kw["name"], tags, kw["ground_truth"], references)


@click.command()
@click.argument("filelist", type=click.Path(dir_okay=False, path_type=Path))
@run_options
@click.option("--queue", help="Queue to send the jobs to (default: DSOCR_QUEUE or dsocr).")
@exits_on_errors
def submit(filelist: Path, queue: str | None, **kw: Any) -> None:
    """Validate FILELIST, record a run and its jobs, and enqueue one job per image and repeat."""
    from dsocr_workers.farm.celery_app import create_app
    from dsocr_workers.farm.submit import enqueue
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import check_schema, open_database

    settings = Settings.from_env()
    prepared = _prepare(filelist, kw)
    db = open_database(settings.database_url)
    check_schema(db)
    run = prepared.record(db, queue or settings.queue)
    click.echo(f"run {run.run_id}: {len(run.job_ids)} jobs recorded")
    sent = enqueue(db, create_app(settings), [(job_id, run.queue) for job_id in run.job_ids])
    click.echo(f"run {run.run_id}: {sent} jobs enqueued on {run.queue}")
    click.echo("next:")
    click.echo(f"  dsocr worker --queue {run.queue}")
    click.echo(f"  dsocr status --run {run.run_id} --watch")
    click.echo(f"  dsocr report --run {run.run_id}")
    click.echo(run.run_id)


@click.command()
@click.option("--gpus", default="auto", show_default=True,
              help="auto (every GPU, else the CPU), all (every GPU), GPU indices like 0,1, or cpu.")
@click.option("--queue", "queues", multiple=True, help="Queue(s) to consume (default: DSOCR_QUEUE or dsocr).")
@click.option("--concurrency-per-device", type=int, default=1, show_default=True,
              help="Children per device (1 for profiling; more only for tests on CPU).")  # fmt: skip
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--warmup", default="auto", show_default=True,
              help="Modes to load and warm before the first job (e.g. gundam,base): auto = those of the runs "
                   "open on the queues (gundam if none); none = warm each run's mode before its first job.")
@click.option("--model", default="tiny", show_default=True,
              help="Model to warm at start when no run is open on the queues (then --engine, --dtype).")
@click.option("--engine", type=click.Choice(ENGINES), default="eager", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="With --model: the token budget of the jobs to come (it sizes the KV cache warmed).")
@click.option("--events", is_flag=True,
              help="Show this worker and its jobs in Flower (`dsocr flower`): send task events and heartbeats, "
                   "answer inspection.")
@exits_on_errors
def worker(
    gpus: str, queues: tuple[str, ...], concurrency_per_device: int, loglevel: str, warmup: str, model: str,
    engine: str, dtype: str | None, max_new_tokens: int | None, events: bool,
) -> None:
    """Run jobs from the queue: one prefork child per device, each loading and warming its model before
    it takes a job (the cost is stored per worker process, never in a job).

    Settings come from the environment (DSOCR_DATABASE_URL, DSOCR_BROKER_URL, …). SIGTERM finishes the
    current jobs and stops; a job cut short is delivered again and resumed from the ledger."""
    from dsocr_workers.farm.warm import ModelKey
    from dsocr_workers.farm.worker import parse_devices, start_worker
    from dsocr_workers.settings import Settings

    start_worker(
        Settings.from_env(), parse_devices(gpus), concurrency_per_device=concurrency_per_device,
        queues=queues, loglevel=loglevel, warmup=warmup, fallback_model=ModelKey(model, engine, dtype),
        fallback_budget=max_new_tokens, events=events,
    )  # fmt: skip


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", type=int, default=5555, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Interface to listen on; 0.0.0.0 for every one (then set --basic-auth).")
@click.option("--basic-auth", metavar="USER:PASSWORD", envvar="DSOCR_FLOWER_BASIC_AUTH",
              help="Ask for this login (env DSOCR_FLOWER_BASIC_AUTH; empty: none).")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@exits_on_errors
def flower(port: int, address: str, basic_auth: str | None, flower_args: tuple[str, ...]) -> None:
    """Celery Flower, the web monitor, on this farm's broker (DSOCR_BROKER_URL and its key prefix):
    workers started with `dsocr worker --events`, their jobs (job id; run, image and repeat as the task's
    keyword arguments), queue lengths. Extra arguments go to Flower, e.g. --url-prefix=flower. Flower
    serves its control API (shutdown, pool resize, revoke) only with authentication set; resize no pool
    from it: a grown pool puts two children on one GPU."""
    from importlib.util import find_spec

    from dsocr_workers.errors import InputError
    from dsocr_workers.farm.celery_app import create_app
    from dsocr_workers.settings import Settings

    if find_spec("flower") is None:
        raise InputError("dsocr flower needs Flower: pip install 'dsocr-workers[flower]'")
    app = create_app(Settings.from_env())
    # Flower is a `celery` subcommand (an entry point it installs); `start` runs it with this app.
    login = [f"--basic-auth={basic_auth}"] if basic_auth else []
    app.start(["flower", f"--port={port}", f"--address={address}", *login, *flower_args])


@click.command()
@click.argument("filelist", type=click.Path(dir_okay=False, path_type=Path))
@run_options
@click.option("--gpus", default="cpu", show_default=True, help="cpu or one GPU index.")
@click.option("--queue", default=None,
              help="Queue name to record the run under (default: in-process). Name a worker queue to let "
                   "its workers take over the jobs this process leaves behind if it dies.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "md"]), default="table", show_default=True,
              help="Format of the closing report (csv, one table per file: dsocr report --format csv).")  # fmt: skip
@exits_on_errors
def run(filelist: Path, gpus: str, queue: str | None, fmt: str, **kw: Any) -> None:
    """Submit FILELIST and run it here, without Redis (the embedded default: SQLite), then report.

    Exit status: 0 every job done; 4 some job failed or was poisoned (the report is printed first, then
    which); 2 bad input or settings; 3 the database unavailable."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from sqlalchemy import select

    from dsocr_workers.errors import FailuresError, InputError
    from dsocr_workers.farm.worker import IN_PROCESS_QUEUE, parse_devices, run_in_process
    from dsocr_workers.report.build import single_report
    from dsocr_workers.report.queries import load_run
    from dsocr_workers.report.render import render
    from dsocr_workers.settings import Settings, check_queue_name
    from dsocr_workers.store.db import check_schema, open_database, upgrade
    from dsocr_workers.store.models import Job

    devices = parse_devices(gpus)
    if len(devices) != 1:
        raise InputError("dsocr run uses one device; start `dsocr worker` for several")
    settings = Settings.from_env()
    prepared = _prepare(filelist, kw)
    db = open_database(settings.database_url)
    if db.is_sqlite:
        upgrade(db)  # the embedded default creates or updates its own file
    check_schema(db)
    submitted = prepared.record(db, check_queue_name(queue) if queue else IN_PROCESS_QUEUE)
    click.echo(f"run {submitted.run_id}: {len(submitted.job_ids)} jobs on {devices[0]}", err=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[last]}"), console=stdout_console(stderr=True),
    ) as progress:  # fmt: skip
        bar = progress.add_task(f"run {submitted.run_id}", total=len(submitted.job_ids), last="")

        def advance(outcome: Any) -> None:
            if outcome.status not in ("queued", "released"):
                progress.update(bar, advance=1, last=f"{outcome.status} {outcome.detail}"[:60])

        finals = run_in_process(settings, devices[0], submitted.job_ids, advance, queue=submitted.queue)
    with db.transaction() as session:
        click.echo(render(single_report(load_run(session, submitted.run_id)), fmt), nl=False)
    failures = [outcome for outcome in finals if outcome.status != "done"]
    if failures:
        # The report is out, but a script must not mistake a run with failed jobs for a good one.
        with db.transaction() as session:
            images = dict(session.execute(select(Job.id, Job.image).where(Job.id.in_([o.job_id for o in failures]))).all())
        counts = ", ".join(f"{count} {status}" for status, count in Counter(o.status for o in failures).items())
        which = "; ".join(f"{images.get(o.job_id, o.job_id)}: {o.status} ({o.detail})" for o in failures[:10])
        more = f"; and {len(failures) - 10} more" if len(failures) > 10 else ""
        raise FailuresError(f"run {submitted.run_id}: {counts} of {len(submitted.job_ids)} jobs: {which}{more}")


@click.command()
@click.option("--limit", type=int, default=20, show_default=True)
@exits_on_errors
def runs(limit: int) -> None:
    """List the newest runs with their job counts."""
    from rich.table import Table

    from dsocr_workers.report.queries import list_runs

    with _database().transaction() as session:
        summaries = list_runs(session, limit)
    table = Table("run", "created", "name", "model", "jobs", "done", "failed", "poisoned", "open")
    for s in summaries:
        open_jobs = sum(s.counts.get(k, 0) for k in ("pending", "queued", "running"))
        table.add_row(
            s.run.id, s.run.created_at.isoformat(sep=" ", timespec="seconds"), s.run.name, s.run.model_label,
            str(sum(s.counts.values())), str(s.counts.get("done", 0)), str(s.counts.get("failed", 0)),
            str(s.counts.get("poisoned", 0)), str(open_jobs),
        )  # fmt: skip
    stdout_console().print(table)


def _database() -> Any:
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import open_database

    return open_database(Settings.from_env().database_url)


@click.command()
@click.option("--run", "run_ref", required=True, help="Run id, unique prefix, or latest.")
@click.option("--watch", is_flag=True, help="Follow the run until every job is final.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between polls.")
@exits_on_errors
def status(run_ref: str, watch: bool, interval: float) -> None:
    """Progress of a run: job states, the worker processes on its queue (live while they heartbeat, with
    the job each holds and how many it finished), and an ETA from the live workers' pace."""
    from rich.console import Group
    from rich.live import Live
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    from dsocr_workers.report.live import run_progress
    from dsocr_workers.report.queries import resolve_run
    from dsocr_workers.settings import Settings

    settings = Settings.from_env()
    db = _database()

    def view() -> tuple[Group, bool]:
        with db.transaction() as session:
            progress = run_progress(session, resolve_run(session, run_ref), settings.lease_s)
        if progress.eta_s is not None:
            pace = f"ETA {progress.eta_s:.0f} s at {progress.pages_per_s:.2f} pages/s"
        elif progress.final == progress.total:
            pace = "finished"
        elif not progress.live_workers:
            pace = f"ETA - (no live worker on queue {progress.queue})"
        else:
            pace = "ETA - (no job of this run finished yet)"
        head = (
            f"run {progress.run_id}: {progress.final}/{progress.total} final  "
            f"{progress.live_workers} live worker(s)  {pace}"
        )
        states = "  ".join(
            f"{s} {progress.counts.get(s, 0)}" for s in ("pending", "queued", "running", "done", "failed", "poisoned")
        )  # fmt: skip
        workers = Table("worker", "device", "state", "last beat", "job now", "done", "s/job", title="workers")
        for w in progress.workers:
            state = "live" if w.live else "stopped" if w.stopped else "silent (dead: its jobs are requeued)"
            workers.add_row(
                w.id, w.device, state, f"{w.heartbeat_age_s:.0f} s ago", w.current_image or "-", str(w.jobs_done),
                "-" if w.job_s is None else f"{w.job_s:.2f}",
            )  # fmt: skip
        bar = Table.grid()  # a row of its own: a bare ProgressBar ends without a line break
        bar.add_row(ProgressBar(total=max(progress.total, 1), completed=progress.final, width=60))
        parts: list[Any] = [Text(head), bar, Text(states)]
        if progress.workers:
            parts.append(workers)
        return Group(*parts), progress.final == progress.total

    console = stdout_console()
    rendered, finished = view()
    if not watch:
        console.print(rendered)
        return
    with Live(rendered, console=console, auto_refresh=False) as live:
        while not finished:
            time.sleep(interval)
            rendered, finished = view()
            live.update(rendered, refresh=True)


@click.command()
@click.option("--run", "run_ref", help="Only this run (id, prefix or latest); default: every run.")
@exits_on_errors
def reconcile(run_ref: str | None) -> None:
    """Expire stale leases (poisoning jobs at the attempt cap) and enqueue every job not final."""
    from dsocr_workers.farm.celery_app import create_app
    from dsocr_workers.farm.submit import reconcile_and_enqueue
    from dsocr_workers.report.queries import resolve_run
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import check_schema, open_database

    settings = Settings.from_env()
    db = open_database(settings.database_url)
    check_schema(db)
    run_id = None
    if run_ref:
        with db.transaction() as session:
            run_id = resolve_run(session, run_ref).id
    plan, sent = reconcile_and_enqueue(db, create_app(settings), settings, run_id=run_id)
    click.echo(
        f"expired leases: {plan.expired} (poisoned at the cap: {plan.poisoned}); still running: {plan.running}; "
        f"enqueued: {sent}"
    )


@click.group()
def db() -> None:
    """The ledger's schema."""


@db.command()
@exits_on_errors
def upgrade() -> None:
    """Create or migrate the schema of DSOCR_DATABASE_URL to the newest revision."""
    from dsocr_workers.settings import redacted
    from dsocr_workers.store.db import upgrade as upgrade_schema

    database = _database()
    revision = upgrade_schema(database)
    click.echo(f"{redacted(database.url)}: schema at revision {revision}")


def register(group: click.Group) -> None:
    for command in (submit, worker, flower, run, runs, status, reconcile, db):
        group.add_command(command)
