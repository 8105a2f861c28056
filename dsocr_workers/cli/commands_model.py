"""`dsocr infer`, `dsocr verify` and `dsocr model save-preset`: one page through the engine, the
engine's self-checks, and random-weight presets written as checkpoint directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dsocr_workers import settings
from dsocr_workers.cli import exits_on_errors, stdout_console
from dsocr_workers.engine.variants import AUTO, ENGINE_CHOICES
from dsocr_workers.errors import FailuresError
from dsocr_workers.model.config import DTYPES
from dsocr_workers.model.families import all_modes, all_presets, family_of_model, run_mode
from dsocr_workers.stages import PARTS, TIMINGS, depth

if TYPE_CHECKING:
    from rich.console import Console

    from dsocr_workers.engine.result import InferenceResult
    from dsocr_workers.engine.session import DeepSeekOCRSession

# Modes and presets come from the torch-free model.config; the prompts mirror model.preprocess (which
# imports torch), kept literal so `--help` imports no torch: tests/engine/test_cli_model.py pins them.
MODE_NAMES = all_modes()
PROMPT_NAMES = ("document", "ocr", "free", "figure", "describe")
PRESET_NAMES = tuple(all_presets())


def model_options(func: Any) -> Any:
    """--model, --device, --engine, --dtype and --preset-seed, shared by `infer` and `verify`."""
    for option in reversed(
        [
            click.option(
                "--model",
                "model",
                default=settings.MODEL.default,
                show_default=True,
                envvar=settings.MODEL.name,
                metavar="DIR|tiny|full",
                help="A vendor checkpoint directory, or a random-weight preset "
                "(tiny: CPU tests; full: real dims).",
            ),
            click.option(
                "--device", default=None, metavar="cpu|cuda[:N]", help="Default: cuda if available, else cpu."
            ),
            click.option(
                "--engine",
                type=click.Choice(ENGINE_CHOICES),
                default=AUTO,
                show_default=True,
                help="eager: plain PyTorch reference; fast: static cache + compiled decode (CUDA "
                "only); auto: fast on CUDA, eager on a CPU.",
            ),
            click.option(
                "--dtype",
                type=click.Choice(DTYPES),
                default=None,
                help="Default: bfloat16 on CUDA, float32 on CPU.",
            ),
            click.option(
                "--preset-seed", type=int, default=0, show_default=True, help="Seed of preset weights."
            ),
        ]
    ):
        func = option(func)
    return func


def model_banner(console: Console, session: DeepSeekOCRSession) -> None:
    source = session.source
    console.print(f"model: {source.label}  engine: {session.engine_name}  device: {session.device}")
    if source.random_weights:
        console.print("[bold red]RANDOM WEIGHTS: outputs are noise; timings are real.[/bold red]")


# ---------------------------------------------------------------------------------------------------
# infer


def parse_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated token ids, got {text!r}") from None


def timing_table(result: InferenceResult, title: str) -> Any:
    """Every figure of the stage registry (dsocr_workers/stages.py) in its order, nested ones indented,
    with the NVTX range (domain `dsocr`) that times it, then the decode steps' percentiles."""
    from rich.table import Table

    t = result.timings
    stats = t.decode_step_percentiles
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("ms", justify="right")
    table.add_column("part of e2e", justify="center")
    table.add_column("NVTX range")
    rows: list[tuple[str, float | None, str, str]] = [
        (
            f"{'  ' * depth(timing)}{timing.label}",
            timing.of(t),
            "yes" if timing in PARTS else "",
            timing.stage or "",
        )
        for timing in TIMINGS
    ]
    rows += [(f"decode ms/token {name}", ms, "", "") for name, ms in stats.items()]
    for name, ms, part, stage in rows:
        table.add_row(name, "-" if ms is None else f"{ms:.2f}", part, stage)
    table.caption = (
        f"clock: {t.clock}; {result.decode_tokens} tokens (stop: {result.stop_reason}), "
        f"{result.wasted_steps} decode steps past EOS; mode {result.mode}, "
        f"crop grid {result.crop_grid[0]}x{result.crop_grid[1]}, "
        f"{result.image_tokens} image / {result.prompt_tokens} prompt tokens"
        + (
            f"; job peak memory {result.memory.peak_bytes / 2**30:.2f} GiB (weights "
            f"{result.memory.weights_bytes / 2**30:.2f}, "
            f"KV cache {result.memory.kv_cache_bytes / 2**30:.2f}, "
            f"activations {result.memory.activation_peak_bytes / 2**30:.2f})"
            if result.memory
            else ""
        )
        + ("; COLD: " + "; ".join(result.cold_reasons) if result.cold else "")
        + (
            f"; REPETITION LOOP from token {result.loop.start}, period {result.loop.period}, "
            f"{result.loop.wasted_steps} decode steps wasted"
            if result.loop
            else ""
        )
    )
    return table


@click.command("infer")
@click.argument("image", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@model_options
@click.option("--mode", type=click.Choice(MODE_NAMES), default=None,
              help="Resolution mode of the model's family (default: its default, gundam).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Default: up to the model's positions.")
@click.option("--ignore-eos", is_flag=True, help="Decode exactly --max-new-tokens tokens (benchmarks).")
@click.option("--max-crops", type=click.IntRange(min=2), default=None,
              help="Most tiles in gundam mode, up to the family's limit (its default: DeepSeek-OCR 9 640-px "
              "tiles, its vendor vLLM path 6; DeepSeek-OCR-2 6 768-px tiles).")
@click.option("--prompt", default=None, help="Prompt text; must contain <image> once.")
@click.option("--prompt-name", type=click.Choice(PROMPT_NAMES), default=None,
              help="One of the vendor prompts (default: document).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off.")
@click.option("--seed", type=int, default=None, help="Sampling seed.")
@click.option("--no-repeat-ngram-size", type=int, default=20, show_default=True, help="0: off.")
@click.option("--ngram-window", type=int, default=None,
              help="Search n-grams only in the last N generated tokens (vendor vLLM); "
              "default: whole sequence.")
@click.option("--ngram-whitelist", default="", metavar="ID,ID",
              help="Token ids never banned (vendor vLLM: 128821,128822 = <td>,</td>).")
@click.option("--stop-on-repetition", is_flag=True,
              help="End decoding once the output ends in a repetition loop (stop reason: repetition).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory. Default: out/<image name>.")
@click.option("--json", "as_json", is_flag=True, help="Print result.json instead of the table.")
@exits_on_errors
def infer_command(
    image: Path,
    model: str,
    device: str | None,
    engine: str,
    dtype: str | None,
    preset_seed: int,
    mode: str | None,
    max_new_tokens: int | None,
    ignore_eos: bool,
    max_crops: int | None,
    prompt: str | None,
    prompt_name: str | None,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    no_repeat_ngram_size: int,
    ngram_window: int | None,
    ngram_whitelist: str,
    stop_on_repetition: bool,
    out_dir: Path | None,
    as_json: bool,
) -> None:
    """Run one IMAGE through the model: stage timings, raw markup, boxes, result.mmd, an overlay and
    figure crops, and result.json (machine-readable, with crop grid and token counts)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dsocr_workers.engine.result import DecodeOptions
    from dsocr_workers.engine.standalone import (
        InferPage,
        SessionOptions,
        check_page,
        infer_page,
        open_session,
    )

    if prompt is not None and prompt_name is not None:
        raise click.UsageError("give --prompt or --prompt-name, not both")
    if ignore_eos and max_new_tokens is None:
        raise click.UsageError("--ignore-eos needs --max-new-tokens")
    console = Console(stderr=as_json)
    request = InferPage(
        image=image,
        out_dir=out_dir if out_dir is not None else Path("out") / image.stem,
        prompt=prompt if prompt is not None else prompt_name,
        mode=run_mode(model, mode),  # a mode of the model's family, before the model loads
        max_new_tokens=max_new_tokens,
        decode=DecodeOptions(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            no_repeat_ngram_size=no_repeat_ngram_size,
            ngram_window=ngram_window,
            ngram_whitelist=parse_ids(ngram_whitelist),
            ignore_eos=ignore_eos,
            stop_on_repetition=stop_on_repetition,
        ),
        max_crops=family_of_model(model).crops(max_crops),  # the family's limit, before the model loads
    )
    original = check_page(request)
    session = open_session(SessionOptions(model, device, engine, dtype, preset_seed))
    model_banner(console, session)
    # Progress on stderr (a long decode on a CPU takes minutes): the bar advances with the EOS watch.
    with Progress(
        TextColumn("decode"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        console=stdout_console(stderr=True),
        transient=True,
    ) as progress:
        bar = progress.add_task("decode", total=None)
        outputs = infer_page(
            session,
            request,
            original,
            on_decode_progress=lambda steps, budget: progress.update(bar, completed=steps, total=budget),
        )
    if as_json:
        click.echo(json.dumps(outputs.document, indent=2))
        return
    result = outputs.result
    console.print(
        timing_table(result, f"{image.name}: {result.model.label}, engine {result.engine}, {result.device}")
    )
    console.print(f"outputs: {outputs.out_dir}/ ({len(outputs.files)} files), {len(result.boxes)} regions, "
                  f"{result.skipped_spans} skipped spans")


# ---------------------------------------------------------------------------------------------------
# verify


@click.command("verify")
@model_options
@click.option("--image", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Default: a synthetic 1000x800 page.")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=24, show_default=True)
@exits_on_errors
def verify_command(
    model: str,
    device: str | None,
    engine: str,
    dtype: str | None,
    preset_seed: int,
    image: Path | None,
    max_new_tokens: int,
) -> None:
    """Check the engine on one page: split decode equals one-shot generation (greedy), the KV cache
    grows by one per step, the vision stages ran exactly once. Exit 4 if any check fails."""
    from rich.console import Console

    from dsocr_workers.engine.standalone import SessionOptions, open_session, verify_page
    from dsocr_workers.engine.verify import run_checks

    console = Console()
    page = verify_page(image)
    session = open_session(SessionOptions(model, device, engine, dtype, preset_seed))
    model_banner(console, session)
    checks = run_checks(session, page, max_new_tokens=max_new_tokens)
    for check in checks:
        verdict = "[green]PASS[/green]" if check.passed else "[bold red]FAIL[/bold red]"
        console.print(f"{verdict} {check.name}: {check.detail}", highlight=False)
    failed = [check.name for check in checks if not check.passed]
    if not checks:
        raise click.ClickException("no checks ran")
    if failed:
        raise FailuresError(f"{len(failed)} of {len(checks)} checks failed: {', '.join(failed)}")
    console.print(f"all {len(checks)} checks passed")


# ---------------------------------------------------------------------------------------------------
# model save-preset


@click.group("model")
def model_group() -> None:
    """Model files: random-weight presets as checkpoint directories."""


@model_group.command("save-preset")
@click.argument("name", type=click.Choice(PRESET_NAMES))
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True)
@exits_on_errors
def save_preset_command(name: str, directory: Path, seed: int) -> None:
    """Write preset NAME (seeded RANDOM weights) to DIRECTORY in the vendor checkpoint layout; it
    loads with --model DIRECTORY through the same code path as a real checkpoint."""
    from dsocr_workers.model.checkpoint import save_preset

    path = save_preset(name, directory, seed=seed)
    click.echo(f"wrote preset {name} (RANDOM WEIGHTS, seed {seed}) to {path}")


def register(group: click.Group) -> None:
    group.add_command(infer_command)
    group.add_command(verify_command)
    group.add_command(model_group)
