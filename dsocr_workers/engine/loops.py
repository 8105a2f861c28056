"""Repetition loops: a decode whose output ends in the same run of tokens over and over, up to the
token budget (DeepSeek-OCR's best-known failure).

A loop is a periodic suffix of the generated ids: from token `start` to the last one, every token
equals the token `period` places before it, over at least `LOOP_MIN_REPEATS` copies and
`LOOP_MIN_TOKENS` tokens, reaching the end. Every token after the first copy is a wasted decode step.
Pure Python, O(n), off the timed path. With the vendor's whole-sequence no-repeat 20-gram ban an exact
repeat cannot last 20 tokens past its first copy, so loops come from decodes that turn it off or window it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LOOP_MIN_REPEATS = 3
# Shorter periodic tails happen in real output (a rule of dashes, a row of empty cells).
LOOP_MIN_TOKENS = 32


@dataclass(frozen=True)
class RepetitionLoop:
    """Where a loop begins and what it cost. `start` indexes the generated ids (id 0 is the one chosen
    from the prefill logits, id k the output of decode step k)."""

    start: int  # the first token of the unit's first copy
    period: int  # tokens per copy
    wasted_steps: int  # the decode steps after the first copy, up to the end of decoding

    @property
    def repeats(self) -> float:
        """Copies of the unit in the loop, the last one possibly partial."""
        return (self.period + self.wasted_steps) / self.period


def _common_prefix_lengths(seq: Sequence[int]) -> list[int]:
    """Z-array: z[k] = length of the longest common prefix of seq and seq[k:] (z[0] = len(seq))."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and seq[z[k]] == seq[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def find_loop(
    tokens: Sequence[int], *, min_repeats: int = LOOP_MIN_REPEATS, min_tokens: int = LOOP_MIN_TOKENS
) -> RepetitionLoop | None:
    """The loop `tokens` end in, or None. Of several periods the one whose loop starts earliest wins,
    then the shortest (a loop of period p is also one of period 2p)."""
    reverse = list(reversed(tokens))
    # On the reversed ids, z[p] counts the trailing tokens equal to the token p places before them:
    # the periodic suffix of period p spans z[p] + p tokens.
    z = _common_prefix_lengths(reverse)
    n = len(reverse)
    best: tuple[int, int] | None = None  # (span, period)
    for period in range(1, n // min_repeats + 1):
        span = z[period] + period
        if span >= max(min_repeats * period, min_tokens) and (best is None or span > best[0]):
            best = (span, period)
    if best is None:
        return None
    span, period = best
    return RepetitionLoop(start=n - span, period=period, wasted_steps=span - period)
