"""The warm-up: every shape a process's jobs can meet, run until warm, before its first job.

    report = warm(session, ["gundam"], max_new_tokens=2048, infer=options)
    engine, started = start_batched(session, 128, "gundam", 2048, options, report.prompt_lengths)

Called once a process has opened its model (a worker child at its start and before a claim that needs
another model or mode, `dsocr precompile`): jobs then meet no compilation, no graph capture and no first
use of a KV cache bucket, and the ones that still do are stored cold with the reason (the session's cold
probes). Eager compiles nothing but runs every shape too: the allocator's pools grow to the largest page
now. A compiled engine looks its plan's artifacts up first (artifacts.py): found for this environment,
its regions run the AOTInductor packages built for them (aoti.py), loaded here with no dynamo, and the
passes only capture their CUDA graphs; otherwise it says why and compiles with dynamo in this process,
one process of the host at a time (`artifacts.host_lock`: the others then load its graphs from
inductor's cache). `start_batched` starts the batched engine of a worker that serves a concurrency: its
step per bucket captured (from the same packages), its admission's prefills captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from PIL import Image

from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.aoti import PackagedRegions
from dsocr_workers.engine.coldstart.passes import capture_prefills, warm_options, warm_pass, warmup_pages
from dsocr_workers.engine.coldstart.plan import CompilePlan, compile_plan
from dsocr_workers.engine.regions import (
    TorchCompiler,
    compile_timers,
    compiled_by_region,
    dynamo_graphs,
    timers_since,
)
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession
from dsocr_workers.model.preprocess import PreparedPage

if TYPE_CHECKING:
    from dsocr_workers.engine.batched import BatchedEngine

log = logging.getLogger(__name__)

WARMUP_MAX_PASSES = 4


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did. `phases_ms`: where `ms` went, in order, its parts adding up to it: "load
    packages" (prebuilt AOTInductor packages opened), "wait for the host's compile" (another process
    compiling this plan, without packages), then "pass 1", "prefill graphs 1", "pass 2", ... (a pass's
    jobs, then its LM prefill captures; pass 1's jobs wait for any page not yet prepared beside them).
    `prefill_graphs`: how many LM prefill graphs the warm-up captured (its jobs' and the captures')."""

    ms: float
    shapes: list[str]  # "mode" or "mode:colsxrows", in the order they ran
    passes: int  # over all shapes, until one met no cold path that running once does not resolve
    # What the last pass still met, per shape ("mode:grid: reason"), past those running once resolves
    # (session.py `met_once`): empty when it came clean, so the first jobs will not be cold either.
    still_cold: tuple[str, ...] = ()
    # The prompt lengths (the warm-up's prompt) whose LM prefill is ready: from its shortest page to the
    # longest prompt any crop grid of its modes makes, which its `n x 1` strips do not reach.
    prompt_lengths: tuple[int, int] = (0, 0)
    # What the start found (artifacts.py `Lookup.summary`): prebuilt artifacts, or why none were used and
    # the graphs compiled here. Empty where the engine compiles nothing.
    artifacts: str = ""
    # AOTInductor packages loaded (prebuilt artifacts), and the regions none was built for (dynamo's).
    packages: int = 0
    packages_missed: tuple[str, ...] = ()
    phases_ms: dict[str, float] = field(default_factory=dict)
    prefill_graphs: int = 0
    # What dynamo compiled in the warm-up, per region (regions.py `compiled_by_region`): its graphs and
    # the compiling calls' seconds. Empty from packages.
    compiled: dict[str, tuple[int, float]] = field(default_factory=dict)
    # Where those seconds went by dynamo's and inductor's own timers (regions.py `COMPILE_TIMERS`).
    compile_timers: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """Its time and phases in words, for the log and the worker session's record."""
        phases = ", ".join(f"{name} {ms / 1e3:.2f} s" for name, ms in self.phases_ms.items())
        captured = f"; {self.prefill_graphs} LM prefill graphs captured" if self.prefill_graphs else ""
        compiled = ", ".join(
            f"{region} {graphs} graph{'s' if graphs > 1 else ''} in {seconds:.1f} s"
            for region, (graphs, seconds) in self.compiled.items()
        )
        compiled = f"; compiled by dynamo: {compiled}" if compiled else ""
        timers = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.compile_timers.items())
        timers = f" (its timers: {timers})" if compiled and timers else ""
        return f"warm-up {self.ms / 1e3:.2f} s ({phases}){captured}{compiled}{timers}"


def dynamo_compiler(session: DeepSeekOCRSession) -> TorchCompiler | None:
    """What compiles the session's regions with dynamo, where anything does: its engine's own compiler,
    or the fallback of its packages."""
    compiler = session.runners.compiler
    if isinstance(compiler, PackagedRegions):
        compiler = compiler.fallback
    return compiler if isinstance(compiler, TorchCompiler) else None


def session_plan(
    session: DeepSeekOCRSession,
    modes: Sequence[str],
    max_new_tokens: int | None,
    infer: DecodeOptions | None,
    max_crops: int | None = None,
    concurrency: int = 1,
) -> CompilePlan | None:
    """What a warm-up of `session`'s graphs depends on, or None when its engine compiles none."""
    text = session.model.language_model.config
    kernels = {
        "attn_implementation": text._attn_implementation,
        "experts_implementation": text._experts_implementation,
    }
    return compile_plan(
        session.source.name,
        session.device,
        session.dtype,
        kernels,
        session.engine.compiled(),
        modes,
        max_new_tokens,
        infer,
        session.max_crops(max_crops),
        engine=session.engine_name,
        concurrency=concurrency,
        family=session.family.name,
    )


def use_packages(
    session: DeepSeekOCRSession, plan: CompilePlan, manifest: artifacts.Manifest
) -> PackagedRegions:
    """The session's regions run `manifest`'s packages from now on; a region none was built for compiles
    with dynamo (and says so)."""
    regions = PackagedRegions.load(
        manifest.packages(), session.device, TorchCompiler(plan.backend), plan, plan.dynamic_tiles
    )
    session.use_compiler(regions)
    return regions


def warm(
    session: DeepSeekOCRSession,
    modes: Sequence[str],
    max_new_tokens: int | None = None,
    max_crops: int | None = None,
    infer: DecodeOptions | None = None,
    found: artifacts.Lookup | None = None,
    concurrency: int = 1,
) -> WarmupReport:
    """Run every shape `modes` can produce on `session` until warm (`max_new_tokens` sizes the cache
    buckets, as jobs will). `infer`: the jobs' decode options (default: the vendor's), since the compiled
    decode step is specialised on how tokens are chosen (the n-gram ban's size and window, sampling or
    greedy). `concurrency`: what the worker serves, part of the plan its artifacts are looked up by
    (`start_batched` then starts the batched engine from them). `found`: the artifacts to use instead of
    looking them up (the build step checks its packages so before it writes their manifest)."""
    began = time.perf_counter()
    max_crops = session.max_crops(max_crops)
    pages = warmup_pages(session.family, modes, max_crops)
    options = warm_options(infer)
    plan = session_plan(session, modes, max_new_tokens, infer, max_crops, concurrency)
    if plan is not None and found is None:
        found = artifacts.lookup(plan, session.loaded.config)
    phases: dict[str, float] = {}
    regions = None
    if plan is not None and found is not None and found.manifest is not None:
        try:
            regions = use_packages(session, plan, found.manifest)
        except Exception as exc:  # a package that does not open: compiled as without artifacts
            log.exception("the prebuilt artifacts %s do not load", found.path)
            found = replace(found, manifest=None, reason=f"artifacts unusable ({type(exc).__name__}: {exc})")
        phases["load packages"] = (time.perf_counter() - began) * 1e3
    if plan is not None and found is not None:
        say = log.info if found.manifest is not None else log.warning
        say("warm-up of %s: %s", artifacts.describe(plan), found.summary)
    mark = began + sum(phases.values()) / 1e3

    def phase_ends(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name], mark = (now - mark) * 1e3, now

    with ExitStack() as compiling:
        if plan is not None and regions is None:  # dynamo compiles: one process of the host at a time
            compiling.enter_context(artifacts.host_lock(plan, session.loaded.config, shared_wait=True))
            phase_ends("wait for the host's compile")
        dynamo = dynamo_compiler(session)
        compiles = compiling.enter_context(dynamo.recording()) if dynamo is not None else []
        timers_before = compile_timers()
        # Pass 1 runs each page as soon as it is prepared, on a thread beside it: the host's preprocessing
        # of the next page overlaps this page's first calls. The later passes take the same pages.
        preparing = ThreadPoolExecutor(1, thread_name_prefix="dsocr-warm-pages")
        futures = [(name, preparing.submit(_prepare, session, image, name, max_crops)) for name, image in pages]
        preparing.shutdown(wait=False)
        prepared: list[tuple[str, PreparedPage]] = []

        def pages_as_prepared() -> Iterator[tuple[str, PreparedPage]]:
            for name, future in futures:
                prepared.append((name, future.result()))
                yield prepared[-1]

        passes = 0
        graphs = session.runners.prefill_graphs
        graphs_before = graphs.captured if graphs is not None else 0
        while True:
            passes += 1
            pass_pages = pages_as_prepared() if passes == 1 else prepared
            ran = warm_pass(session, pass_pages, max_new_tokens, options, max_crops)
            phase_ends(f"pass {passes}")
            if graphs is not None:  # the pass's jobs, then its captures
                phases[f"pass {passes}"] -= ran.prefill_graphs_ms
                phases[f"prefill graphs {passes}"] = ran.prefill_graphs_ms
            jobs = ", ".join(f"{shape} {ms / 1e3:.2f} s" for shape, ms in ran.jobs_ms.items())
            parts = ", ".join(f"{part} {ms / 1e3:.2f} s" for part, ms in ran.parts_ms.items() if ms >= 5)
            captures = f"; prefill graphs {ran.prefill_graphs_ms / 1e3:.2f} s" if graphs is not None else ""
            log.info("warm-up pass %d: jobs %s (by part: %s)%s", passes, jobs, parts, captures)
            if not ran.lasting or passes == WARMUP_MAX_PASSES:
                break
            log.info("warm-up pass %d met cold paths: %s", passes, "; ".join(ran.lasting))
    report = WarmupReport(
        (mark - began) * 1e3,
        ran.shapes,
        passes,
        tuple(ran.lasting),
        ran.prompt_lengths,
        found.summary if found is not None else "",
        len(regions.packages) if regions else 0,
        tuple(regions.missed) if regions else (),
        phases,
        graphs.captured - graphs_before if graphs is not None else 0,
        compiled_by_region(compiles),
        timers_since(timers_before) if compiles else {},
    )
    log.info("%s", report.describe())
    return report


def _prepare(session: DeepSeekOCRSession, image: Image.Image, mode: str, max_crops: int) -> PreparedPage:
    with torch.inference_mode():  # as run_inference prepares a page
        return session.prepare(image, None, mode, max_crops)


@dataclass(frozen=True)
class BatchedStart:
    """What starting the batched engine did: each bucket's step captured, the admission's prefills
    captured, the regions no package was built for (dynamo compiled them here)."""

    ms: float
    captures_ms: dict[int, float]  # bucket → its capture (the step's first run included), or first run
    graphs: bool  # CUDA graphs captured (else each bucket's step was run once)
    admission_ms: float  # the prefill graphs of the cache buckets its pages' scratch caches use
    compiled: int  # graphs dynamo compiled meanwhile (0 from packages)
    packages_missed: tuple[str, ...] = ()
    engine: str = ""  # the engine's plan and step, in words

    def describe(self) -> str:
        """One line for the worker session's record."""
        steps = ", ".join(f"{bucket} {ms:.0f} ms" for bucket, ms in self.captures_ms.items()) or "none"
        made = (
            f"{self.compiled} graphs compiled by dynamo" if self.compiled else "no graph compiled"
        ) + (f" (no package for {'; '.join(self.packages_missed)})" if self.packages_missed else "")
        return (
            f"{self.engine}; started in {self.ms / 1e3:.2f} s: "
            f"{'captures' if self.graphs else 'first steps'} by bucket {steps}, "
            f"admission {self.admission_ms / 1e3:.2f} s, {made}"
        )


def describe_prefill(split_prefill: bool) -> str:
    """How the batched engine prefills its pages, in words."""
    return "prefills split while pages decode (sam, then join)" if split_prefill else "whole prefills"


def _add_packages(session: DeepSeekOCRSession, regions: PackagedRegions, plan: CompilePlan) -> None:
    """A worker warmed from another concurrency's packages that starts a batched engine: the packages
    built for `plan`, where built, so that its step loads instead of compiling."""
    found = artifacts.lookup(plan, session.loaded.config)
    if found.manifest is None:
        log.info("batched engine of %s: %s", artifacts.describe(plan), found.summary)
        return
    added = regions.add(found.manifest.packages(), session.device)
    log.info("batched engine of %s: %d packages opened from %s", artifacts.describe(plan), added, found.path)


def start_batched(
    session: DeepSeekOCRSession,
    concurrency: int,
    mode: str,
    max_new_tokens: int | None,
    infer: DecodeOptions | None,
    prompt: str | None = None,
    max_crops: int | None = None,
    *,
    compiled: bool | None = None,
    cuda_graphs: bool | None = None,
    split_prefill: bool = True,
) -> tuple[BatchedEngine, BatchedStart]:
    """The batched engine for `concurrency` pages of `mode`, started on a warm `session`: its step per
    bucket compiled where nothing was built for it and captured, then the LM prefill graphs its
    admissions replay, from the mode's shortest prompt to its longest (a scratch cache sized by the
    engine's budget may be a bucket the batch-1 warm-up did not use). `compiled`, `cuda_graphs`:
    `StepConfig.decide`'s; `split_prefill`: `BatchedEngine`'s."""
    from dsocr_workers.engine.batched import BatchedEngine

    began, graphs_before = time.perf_counter(), dynamo_graphs()
    regions = session.compiler if isinstance(session.compiler, PackagedRegions) else None
    missed = len(regions.missed) if regions is not None else 0
    if regions is not None and regions.plan is not None and regions.plan.concurrency != concurrency:
        _add_packages(session, regions, replace(regions.plan, concurrency=concurrency))
    engine = BatchedEngine.for_mode(
        session, concurrency, mode, prompt, max_new_tokens, infer, compiled=compiled, cuda_graphs=cuda_graphs,
        split_prefill=split_prefill,
    )  # fmt: skip
    admitting = time.perf_counter()
    max_crops = session.max_crops(max_crops)
    with torch.inference_mode():
        page = warmup_pages(session.family, [mode], max_crops)[0][1]
        smallest = session.prepare(page, prompt, mode, max_crops)
    longest = min(session.longest_prompt(mode, prompt, max_crops), session.max_positions - 1)
    capture_prefills(session, smallest.prompt_tokens, longest, engine.plan.max_new_tokens)
    session.synchronize()
    ended = time.perf_counter()
    graphs = "CUDA graphs" if engine.runner.cuda_graphs else "no CUDA graphs"
    started = BatchedStart(
        (ended - began) * 1e3,
        engine.captures_ms,
        engine.runner.cuda_graphs,
        (ended - admitting) * 1e3,
        dynamo_graphs() - graphs_before,
        tuple(regions.missed[missed:]) if regions is not None else (),
        f"batched engine: concurrency {concurrency}, {engine.plan.describe()}, {engine.attention} attention, "
        f"{describe_prefill(split_prefill)}, {graphs} for buckets {', '.join(map(str, engine.buckets))}",
    )
    log.info("%s", started.describe())
    return engine, started
