"""`dsocr submit | worker | flower | run | runs | status | reconcile | db upgrade`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dsocr_workers import settings
from dsocr_workers.cli import (
    LEDGER_AND_BROKER_HELP,
    F,
    counted,
    exits_on_errors,
    stdout_console,
    terminal_width,
)
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.variants import AUTO, ENGINE_CHOICES
from dsocr_workers.farm.run_options import PREFILLS
from dsocr_workers.model.config import DTYPES, TextDims
from dsocr_workers.model.families import all_modes, all_presets

LOGLEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # Celery's --loglevel

if TYPE_CHECKING:
    from rich.console import Group

    from dsocr_workers.farm.local_run import LocalRun
    from dsocr_workers.farm.submit import RunRequest
    from dsocr_workers.report.live import RunProgress
    from dsocr_workers.settings import Settings


def run_options(command: F) -> F:
    """The options that decide what a run computes, shared by `submit` and `run`."""
    options = [
        click.option(
            "--root",
            type=click.Path(file_okay=False, path_type=Path),
            help="Folder relative paths resolve against (default: the dataset's source-data/, "
            "else the list's folder).",
        ),
        click.option("--name", help="Run name (default: the list's file name)."),
        click.option(
            "--model",
            default="tiny",
            show_default=True,
            help=f"Preset ({', '.join(all_presets())}: RANDOM weights) or a checkpoint directory of "
            "DeepSeek-OCR or DeepSeek-OCR-2.",
        ),
        click.option(
            "--mode",
            type=click.Choice(all_modes()),
            default=None,
            help="Resolution mode of the model's family (default: its gundam). DeepSeek-OCR: tiny 512, "
            "small 640, base 1024, large 1280, gundam 1024 + 640-px tiles; DeepSeek-OCR-2: see "
            "docs/models.md.",
        ),
        click.option(
            "--max-new-tokens",
            type=int,
            help="Decode at most this many tokens. Default: no cap, until EOS or the model's position "
            f"ceiling ({TextDims.max_position_embeddings:,}); random weights (the presets) seldom emit "
            "EOS and decode to that ceiling.",
        ),
        click.option("--ignore-eos", is_flag=True, help="Keep decoding past EOS (fixed-length timing)."),
        click.option(
            "--stop-on-repetition",
            is_flag=True,
            help="End a decode once its output ends in a repetition loop (stop reason: repetition).",
        ),
        click.option(
            "--no-repeat-ngram-size",
            type=click.IntRange(min=0),
            default=DecodeOptions.no_repeat_ngram_size,
            show_default=True,
            help="Ban repeated n-grams of this size (the vendor's HF path: 20); 0: off.",
        ),
        click.option(
            "--ngram-window",
            type=click.IntRange(min=1),
            help="Search n-grams only in the last N generated tokens (vendor vLLM); default: all.",
        ),
        click.option("--repeats", type=int, default=1, show_default=True, help="Jobs per image."),
        click.option("--prompt", help="Prompt (default: the mode's document-to-markdown prompt)."),
        click.option(
            "--engine",
            type=click.Choice(ENGINE_CHOICES),
            default=AUTO,
            show_default=True,
            help="auto: fast on a GPU, eager (the numerical reference) on a CPU.",
        ),
        click.option("--dtype", type=click.Choice(DTYPES), help="Default: bfloat16 on GPU, float32 on CPU."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of preset weights."),
        click.option("--tag", "tags", multiple=True, metavar="KEY=VALUE", help="Label the run (repeatable)."),
        click.option(
            "--skip-invalid", is_flag=True, help="Leave bad lines out instead of refusing the list."
        ),
        click.option(
            "--ground-truth",
            type=click.Path(dir_okay=False, path_type=Path),
            help="OmniDocBench annotation file (OmniDocBench.json): score each page against it.",
        ),
        click.option(
            "--profile",
            "profile_every",
            type=click.IntRange(min=1),
            metavar="N",
            help="Run every N-th job (file-list order; N = --repeats: one repeat of each page) under "
            "torch.profiler: its trace (`dsocr trace`) and kernels per stage (the report) are stored "
            "with it; profiled jobs are left out of latency statistics unless --include-profiled. With "
            "--concurrency above 1: every N-th batch step of each kind (prefill, decode), left out of the "
            "step statistics.",
        ),
        click.option(
            "--concurrency",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Jobs of the run each worker GPU (or `dsocr run`) keeps in flight, decoded together by "
            "the batched engine; 1: one at a time (the batch-1 path).",
        ),
        click.option(
            "--prefill",
            type=click.Choice(PREFILLS),
            default="split",
            show_default=True,
            help="With --concurrency above 1: split, a page joining while more pages decode than wait is "
            "prefilled in two steps (its SAM, then the rest), so the pages decoding keep their pace; whole: "
            "every prefill in one launch (more inter-token latency; no limit of one part a step on joins).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run_request(filelist: Path, kw: dict[str, Any]) -> RunRequest:
    """The run that `run_options` ask for (RunOptions checks them)."""
    from dsocr_workers.farm.run_options import RunOptions
    from dsocr_workers.farm.submit import RunRequest

    options = RunOptions(
        model=kw["model"],
        mode=kw["mode"],
        prompt=kw["prompt"],
        max_new_tokens=kw["max_new_tokens"],
        ignore_eos=kw["ignore_eos"],
        engine=kw["engine"],
        dtype=kw["dtype"],
        repeats=kw["repeats"],
        seed=kw["seed"],
        stop_on_repetition=kw["stop_on_repetition"],
        no_repeat_ngram_size=kw["no_repeat_ngram_size"],
        ngram_window=kw["ngram_window"],
        profile_every=kw["profile_every"],
        concurrency=kw["concurrency"],
        prefill=kw["prefill"],
    )
    return RunRequest(
        filelist,
        options,
        root=kw["root"],
        name=kw["name"],
        tags=kw["tags"],
        ground_truth=kw["ground_truth"],
        skip_invalid=kw["skip_invalid"],
    )


def warn(text: str) -> None:
    click.echo(text, err=True)


@click.command(epilog=LEDGER_AND_BROKER_HELP)
@click.argument("filelist", type=click.Path(dir_okay=False, path_type=Path))
@run_options
@click.option("--queue", help="Queue to send the jobs to (default: DSOCR_QUEUE or dsocr).")
@exits_on_errors
def submit(filelist: Path, queue: str | None, **kw: Any) -> None:
    """Validate FILELIST, record a run and its jobs, and enqueue one job per image and repeat."""
    from dsocr_workers.farm.submit import submit_run
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import defer_ctrl_c_to_transaction_ends

    defer_ctrl_c_to_transaction_ends()  # Ctrl-C while sending: what was sent is still marked queued
    submission = submit_run(
        Settings.from_env(),
        run_request(filelist, kw),
        queue=queue,
        on_bad_lines=warn,
        on_recorded=lambda run: click.echo(f"run {run.run_id}: {counted(len(run.job_ids), 'job')} recorded"),
    )
    run = submission.run
    click.echo(f"run {run.run_id}: {counted(submission.enqueued, 'job')} enqueued on {run.queue}")
    click.echo("next:")
    click.echo(f"  dsocr worker --queue {run.queue}")
    click.echo(f"  dsocr status --run {run.run_id} --watch")
    click.echo(f"  dsocr report --run {run.run_id}")
    click.echo(run.run_id)


@click.command(epilog=LEDGER_AND_BROKER_HELP)
@click.option("--gpus", default="auto", show_default=True,
              help="auto (every GPU, else the CPU), all (every GPU), GPU indices like 0,1, or cpu (cpu,cpu: two "
                   "lanes on the CPU).")
@click.option("--queue", "queues", multiple=True, help="Queue(s) to consume (default: DSOCR_QUEUE or dsocr).")
@click.option("--loglevel", type=click.Choice(LOGLEVELS, case_sensitive=False), default="INFO", show_default=True)
@click.option("--warmup", default="auto", show_default=True,
              help="Modes to load and warm before the first job (e.g. gundam,base): auto = those of the runs "
                   "open on the queues (gundam if none); none = warm each run's mode before its first job.")
@click.option("--model", default="tiny", show_default=True,
              help="Model to warm at start when no run is open on the queues (then --engine, --dtype).")
@click.option("--engine", type=click.Choice(ENGINE_CHOICES), default=AUTO, show_default=True,
              help="With --model: auto is fast on a GPU, eager on a CPU.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="With --model: the token budget of the jobs to come (it sizes the KV cache warmed).")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --model: the jobs in flight per GPU of the runs to come (`dsocr submit --concurrency`); "
                   "above 1 each child starts its batched engine before its first job, from the artifacts "
                   "`dsocr precompile --concurrency` built.")
@click.option("--prefill", type=click.Choice(PREFILLS), default="split", show_default=True,
              help="With --model and --concurrency above 1: the runs' prefills (`dsocr submit --prefill`), the "
                   "batched engine started with them.")
@click.option("--events", is_flag=True,
              help="Show this worker and its jobs in Flower (`dsocr flower`): send task events and heartbeats, "
                   "answer inspection.")
@exits_on_errors
def worker(
    gpus: str, queues: tuple[str, ...], loglevel: str, warmup: str, model: str,
    engine: str, dtype: str | None, max_new_tokens: int | None, concurrency: int, prefill: str,
    events: bool,
) -> None:
    """Run jobs from the queue: one prefork child per device, each loading and warming its model before
    it takes a job (the cost is stored per worker process, never in a job).

    Settings come from the environment (DSOCR_DATABASE_URL, DSOCR_BROKER_URL, …). SIGTERM finishes the
    current jobs and stops; a job cut short is delivered again and resumed from the ledger."""
    from dsocr_workers.farm.celery.worker import start_worker
    from dsocr_workers.farm.devices import parse_devices
    from dsocr_workers.farm.run_options import RunOptions
    from dsocr_workers.settings import Settings

    # The runs to come, checked as a submitted run's options are (exit 2 on a bad one).
    fallback = RunOptions(model=model, engine=engine, dtype=dtype, max_new_tokens=max_new_tokens,
                          concurrency=concurrency, prefill=prefill)  # fmt: skip
    start_worker(
        Settings.from_env(),
        parse_devices(gpus),
        queues=queues,
        loglevel=loglevel,
        warmup=warmup,
        fallback=fallback,
        events=events,
    )


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", type=int, default=5555, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Interface to listen on; 0.0.0.0 for every one (then set --basic-auth).")
@click.option("--basic-auth", metavar="USER:PASSWORD", envvar=settings.FLOWER_BASIC_AUTH.name,
              help="Ask for this login (env DSOCR_FLOWER_BASIC_AUTH; empty: none).")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@exits_on_errors
def flower(port: int, address: str, basic_auth: str | None, flower_args: tuple[str, ...]) -> None:
    """Celery Flower, the web monitor, on this farm's broker (DSOCR_BROKER_URL and its key prefix):
    workers started with `dsocr worker --events`, their jobs (job id; run, image and repeat as the task's
    keyword arguments), queue lengths. Extra arguments go to Flower, e.g. --url-prefix=flower. Flower
    serves its control API (shutdown, pool resize, revoke) only with authentication set; resize no pool
    from it: a grown pool puts two children on one GPU."""
    from dsocr_workers.farm.celery.app import start_flower
    from dsocr_workers.settings import Settings

    start_flower(
        Settings.from_env(), port=port, address=address, basic_auth=basic_auth, flower_args=flower_args
    )


FORMAT_OPTION = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "md"]),
    default="table",
    show_default=True,
    help="Format of the closing report (csv, one table per file: dsocr report --format csv).",
)
INTERRUPTED_EXIT = 130  # a shell's status for a command ended by Ctrl-C (SIGINT)


@click.command()
@click.argument("filelist", type=click.Path(dir_okay=False, path_type=Path))
@run_options
@click.option("--gpus", default="auto", show_default=True,
              help="auto (the first GPU, else the CPU), one GPU index, or cpu.")
@click.option("--queue", default=None,
              help="Queue name to record the run under (default: in-process). Name a worker queue to let "
                   "its workers take over the jobs this process leaves behind if it dies.")
@FORMAT_OPTION
@exits_on_errors
def run(filelist: Path, gpus: str, queue: str | None, fmt: str, **kw: Any) -> None:
    """Submit FILELIST and run it here, without Redis (the embedded default: SQLite), then report. With
    --concurrency N, N jobs at a time on the batched engine, as a worker runs them.

    Ctrl-C hands back the jobs in flight (queued again, their attempts not counted), marks the run
    interrupted and prints the command that runs the rest: `dsocr resume RUN`.

    Exit status: 0 every job done; 4 some job failed or was poisoned (the report is printed first, then
    which); 2 bad input or settings; 3 the database unavailable; 130 interrupted."""
    from dsocr_workers.farm.local_run import record_local_run
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import defer_ctrl_c_to_transaction_ends

    defer_ctrl_c_to_transaction_ends()  # Ctrl-C hands the jobs back: their ledger is left writable
    settings = Settings.from_env()
    try:
        local = record_local_run(settings, run_request(filelist, kw), gpus=gpus, queue=queue, on_bad_lines=warn)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT)
    work_and_report(settings, local, fmt)


@click.command()
@click.argument("run_ref", metavar="RUN")
@click.option("--gpus", default="auto", show_default=True,
              help="auto (the first GPU, else the CPU), one GPU index, or cpu.")
@FORMAT_OPTION
@exits_on_errors
def resume(run_ref: str, gpus: str, fmt: str) -> None:
    """Run the jobs of RUN (id, unique prefix or latest) that are not final here, as `dsocr run` does,
    then report: the rest of an interrupted `dsocr run`, with the run's own options.

    Exit status as `dsocr run`'s."""
    from dsocr_workers.farm.local_run import resume_local_run
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import defer_ctrl_c_to_transaction_ends

    defer_ctrl_c_to_transaction_ends()
    settings = Settings.from_env()
    work_and_report(settings, resume_local_run(settings, run_ref, gpus=gpus), fmt)


def work_and_report(settings: Settings, local: LocalRun, fmt: str) -> None:
    """`dsocr run` and `resume` once the run is recorded: its jobs here with a progress bar, then the report
    (FailuresError after it if a job failed). Interrupted: the run marked so, the way to resume printed,
    exit 130."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dsocr_workers.farm.local_run import mark_interrupted, raise_for_failures, work_local_run
    from dsocr_workers.report.outputs import ReportRequest, write_report
    from dsocr_workers.store.models import FINAL_STATES

    run_id = local.run.run_id
    try:
        click.echo(f"run {run_id}: {counted(len(local.run.job_ids), 'job')} on {local.device}", err=True)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[last]}"),
            console=stdout_console(stderr=True),
        ) as progress:
            bar = progress.add_task(f"run {run_id}", total=len(local.run.job_ids), last="")
            finals = work_local_run(
                settings,
                local,
                on_final=lambda outcome: progress.update(
                    bar, advance=1, last=f"{outcome.status} {outcome.detail}"[:60]
                ),
            )
        report = write_report(settings.database_url, ReportRequest(run_id, fmt=fmt, width=terminal_width()))
    except KeyboardInterrupt:
        counts = mark_interrupted(local)
        open_jobs = sum(count for state, count in counts.items() if state not in FINAL_STATES)
        if open_jobs:
            click.echo(f"run {run_id}: interrupted; {open_jobs} of {counts.total()} jobs not final, "
                       "handed back. To run them:", err=True)  # fmt: skip
            click.echo(f"  dsocr resume {run_id}", err=True)
        else:
            click.echo(f"run {run_id}: interrupted after its last job; its report: dsocr report --run {run_id}",
                       err=True)  # fmt: skip
        sys.exit(INTERRUPTED_EXIT)
    click.echo(report, nl=False)
    raise_for_failures(local, finals)


@click.command()
@click.option("--limit", type=int, default=20, show_default=True)
@exits_on_errors
def runs(limit: int) -> None:
    """List the newest runs with their job counts."""
    from rich.table import Table

    from dsocr_workers.report.queries import list_runs
    from dsocr_workers.settings import Settings

    table = Table("run", "created", "name", "model", "jobs", "done", "failed", "poisoned", "open")
    for s in list_runs(Settings.from_env().database_url, limit):
        table.add_row(
            s.run.id,
            s.run.created_at.isoformat(sep=" ", timespec="seconds"),
            s.run.name,
            s.run.model_label,
            str(sum(s.counts.values())),
            str(s.counts.get("done", 0)),
            str(s.counts.get("failed", 0)),
            str(s.counts.get("poisoned", 0)),
            str(s.open_jobs),
        )
    stdout_console().print(table)


@click.command()
@click.option("--run", "run_ref", required=True, help="Run id, unique prefix, or latest.")
@click.option("--watch", is_flag=True, help="Follow the run until every job is final.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between polls.")
@exits_on_errors
def status(run_ref: str, watch: bool, interval: float) -> None:
    """Progress of a run: job states, the worker processes on its queue (live while they heartbeat, with
    the job each holds and how many it finished), and an ETA from the live workers' pace."""
    from rich.live import Live

    from dsocr_workers.report.live import follow_progress
    from dsocr_workers.settings import Settings

    settings = Settings.from_env()
    snapshots = follow_progress(settings.database_url, run_ref, settings.lease_s, interval if watch else None)
    console = stdout_console()
    first = progress_view(next(snapshots))
    if not watch:
        console.print(first)
        return
    with Live(first, console=console, auto_refresh=False) as live:
        for progress in snapshots:
            live.update(progress_view(progress), refresh=True)


def progress_view(progress: RunProgress) -> Group:
    """`dsocr status`: a head line with the ETA, a bar, the job states, and the run's workers."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    if progress.eta_s is not None:
        pace = f"ETA {progress.eta_s:.0f} s at {progress.pages_per_s:.2f} pages/s"
    elif progress.finished:
        pace = "finished"
    elif progress.interrupted:
        pace = f"interrupted: its jobs were handed back; `dsocr resume {progress.run_id}` runs the rest"
    elif not progress.live_workers:
        pace = f"ETA - (no live worker on queue {progress.queue})"
    else:
        pace = "ETA - (no job of this run finished yet)"
    head = (
        f"run {progress.run_id}: {progress.final}/{progress.total} final  "
        f"{progress.live_workers} live worker(s)  {pace}"
    )
    states = "  ".join(
        f"{s} {progress.counts.get(s, 0)}"
        for s in ("pending", "queued", "running", "done", "failed", "poisoned")
    )
    workers = Table("worker", "device", "state", "last beat", "job now", "done", "s/job", title="workers")
    for w in progress.workers:
        state = "live" if w.live else "stopped" if w.stopped else "silent (dead: its jobs are requeued)"
        workers.add_row(
            w.id,
            w.device,
            state,
            f"{w.heartbeat_age_s:.0f} s ago",
            w.current_image or "-",
            str(w.jobs_done),
            "-" if w.job_s is None else f"{w.job_s:.2f}",
        )
    bar = Table.grid()  # a row of its own: a bare ProgressBar ends without a line break
    bar.add_row(ProgressBar(total=max(progress.total, 1), completed=progress.final, width=60))
    parts: list[Any] = [Text(head), bar, Text(states)]
    if progress.workers:
        parts.append(workers)
    return Group(*parts)


@click.command()
@click.option("--run", "run_ref", help="Only this run (id, prefix or latest); default: every run.")
@exits_on_errors
def reconcile(run_ref: str | None) -> None:
    """Expire stale leases (poisoning jobs at the attempt cap) and enqueue every job not final."""
    from dsocr_workers.farm.submit import reconcile_run
    from dsocr_workers.settings import Settings

    plan, sent = reconcile_run(Settings.from_env(), run_ref)
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
    from dsocr_workers.settings import Settings, redacted
    from dsocr_workers.store.db import open_database
    from dsocr_workers.store.db import upgrade as upgrade_schema

    database = open_database(Settings.from_env().database_url)
    revision = upgrade_schema(database)
    click.echo(f"{redacted(database.url)}: schema at revision {revision}")


def register(group: click.Group) -> None:
    for command in (submit, worker, flower, run, resume, runs, status, reconcile, db):
        group.add_command(command)
