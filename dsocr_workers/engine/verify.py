"""Checks the engine runs on demand (`dsocr verify`, DESIGN §3) and the teacher-forced agreement the
benchmark reports. Nothing here is on the timed path: these loops sync freely."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from PIL import Image

from dsocr_workers.engine.clock import VISION_STAGES, StageClock
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.sampling import NGramBan, select_token
from dsocr_workers.engine.session import DeepSeekOCRSession, PageJob

ImageInput = str | os.PathLike | bytes | Image.Image


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str


# Rounding of the logits' inputs: a one-shot forward and the cached split path multiply different
# shapes, so their kernels round differently; a gap below this fraction of the top logit is a tie.
NEAR_TIE = {torch.float32: 2.0**-16, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-6}


def one_shot_scores(
    session: DeepSeekOCRSession,
    image: ImageInput,
    tokens: list[int],
    options: DecodeOptions,
    mode: str | None = None,
) -> torch.Tensor:
    """The scores one-shot generation picks from at every step given the same prefix: a single
    cache-free forward over prompt + `tokens` (teacher forcing), each step's logits after the n-gram
    ban of its own prefix. [len(tokens), vocab] float32 on the host."""
    page = session.prepare(image, None, mode)
    model = session.model
    with torch.inference_mode():
        clock = StageClock(session.device, nvtx_enabled=False, timing_enabled=False, stages=session.stages)
        with clock.stage("prefill"):
            image_embeds = session.encode_image(session.upload(page), clock)
        ids = torch.cat([page.input_ids, torch.tensor(tokens[:-1], dtype=torch.int64)]).to(session.device)
        embeds = model.embed(ids).unsqueeze(0)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[: page.prompt_tokens] = page.images_seq_mask
        embeds[0, mask.to(session.device)] = image_embeds.to(embeds.dtype)
        positions = torch.arange(ids.numel(), device=session.device).unsqueeze(0)
        hidden = model.language_model(
            inputs_embeds=embeds, position_ids=positions, use_cache=False
        ).last_hidden_state
        logits = model.logits(hidden[0, page.prompt_tokens - 1:])
        ban = NGramBan.create(page.input_ids.to(session.device), ids.numel() + 1, options)
        scores = []
        for step, token in enumerate(tokens):
            scores.append(ban(logits[step: step + 1]).float().cpu())
            ban.append(torch.tensor([token], device=session.device))
    return torch.cat(scores)


def one_shot_choices(
    session: DeepSeekOCRSession,
    image: ImageInput,
    tokens: list[int],
    options: DecodeOptions,
    mode: str | None = None,
) -> list[tuple[int, float, float]]:
    """What one-shot generation picks at every step given the same prefix (`one_shot_scores`). If every
    pick equals `tokens`, free-running one-shot generation reproduces them (by induction).

    Returns (pick, logit of the pick, logit of `tokens[step]`) per step, after the n-gram ban."""
    scores = one_shot_scores(session, image, tokens, options, mode)
    picks = []
    for step, token in enumerate(tokens):
        pick = int(select_token(scores[step: step + 1], options))
        picks.append((pick, float(scores[step, pick]), float(scores[step, token])))
    return picks


@dataclass(frozen=True)
class KvGrowth:
    """The cache fill of a split-path job, read after prefill and after every decode step."""

    prompt_tokens: int
    after_prefill: int
    after_steps: list[int]
    clock: StageClock  # the job's stages, finished


def split_kv_growth(
    session: DeepSeekOCRSession,
    image: ImageInput,
    steps: int,
    options: DecodeOptions,
    mode: str | None = None,
) -> KvGrowth:
    """Run the split path for `steps` decode steps, reading the cache fill after prefill and after
    every step."""
    options = replace(options, ignore_eos=True)  # every step runs
    fills: list[int] = []
    run = session.run_on_device(
        session.prepare(image, None, mode),
        steps + 1,
        options,
        return_text=False,
        after_step=lambda job, _: fills.append(job.buffers.kv_length),
    )
    run.finish()  # finishes the clock
    return KvGrowth(run.page.prompt_tokens, fills[0], fills[1:], run.clock)


def run_checks(
    session: DeepSeekOCRSession, image: ImageInput, max_new_tokens: int = 32, mode: str | None = None
) -> list[CheckResult]:
    options = DecodeOptions(ignore_eos=True)  # a fixed length makes the comparison total
    result = session.run_inference(image, mode=mode, max_new_tokens=max_new_tokens, infer=options)
    picks = one_shot_choices(session, image, result.token_ids, options, mode)
    tolerance = NEAR_TIE.get(session.dtype, 0.0)
    mismatches: list[int] = []
    ties: list[int] = []
    for step, (token, (pick, best, chosen)) in enumerate(zip(result.token_ids, picks, strict=True)):
        if token != pick:
            (ties if best - chosen <= tolerance * max(1.0, abs(best)) else mismatches).append(step)
    identical = len(picks) - len(mismatches) - len(ties)
    detail = f"{identical} of {len(picks)} tokens identical"
    if ties:
        detail += f", {len(ties)} near-tied in {str(session.dtype).removeprefix('torch.')} (steps {ties[:5]})"
    if mismatches:
        detail += f"; first divergence at token {mismatches[0]} ({len(mismatches)} differ beyond rounding)"
    checks = [CheckResult("split decode == one-shot generation (greedy)", not mismatches, detail)]

    growth = split_kv_growth(session, image, max_new_tokens - 1, options, mode)
    fills, clock = growth.after_steps, growth.clock
    expected = [growth.prompt_tokens + step for step in range(1, max_new_tokens)]
    checks.append(CheckResult(
        "KV cache grows by exactly one per decode step",
        growth.after_prefill == growth.prompt_tokens and fills == expected,
        f"after prefill {growth.after_prefill} (prompt {growth.prompt_tokens}); after {len(fills)} steps "
        f"{fills[-1:]}",
    ))

    counts = {name: clock.count(name) for name in session.stages if name in VISION_STAGES}
    outside_prefill = [
        e.name for e in clock.entries if e.name in VISION_STAGES and clock.parent_name(e) != "prefill"
    ]
    checks.append(CheckResult(
        "vision stages ran exactly once per job, inside prefill",
        all(count == 1 for count in counts.values()) and not outside_prefill and result.vision_calls == 1,
        ", ".join(f"{name}×{count}" for name, count in counts.items())
        + (f"; outside prefill: {', '.join(outside_prefill)}" if outside_prefill else ""),
    ))

    pushes = [name for kind, name in clock.nvtx_log if kind == "push"]
    pops = [name for kind, name in clock.nvtx_log if kind == "pop"]
    checks.append(CheckResult(
        "NVTX ranges balanced and timings nested",
        sorted(pushes) == sorted(pops) and clock.nesting_ok(),
        f"{len(pushes)} pushes, {len(pops)} pops",
    ))
    return checks


def teacher_forced_top1(
    session: DeepSeekOCRSession,
    image: ImageInput,
    forced: list[int],
    options: DecodeOptions,
    mode: str | None = None,
) -> list[int]:
    """The session's own split path (its kernels, its compiled step) fed `forced` tokens: the top-1 it
    picks at every step, each from the forced prefix."""
    options = replace(options, ignore_eos=True)  # one pick per forced token, EOS or not
    picks: list[int] = []

    def pick_then_force(job: PageJob, step: int) -> None:
        picks.append(job.token(step))
        job.write_token(step, forced[step])

    clock = StageClock(session.device, nvtx_enabled=False, timing_enabled=False, stages=session.stages)
    session.run_on_device(
        session.prepare(image, None, mode),
        len(forced),
        options,
        clock=clock,
        return_text=False,
        after_step=pick_then_force,
    )
    return picks


def teacher_forced_agreement(
    session_a: DeepSeekOCRSession, session_b: DeepSeekOCRSession, image: ImageInput, steps: int = 256,
    mode: str | None = None,
) -> float:
    """Fraction of steps where B's top-1 equals A's greedy token, B teacher-forced on A's tokens."""
    options = DecodeOptions(ignore_eos=True)
    reference = session_a.run_inference(image, mode=mode, max_new_tokens=steps, infer=options).token_ids
    picks = teacher_forced_top1(session_b, image, reference, options, mode)
    return sum(a == b for a, b in zip(reference, picks, strict=True)) / len(reference)
