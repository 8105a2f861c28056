"""The build step: everything a worker's cold start needs for one plan, made ahead of its start.

    CXX=/usr/bin/g++ dsocr precompile --model full --engine fast --dtype bfloat16 \\
        --modes gundam --max-new-tokens 2048 --concurrency 128

loads the model as a worker will, runs the warm-up's pages once with a recorder in place of dynamo
(aoti.py `Recorder`) and, for a concurrency above 1, the batched engine's step of each mode over every
bucket, builds each region and shape met as an AOTInductor package (aoti.py `build_package`; one the
plan's batch-1 or batched form built already is taken as it is: artifacts.py `packages_folder`), then
checks them as a worker's start uses them: the warm-up itself and the batched engine's start, on the
packages, must come clean. Only then is the plan's manifest (artifacts.py) written, beside the packages,
with the Python bytecode of every module it imported where the installation has none (cache.py).
Idempotent: a plan whose manifest is there for this environment, with every artifact this build would
make, is "up to date" without loading the model; two builds of one plan on one host take turns, and a
worker that compiles it meanwhile waits for them (`artifacts.host_lock`).
`CXX` names the C++ compiler of each package's wrapper (else `c++`): packages that do not load (their
loader crashes) are found by opening them in a child process before the check above, and removed, before
any manifest exists (docs/architecture.md, the cold start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.aoti import (
    Limits,
    Recorder,
    build_package,
    check_packages_load,
    package_name,
    remove_partial_packages,
)
from dsocr_workers.engine.coldstart.cache import bytecode_directory, use_compile_cache, write_bytecode
from dsocr_workers.engine.coldstart.passes import warm_options, warm_pass, warmup_pages
from dsocr_workers.engine.coldstart.plan import CompilePlan, cache_root, compile_plan
from dsocr_workers.engine.coldstart.warmup import BatchedStart, WarmupReport, start_batched, warm
from dsocr_workers.engine.device import resolve_dtype
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.engine.variants import AUTO, make_engine
from dsocr_workers.engine.variants.base import Engine
from dsocr_workers.errors import FailuresError
from dsocr_workers.model.checkpoint import model_config
from dsocr_workers.model.families import all_presets, family_of_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildRequest:
    """One plan to build, named as a worker's start-up warm-up names it (`dsocr worker --model --engine
    --dtype --warmup --max-new-tokens --concurrency`). `device`: where it is built, as the workers will
    see it (cuda:0: every worker child sees its GPU as cuda:0). `batched_compiled`: whether the batched
    step is compiled (None: the engine's choice on this device, `StepConfig.decide`)."""

    model: str
    engine: str | Engine = AUTO  # a registered name, or an engine object (as from_local takes it)
    dtype: str | None = None
    modes: tuple[str, ...] = ("gundam",)
    max_new_tokens: int | None = None
    options: DecodeOptions = DecodeOptions()
    device: str = "cuda:0"
    max_crops: int | None = None  # None: the model family's limit
    concurrency: int = 1
    batched_compiled: bool | None = None


@dataclass(frozen=True)
class BuildReport:
    outcome: str  # "built", "up to date", "nothing to compile"
    plan: CompilePlan | None
    manifest: Path | None
    seconds: float
    warmup: WarmupReport | None = None
    bytecode_modules: int | None = None  # written now; None: the installation's bytecode serves
    notes: list[str] = field(default_factory=list)
    packages: dict[str, float] = field(default_factory=dict)  # package file name → seconds to build it
    batched: list[BatchedStart] = field(default_factory=list)  # the check's batched start, per mode


def _plan(request: BuildRequest) -> tuple[CompilePlan | None, str, str]:
    device = torch.device(request.device)
    engine, note = (
        (request.engine, "")
        if isinstance(request.engine, Engine)
        else make_engine(request.engine, device.type)
    )
    source = request.model if request.model in all_presets() else str(Path(request.model).resolve())
    family = family_of_model(source)
    plan = compile_plan(
        source,
        device,
        resolve_dtype(request.dtype, device),
        engine.kernels(),
        engine.compiled(),
        request.modes,
        request.max_new_tokens,
        request.options,
        family.max_crops if request.max_crops is None else request.max_crops,
        engine=engine.name,
        concurrency=request.concurrency,
        family=family.name,
    )
    return plan, engine.name, note


def _wanted(found: artifacts.Lookup) -> bool:
    """The manifest found holds every artifact this build makes."""
    kinds = {"aoti-package"} | ({"python-bytecode"} if bytecode_directory() is not None else set())
    return found.manifest is not None and kinds <= found.manifest.kinds()


def _record_batched(session: DeepSeekOCRSession, request: BuildRequest) -> None:
    """Each mode's batched step over every bucket once, through the session's recorder: what a worker
    serving `request.concurrency` compiles (its admission runs the regions the warm-up recorded)."""
    from dsocr_workers.engine.batched import BatchedEngine

    for mode in request.modes:
        engine = BatchedEngine.for_mode(
            session, request.concurrency, mode, None, request.max_new_tokens, request.options,
            compiled=request.batched_compiled, cuda_graphs=False,
        )  # fmt: skip
        with torch.inference_mode():  # as its steps run
            for bucket in engine.buckets:
                engine.runner.steps.run(bucket)
        del engine


def build(request: BuildRequest, progress: Callable[[str], None] = log.info) -> BuildReport:
    """Build `request`'s artifacts into the compile cache (DSOCR_COMPILE_CACHE_DIR), saying what it does
    through `progress`. Raises FailuresError when the warm-up still met cold paths (nothing recorded)."""
    began = time.perf_counter()
    cache = use_compile_cache()
    notes = []
    if cache is None:
        notes.append(
            f"DSOCR_COMPILE_CACHE_DIR is not set: artifacts go to torch's default cache ({cache_root()}), "
            "which a container or a reboot loses"
        )
    plan, engine_name, engine_note = _plan(request)
    notes += [engine_note] if engine_note else []
    for note in notes:
        progress(f"note: {note}")
    if plan is None:
        written = write_bytecode()
        progress(
            f"the {engine_name} engine compiles nothing ahead of jobs"
            + (f"; bytecode of {written} modules written" if written else "")
        )
        return BuildReport(
            "nothing to compile", None, None, time.perf_counter() - began, None, written, notes
        )
    config = model_config(plan.source)
    progress(f"plan: {artifacts.describe(plan)} on {request.device}; artifacts in {cache_root()}")
    with artifacts.host_lock(plan, config, progress):
        if artifacts.listed_without_gpu(plan, config):
            found = artifacts.lookup(plan, config)  # initialises CUDA: the GPU is part of the match
            if _wanted(found):
                written = write_bytecode()  # of sources whose content changed since (an upgraded package)
                progress(f"up to date: {found.path}" + (f"; bytecode of {written} modules written" if written else ""))
                return BuildReport(
                    "up to date", plan, found.path, time.perf_counter() - began, bytecode_modules=written, notes=notes
                )
            progress(found.summary)
        progress(f"loading {request.model}")
        session = DeepSeekOCRSession.from_local(
            request.model, device=request.device, dtype=request.dtype, engine=request.engine
        )
        recorder = Recorder(plan.dynamic_tiles)
        session.use_compiler(recorder)
        with torch.inference_mode():
            pages = [
                (name, session.prepare(image, None, name, plan.max_crops))
                for name, image in warmup_pages(session.family, request.modes, plan.max_crops)
            ]
        warm_pass(session, pages, request.max_new_tokens, warm_options(request.options), plan.max_crops)
        if request.concurrency > 1:
            _record_batched(session, request)
        progress(
            f"loaded in {time.perf_counter() - began:.1f} s; {len(recorder.calls)} regions to build "
            f"for {', '.join(request.modes)}"
        )
        here = artifacts.Environment.here(session.device)
        folder = artifacts.packages_folder(plan, config, here)
        for partial in remove_partial_packages(folder):
            progress(f"removed {partial.name}, a package left partial by a build cut short")
        limits = Limits(plan.max_crops, session.max_positions)
        built, seconds_each = [], {}
        for number, (key, call) in enumerate(recorder.calls.items(), 1):
            path = folder / package_name(key)
            built.append(artifacts.Artifact("aoti-package", str(path), key))
            if path.exists():  # built for this plan's batch-1 or batched form already (packages_folder)
                progress(f"package {number}/{len(recorder.calls)}: {key} built already")
                continue
            started = time.perf_counter()
            build_package(call, limits, plan.dynamic_tiles, path)
            seconds_each[path.name] = round(time.perf_counter() - started, 1)
            progress(f"package {number}/{len(recorder.calls)}: {key} in {seconds_each[path.name]} s")
        del recorder, pages  # the recorded calls hold copies of their inputs
        opened = check_packages_load([Path(artifact.path) for artifact in built], session.device)
        if opened.not_loaded:
            for package in opened.not_loaded:
                package.unlink(missing_ok=True)  # so that the next build makes them again
            raise FailuresError(
                f"package {opened.not_loaded[0].name} does not load ({opened.reason}); built with "
                f"{artifacts.compiler_version()}. Removed it and the {len(opened.not_loaded) - 1} not checked "
                "after it: set CXX to a compiler whose packages load and build again"
            )
        manifest = artifacts.manifest(plan, config, tuple(built), time.perf_counter() - began, here)
        path = artifacts.manifest_path(plan, config, here)
        # The worker's own start on these packages, before any worker may find them.
        report = warm(
            session,
            request.modes,
            request.max_new_tokens,
            plan.max_crops,
            request.options,
            found=artifacts.Lookup(manifest, path),
            concurrency=request.concurrency,
        )
        progress(
            f"checked: the warm-up on the packages took {report.ms / 1e3:.1f} s, "
            f"{len(report.shapes)} shapes, {report.passes} passes"
        )
        cold = [*report.still_cold, *report.packages_missed]
        batched = []
        for mode in request.modes if request.concurrency > 1 else ():
            engine, checked = start_batched(
                session, request.concurrency, mode, request.max_new_tokens, request.options,
                max_crops=request.max_crops, compiled=request.batched_compiled,
            )  # fmt: skip
            del engine  # its KV cache, before the next mode's
            progress(f"checked: {mode}'s {checked.describe()}")
            cold += [*checked.packages_missed] + ([f"{checked.compiled} graphs compiled"] if checked.compiled else [])
            batched.append(checked)
        if cold:
            raise FailuresError(
                "the warm-up on the packages still met cold paths, nothing recorded: " + "; ".join(cold)
            )
        written = write_bytecode()
        if written is not None:
            progress(f"bytecode of {written} modules written into {bytecode_directory()}")
            built.append(artifacts.Artifact("python-bytecode", str(bytecode_directory())))
        seconds = time.perf_counter() - began
        manifest = replace(manifest, artifacts=tuple(built), seconds=round(seconds, 1))
        try:
            artifacts.write(manifest, path)
        except OSError as exc:
            raise FailuresError(f"could not write the artifact manifest {path}: {exc}") from exc
        progress(f"built in {seconds:.1f} s: {path}")
    return BuildReport("built", plan, path, seconds, report, written, notes, seconds_each, batched)
