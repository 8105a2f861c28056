"""`dsocr report --run ID [--vs ID] [--per-image] [--include-cold] [--include-profiled] [--exclude-loops]
[--format …] [--table NAME] [--out FILE|DIR] [--html FILE]`, `dsocr export --run ID --omnidocbench DIR` and
`dsocr trace --job ID | --run ID --image NAME | --run ID --step N`."""

from __future__ import annotations

from pathlib import Path

import click

from dsocr_workers.cli import exits_on_errors, terminal_width


@click.command()
@click.option("--run", "run_ref", required=True, help="Run id, unique prefix, or latest (A with --vs).")
@click.option("--vs", "vs_ref", help="Compare with this run (B): side by side, B/A ratios, paired per image.")
@click.option("--per-image", is_flag=True, help="Add one row per image (and repeat).")
@click.option(
    "--include-cold",
    is_flag=True,
    help="Put cold results (compilation, new cache bucket, …) back into the statistics and throughput.",
)
@click.option(
    "--include-profiled",
    is_flag=True,
    help="Put profiled results (submit --profile: run under torch.profiler) back into the latency statistics.",
)
@click.option(
    "--exclude-loops",
    is_flag=True,
    help="Leave results whose output ends in a repetition loop out of the latency statistics.",
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "csv", "json", "md"]), default="table", show_default=True
)
@click.option("--out", type=click.Path(path_type=Path),
              help="Write here instead of stdout; with --format csv and no --table, a folder: one file per table.")
@click.option("--table", help="Only this table (its title, e.g. 'Per image'); csv holds one table.")
@click.option("--kernels", type=click.IntRange(min=1),
              help="Kernels shown per stage in the kernel tables, the longest first [default: 8] (a profile keeps "
                   "a stage's longest ones and sums the rest as '(other kernels)').")
@click.option("--width", type=int,
              help="Table width in characters (format table); default: the terminal's, or, piped or written to a "
                   "file, as wide as each table's content.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the report with its plots (stage breakdown, latency CDFs, decode ms/token by position, "
    "worker timeline, throughput over time) as one self-contained HTML file. Needs matplotlib "
    "(pip install 'dsocr-workers[report]').",
)
@exits_on_errors
def report(
    run_ref: str,
    vs_ref: str | None,
    per_image: bool,
    include_cold: bool,
    include_profiled: bool,
    exclude_loops: bool,
    fmt: str,
    out: Path | None,
    table: str | None,
    kernels: int | None,
    width: int | None,
    html_path: Path | None,
) -> None:
    """Latency (TTFT, prefill, vision stages, decode ms/token, e2e and the parts that add up to it) as mean
    and p50 / p90 / p99 with 95% confidence intervals, per-job memory, steady-state and wall-clock
    throughput, worker sessions, outputs and the environment of a run; with ground truth, accuracy per
    mode (OmniDocBench edit distances) beside latency; stop reasons and repetition loops; for runs
    submitted with --profile, the kernels per stage, the device's busy and idle time per stage and
    what the profiler cost. Cold results are left out of the latency statistics unless --include-cold,
    profiled ones unless --include-profiled, looping ones only with --exclude-loops. With --vs every B/A
    ratio carries an interval, and "no significant difference"
    where it contains 1; accuracy is compared as paired differences B-A. Runs on random weights are
    labelled as such."""
    from dsocr_workers.report.outputs import ReportRequest, write_report
    from dsocr_workers.settings import Settings

    request = ReportRequest(
        run=run_ref,
        vs=vs_ref,
        per_image=per_image,
        include_cold=include_cold,
        include_profiled=include_profiled,
        exclude_loops=exclude_loops,
        fmt=fmt,
        table=table,
        kernels=kernels,
        out=out,
        html=html_path,
        width=width or (terminal_width() if out is None else None),
    )
    text = write_report(Settings.from_env().database_url, request, on_written=wrote)
    if text is not None:
        click.echo(text, nl=False)


def wrote(path: Path) -> None:
    click.echo(f"wrote {path}", err=True)


@click.command()
@click.option("--run", "run_ref", required=True, help="Run id, unique prefix, or latest.")
@click.option("--omnidocbench", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Write one markdown file per page here, named as OmniDocBench's evaluator expects.")
@click.option("--repeat", type=int, default=0, show_default=True, help="Which repeat of each page to write.")
@exits_on_errors
def export(run_ref: str, directory: Path, repeat: int) -> None:
    """Write a run's outputs for OmniDocBench's own evaluator: for every page with a result, its
    markdown (the model's markup rendered as the vendor's result.mmd) in DIR/<image name without
    extension>.md. Point the evaluator's prediction folder (its end2end config) at DIR."""
    from dsocr_workers.report.export import export_predictions
    from dsocr_workers.settings import Settings

    export = export_predictions(Settings.from_env().database_url, run_ref, directory, repeat)
    click.echo(
        f"run {export.run_id}: wrote {len(export.files)} page(s) to {directory}"
        + (
            f"; {export.without_result} page(s) without a result have no file"
            if export.without_result
            else ""
        )
    )
    if export.random_note is not None:
        click.echo(f"WARNING: run {export.run_id} ran with RANDOM WEIGHTS: its pages are filler text, not OCR "
                   f"(said in {export.random_note})", err=True)


@click.command()
@click.option(
    "--job", "job_ref", help="The job: its id or a unique prefix (the report's --per-image shows them)."
)
@click.option("--run", "run_ref", help="Or the run (id, prefix or latest) with --image.")
@click.option("--image", help="With --run: the image, as the file list names it or its file name.")
@click.option(
    "--repeat", type=click.IntRange(min=0), help="With --image: which repeat (default: the profiled one)."
)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    help="Or, with --run, a batched run's profiled batch step: the engine's step index (where several "
    "workers' engines profiled one, the first to run).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write it (default dsocr-trace-<job id>.json.gz); a name not ending in .gz gets plain JSON.",
)
@exits_on_errors
def trace(
    job_ref: str | None,
    run_ref: str | None,
    image: str | None,
    repeat: int | None,
    step: int | None,
    out: Path | None,
) -> None:
    """Write a profiled job's or batch step's torch.profiler trace (runs submitted with --profile N) as
    Chrome trace JSON: open it in Perfetto (https://ui.perfetto.dev, "Open trace file"; the file stays in
    the browser) or chrome://tracing. A job's stages are the ranges dsocr::prefill, dsocr::vision/sam, ...,
    and its sampled decode steps dsocr::decode step N; a batch step is one range, dsocr::batched/prefill or
    dsocr::batched/decode."""
    from dsocr_workers.report.trace import TraceRequest, write_trace
    from dsocr_workers.settings import Settings

    written = write_trace(
        Settings.from_env().database_url,
        TraceRequest(job=job_ref, run=run_ref, image=image, repeat=repeat, step=step, out=out),
    )
    click.echo(f"{written.what}: wrote {written.path} ({written.bytes:,} bytes)")


def register(group: click.Group) -> None:
    group.add_command(report)
    group.add_command(export)
    group.add_command(trace)
