"""`dsocr precompile`: the build step of a worker's cold start (engine/coldstart/build.py)."""

from __future__ import annotations

import time

import click

from dsocr_workers.cli import exits_on_errors
from dsocr_workers.engine.variants import AUTO, ENGINE_CHOICES
from dsocr_workers.model.config import DTYPES


@click.command()
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="The model the workers will load: a vendor checkpoint directory or a preset (as `dsocr worker`).",
)
@click.option(
    "--engine",
    type=click.Choice(ENGINE_CHOICES),
    default=AUTO,
    show_default=True,
    help="auto is fast on a GPU, eager on a CPU.",
)
@click.option(
    "--dtype", type=click.Choice(DTYPES), default=None, help="Default: bfloat16 on CUDA, float32 on CPU."
)
@click.option(
    "--modes",
    default="gundam",
    show_default=True,
    help="The modes the workers warm (their --warmup), comma-separated.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="The jobs' token budget (it sizes the KV cache buckets warmed); default: the model's positions.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="The jobs in flight per GPU the workers serve (`dsocr worker --concurrency`): above 1, the batched "
    "engine's step for every bucket up to it (of each mode) is built and checked too.",
)
@click.option(
    "--gpus",
    default="auto",
    show_default=True,
    help="Where to build, as `dsocr worker --gpus`: the first GPU named (seen as cuda:0, as every "
    "worker child sees its own); GPUs of another type need a build of their own. cpu: on the CPU.",
)
@exits_on_errors
def precompile(
    model: str, engine: str, dtype: str | None, modes: str, max_new_tokens: int | None, concurrency: int, gpus: str
) -> None:
    """Build what a worker's start needs for this plan into DSOCR_COMPILE_CACHE_DIR: every region the fast
    engine compiles as an AOTInductor package, with `--concurrency N` the batched engine's step too
    (checked by the worker's warm-up and batched engine's start run on them), Python
    bytecode where the installation has none, and a manifest keyed by the GPU type, the versions of
    torch, Triton, transformers and this package, the model's configuration and the plan. A worker that
    finds the manifest for its plan and GPU loads the packages, no dynamo; one that finds none, or one
    built for another GPU or version, compiles as before and says why (its log, its worker session's
    warm-up). AOTInductor compiles with the C++ compiler CXX names.

    Idempotent: "up to date" when the manifest is there. Run it as an image build step, a compose one-shot
    service or a Kubernetes Job before the workers start (deploy/README.md)."""
    from dsocr_workers.engine.coldstart.build import BuildRequest, build
    from dsocr_workers.errors import InputError
    from dsocr_workers.farm.celery.preimport import import_for_jobs
    from dsocr_workers.farm.devices import parse_devices, see_only_this_gpu
    from dsocr_workers.farm.job.warm import default_modes, parse_modes

    chosen = parse_modes(modes, model)
    if chosen == ():
        raise InputError("--modes none: nothing to build")
    device = see_only_this_gpu(parse_devices(gpus)[0])
    began = time.perf_counter()
    # Every module a worker's start imports, Celery's and the ledger's included: the build writes the
    # bytecode of what this process imported.
    import_for_jobs()

    def progress(line: str) -> None:
        click.echo(f"[{time.perf_counter() - began:6.1f} s] {line}", err=True)

    report = build(
        BuildRequest(
            model, engine, dtype, chosen or default_modes(model), max_new_tokens, device=device,
            concurrency=concurrency,
        ),  # fmt: skip
        progress,
    )
    click.echo(f"{report.outcome}: {report.manifest or '-'}")


def register(group: click.Group) -> None:
    group.add_command(precompile)
