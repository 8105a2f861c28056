"""When a page's decoding stops: one rule for the batch-1 loop and the batched scheduler. No torch, so
that a scheduler deciding on the host can import it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsocr_workers.engine.loops import find_loop
from dsocr_workers.engine.result import DecodeOptions, StopReason
from dsocr_workers.model.config import EOS_TOKEN_ID

# Decode steps between two looks at the output (EOS, a loop): the batch-1 loop's device-side watches
# and the batched engine's readback use the same cadence, so both stop on a loop at the same step.
EOS_CHECK_INTERVAL = 8
# A look for a loop reads the last this many tokens: periods up to a third of it are caught while
# decoding (a longer loop is still found afterwards, from all the tokens), at a small host cost.
REPETITION_WINDOW = 2048


@dataclass(frozen=True)
class StopRule:
    """How one page stops before its budget: at EOS unless `ignore_eos`, at a repetition loop with
    `stop_on_repetition` (DecodeOptions' fields of those names). The batched engine takes one per page,
    so pages of runs that differ only in it share a batch."""

    ignore_eos: bool = False
    stop_on_repetition: bool = False

    @classmethod
    def of(cls, options: DecodeOptions) -> StopRule:
        return cls(options.ignore_eos, options.stop_on_repetition)


def loop_check_due(steps: int) -> bool:
    """Whether the output after `steps` decode steps (the first token comes from the prefill) is looked at."""
    return steps % EOS_CHECK_INTERVAL == 0


def ends_in_loop(tokens: Sequence[int]) -> bool:
    """Whether the output so far ends in a repetition loop (engine/loops.py), over its last window."""
    return find_loop(list(tokens[-REPETITION_WINDOW:])) is not None


def trim_at_eos(tokens: list[int], options: DecodeOptions) -> list[int]:
    """The output up to and including its first EOS: steps computed past it are no part of it."""
    if options.ignore_eos or EOS_TOKEN_ID not in tokens:
        return tokens
    return tokens[: tokens.index(EOS_TOKEN_ID) + 1]


def stop_reason(
    tokens: Sequence[int], budget: int, ceiling: int, options: DecodeOptions | StopRule, repeating: bool = False
) -> StopReason | None:
    """Why decoding stops after the last of `tokens` (the output so far), None while it goes on: EOS
    first, then the token budget (`ceiling`: what the model's positions leave), then a loop that the
    caller found at the cadence above (`repeating`)."""
    if tokens and tokens[-1] == EOS_TOKEN_ID and not options.ignore_eos:
        return "eos"
    if len(tokens) >= budget:
        return "max_positions" if budget == ceiling else "max_new_tokens"
    if repeating and options.stop_on_repetition:
        return "repetition"
    return None
