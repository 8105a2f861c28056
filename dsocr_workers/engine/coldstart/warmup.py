"""The warm-up: every shape a process's jobs can meet, run until warm, before its first job.

    report = warm(session, ["gundam"], max_new_tokens=2048, infer=options, helpers=helpers)

Called once a process has opened its model (a worker child at its start and before a claim that needs
another model or mode, `dsocr precompile`): jobs then meet no compilation, no graph capture and no first
use of a KV cache bucket, and the ones that still do are stored cold with the reason (the session's cold
probes). Eager compiles nothing but runs every shape too: the allocator's pools grow to the largest page
now. A compiled engine (`Engine.compiled()`) looks its plan's artifacts up first (artifacts.py): found
for this environment, its regions run the AOTInductor packages built for them (aoti.py), loaded here
with no dynamo, and the passes only capture their CUDA graphs; otherwise it says why and compiles with
dynamo, with compile helpers (helpers.py) started before the load by the caller (`start_helpers`) or
here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from dsocr_workers.engine.coldstart import artifacts
from dsocr_workers.engine.coldstart.aoti import PackagedRegions
from dsocr_workers.engine.coldstart.helpers import CompileHelpers
from dsocr_workers.engine.coldstart.passes import warm_options, warm_pass, warmup_pages
from dsocr_workers.engine.coldstart.plan import (
    PROCESSES_ENV,
    CompilePlan,
    PrecompileReport,
    compile_plan,
    helper_processes,
)
from dsocr_workers.engine.regions import TorchCompiler
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.session import DeepSeekOCRSession

log = logging.getLogger(__name__)

WARMUP_MAX_PASSES = 4


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did. `phases_ms`: where `ms` went, in order, its parts adding up to it: "load
    packages" (prebuilt AOTInductor packages opened), "prepare" (the pages' preprocessing, once for every
    pass); with helpers, "vision helpers" (waiting for them), "vision" (each page's vision stages traced,
    loaded from the cache, captured), "prefill helper", "prefill" (likewise, with the prefill captures),
    "decode helper"; then "pass 1", "pass 2", ... (each with its prefill captures)."""

    ms: float
    shapes: list[str]  # "mode" or "mode:colsxrows", in the order they ran
    passes: int  # over all shapes, until one met no cold path
    # What the last pass still met, per shape ("mode:grid: reason"): empty when it came clean, so
    # the first jobs will not be cold either.
    still_cold: tuple[str, ...] = ()
    # The prompt lengths (the warm-up's prompt) whose LM prefill is ready: from its shortest page to the
    # longest prompt any crop grid of its modes makes, which its `n x 1` strips do not reach.
    prompt_lengths: tuple[int, int] = (0, 0)
    # The compile helpers (helpers.py), when they ran; `helpers_skipped` says why not.
    helpers: PrecompileReport | None = None
    helpers_skipped: str = ""
    # What the start found (artifacts.py `Lookup.summary`): prebuilt artifacts, or why none were used and
    # the graphs compiled here. Empty where the engine compiles nothing.
    artifacts: str = ""
    # AOTInductor packages loaded (prebuilt artifacts), and the regions none was built for (dynamo's).
    packages: int = 0
    packages_missed: tuple[str, ...] = ()
    phases_ms: dict[str, float] = field(default_factory=dict)


def session_plan(
    session: DeepSeekOCRSession,
    modes: Sequence[str],
    max_new_tokens: int | None,
    infer: DecodeOptions | None,
    max_crops: int | None = None,
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
        family=session.family.name,
    )


def plan_helpers(
    session: DeepSeekOCRSession,
    modes: Sequence[str],
    max_new_tokens: int | None,
    max_crops: int,
    infer: DecodeOptions | None,
) -> tuple[CompilePlan | None, artifacts.Lookup | None, str]:
    """The compile plan of this warm-up (None when inductor compiles nothing for it), its artifacts'
    lookup, and why no helper should start now (empty: they should)."""
    plan = session_plan(session, modes, max_new_tokens, infer, max_crops)
    if plan is None:
        return None, None, "no mode to warm" if not modes else "nothing compiled by inductor"
    found = artifacts.lookup(plan, session.loaded.config)
    if found.manifest is not None:
        return plan, found, f"prebuilt artifacts ({found.path})"
    if helper_processes() == 0:
        return plan, found, f"{PROCESSES_ENV}=0"
    if session.jobs_run:
        return plan, found, "this session has compiled already"
    return plan, found, ""


def use_packages(
    session: DeepSeekOCRSession, plan: CompilePlan, manifest: artifacts.Manifest
) -> PackagedRegions:
    """The session's regions run `manifest`'s packages from now on; a region none was built for compiles
    with dynamo (and says so)."""
    regions = PackagedRegions.load(
        manifest.packages(), session.device, TorchCompiler(plan.backend), plan.dynamic_tiles
    )
    session.use_compiler(regions)
    return regions


def warm(
    session: DeepSeekOCRSession,
    modes: Sequence[str],
    max_new_tokens: int | None = None,
    max_crops: int | None = None,
    infer: DecodeOptions | None = None,
    helpers: CompileHelpers | None = None,
    found: artifacts.Lookup | None = None,
) -> WarmupReport:
    """Run every shape `modes` can produce on `session` until warm (`max_new_tokens` sizes the cache
    buckets, as jobs will). `infer`: the jobs' decode options (default: the vendor's), since the compiled
    decode step is specialised on how tokens are chosen (the n-gram ban's size and window, sampling or
    greedy). `helpers`: compile helpers started for this warm-up before the model was loaded
    (`start_helpers`); otherwise a compiled engine's warm-up with a cold cache starts them now. `found`:
    the artifacts to use instead of looking them up (the build step checks its packages so before it
    writes their manifest)."""
    began = time.perf_counter()
    max_crops = session.max_crops(max_crops)
    pages = warmup_pages(session.family, modes, max_crops)
    options = warm_options(infer)
    plan, looked_up, skipped = plan_helpers(session, modes, max_new_tokens, max_crops, infer)
    found = found or looked_up
    phases: dict[str, float] = {}
    regions = None
    if plan is not None and found is not None and found.manifest is not None:
        try:
            regions = use_packages(session, plan, found.manifest)
            skipped = f"prebuilt artifacts ({found.path})"
        except Exception as exc:  # a package that does not open: compiled as without artifacts
            log.exception("the prebuilt artifacts %s do not load", found.path)
            found = replace(found, manifest=None, reason=f"artifacts unusable ({type(exc).__name__}: {exc})")
            skipped = "" if helper_processes() else f"{PROCESSES_ENV}=0"
        phases["load packages"] = (time.perf_counter() - began) * 1e3
    if plan is not None and found is not None:
        say = log.info if found.manifest is not None else log.warning
        say("warm-up of %s: %s", artifacts.describe(plan), found.summary)
    if helpers is not None:
        skipped = ""
        if helpers.plan != plan:  # their graphs may not be this warm-up's: what they miss compiles here
            log.warning(
                "compile helpers were started for another warm-up (%s); this one is %s", helpers.plan, plan
            )
    elif plan is not None and not skipped:
        helpers = CompileHelpers.start(plan, helper_processes())
    mark = began + sum(phases.values()) / 1e3

    def phase_ends(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name], mark = (now - mark) * 1e3, now

    try:
        with torch.inference_mode():  # as run_inference prepares a page
            prepared = [(name, session.prepare(image, None, name, max_crops)) for name, image in pages]
        phase_ends("prepare")
        if helpers is not None:
            # Each part traced (its graphs loaded from the cache) and captured as soon as its helpers
            # are done, while the others still compile: the vision stages of every page, then the
            # LM prefills, then the passes once the decode step's helper is done too.
            helpers.wait("vision")
            phase_ends("vision helpers")
            with torch.inference_mode():
                for _, page in prepared:
                    session.encode_image(session.upload(page), session.new_clock())
            session.synchronize()
            phase_ends("vision")
            helpers.wait("prefill")
            phase_ends("prefill helper")
            warm_pass(session, prepared, max_new_tokens, options, max_crops, decode=False)
            phase_ends("prefill")
            helpers.wait()
            phase_ends("decode helper")
    except BaseException:
        if helpers is not None:
            helpers.stop()  # none outlives a failed warm-up
        raise
    precompiled = helpers.report() if helpers is not None else None
    if precompiled is not None:
        log.info(
            "compile helpers (%s): %d in %.1f s, %d graphs compiled, %d failed",
            precompiled.how,
            precompiled.processes,
            precompiled.seconds,
            sum(r.graphs for r in precompiled.results),
            len(precompiled.failures),
        )
    passes = 0
    still_cold: list[str] = []
    shapes: list[str] = []
    shortest = longest = 0
    while passes < WARMUP_MAX_PASSES:
        passes += 1
        shapes, still_cold, (shortest, longest) = warm_pass(
            session, prepared, max_new_tokens, options, max_crops
        )
        phase_ends(f"pass {passes}")
        if not still_cold:
            break
    log.info(
        "warm-up: %.2f s (%s)",
        mark - began,
        ", ".join(f"{name} {ms / 1e3:.2f} s" for name, ms in phases.items()),
    )
    return WarmupReport(
        (mark - began) * 1e3,
        shapes,
        passes,
        tuple(still_cold),
        (shortest, longest),
        precompiled,
        skipped,
        found.summary if found is not None else "",
        len(regions.packages) if regions else 0,
        tuple(regions.missed) if regions else (),
        phases,
    )
