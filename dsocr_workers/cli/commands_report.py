"""`dsocr report --run ID [--vs ID] [--per-image] [--include-cold] [--exclude-loops] [--format …] [--table NAME]
[--out FILE|DIR] [--html FILE]` and `dsocr export --run ID --omnidocbench DIR`."""

from __future__ import annotations

from pathlib import Path

import click

from dsocr_workers.cli import exits_on_errors


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
@click.option("--width", type=int, help="Table width in characters (format table).")
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
    exclude_loops: bool,
    fmt: str,
    out: Path | None,
    table: str | None,
    width: int | None,
    html_path: Path | None,
) -> None:
    """Latency (TTFT, prefill, vision stages, decode ms/token, e2e and the parts that add up to it) as mean
    and p50 / p90 / p99 with 95% confidence intervals, per-job memory, steady-state and wall-clock
    throughput, worker sessions, outputs and the environment of a run; with ground truth, accuracy per
    mode (OmniDocBench edit distances) beside latency; stop reasons and repetition loops. Cold results
    are left out of the latency statistics unless --include-cold, looping ones only with
    --exclude-loops. With --vs every B/A ratio carries an interval, and "no significant difference"
    where it contains 1; accuracy is compared as paired differences B-A. Runs on random weights are
    labelled as such."""
    from dsocr_workers.errors import InputError
    from dsocr_workers.report.build import comparison_report, single_report
    from dsocr_workers.report.queries import load_run
    from dsocr_workers.report.render import only_table, render, write_csv_tables
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import open_database

    if html_path is not None:  # before the ledger is read: a missing extra is the user's first news
        try:
            from dsocr_workers.report.html import html_report
            from dsocr_workers.report.plots import sides_of
        except ModuleNotFoundError as exc:
            package = (exc.name or "matplotlib").partition(".")[0]
            raise InputError(f"--html needs {package}: pip install 'dsocr-workers[report]'") from exc
    db = open_database(Settings.from_env().database_url)
    with db.transaction() as session:
        a = load_run(session, run_ref)
        b = load_run(session, vs_ref) if vs_ref else None
        if b is not None:
            document = comparison_report(a, b, per_image=per_image, include_cold=include_cold,
                                         exclude_loops=exclude_loops)  # fmt: skip
        else:
            document = single_report(a, per_image=per_image, include_cold=include_cold, exclude_loops=exclude_loops)
    if html_path is not None:
        sides = sides_of(a, b) if b is not None else sides_of(a)
        html_path.write_text(html_report(document, sides, include_cold=include_cold), encoding="utf-8")
        click.echo(f"wrote {html_path}", err=True)
    if table is not None:
        document = only_table(document, table)
    if fmt == "csv" and out is not None and len(document.tables) > 1:
        for path in write_csv_tables(document, out):
            click.echo(f"wrote {path}", err=True)
        return
    text = render(document, fmt, width=width)
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        click.echo(f"wrote {out}", err=True)


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
    from dsocr_workers.errors import InputError
    from dsocr_workers.model.postprocess import render_mmd
    from dsocr_workers.quality.omnidocbench import write_predictions
    from dsocr_workers.report.queries import load_run
    from dsocr_workers.settings import Settings
    from dsocr_workers.store.db import open_database

    db = open_database(Settings.from_env().database_url)
    with db.transaction() as session:
        data = load_run(session, run_ref)
    if not any(j.repeat == repeat for j in data.jobs):
        raise InputError(f"run {data.run.id} has no repeat {repeat}")
    pages = {j.image: render_mmd(data.results[j.id].markup)
             for j in data.jobs if j.repeat == repeat and j.id in data.results}  # fmt: skip
    written = write_predictions(pages, directory)
    missing = sum(j.repeat == repeat for j in data.jobs) - len(written)
    click.echo(f"run {data.run.id}: wrote {len(written)} page(s) to {directory}"
               + (f"; {missing} page(s) without a result have no file" if missing else ""))  # fmt: skip


def register(group: click.Group) -> None:
    group.add_command(report)
    group.add_command(export)
