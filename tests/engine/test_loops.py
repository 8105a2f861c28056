"""The repetition-loop detector on constructed token sequences: loops of several periods, loops that
start late, and near-loops that must not count."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsocr_workers.engine.loops import LOOP_MIN_REPEATS, LOOP_MIN_TOKENS, RepetitionLoop, find_loop


def distinct(count: int, first: int = 1000) -> list[int]:
    """Ids that never repeat (and never equal the small ids units are made of)."""
    return list(range(first, first + count))


def test_the_thresholds_the_cases_below_assume():
    assert (LOOP_MIN_REPEATS, LOOP_MIN_TOKENS) == (3, 32)


@pytest.mark.parametrize(("unit", "copies"), [([7], 40), ([1, 2, 3], 20), (list(range(7)), 9),
                                              (list(range(70)), 4), (list(range(500)), 3)])
def test_loops_of_several_periods_running_to_the_end(unit, copies):
    prefix = distinct(25)
    tokens = prefix + unit * copies
    loop = find_loop(tokens)
    # The unit's first copy is where the loop begins; every token after it is a wasted step.
    assert loop == RepetitionLoop(start=25, period=len(unit), wasted_steps=len(unit) * (copies - 1))
    assert loop.repeats == copies


def test_a_partial_last_copy_still_counts():
    tokens = distinct(10) + [4, 5, 6, 8] * 12 + [4, 5]  # cut by the budget inside a copy
    assert find_loop(tokens) == RepetitionLoop(start=10, period=4, wasted_steps=4 * 11 + 2)


def test_a_loop_that_starts_late():
    tokens = distinct(3000) + [9, 8, 7, 6, 5] * 200
    loop = find_loop(tokens)
    assert loop is not None and (loop.start, loop.period) == (3000, 5)
    assert loop.wasted_steps == len(tokens) - 3000 - 5


def test_the_start_is_the_first_token_after_the_last_break():
    # One token changed in the third copy: the tokens from there on still repeat, so the loop begins
    # right after the changed token (the definition: every later token equals the one a period before).
    unit = list(range(10))
    tokens = distinct(5) + unit * 12
    changed = 5 + 2 * 10 + 4
    tokens[changed] = 99
    loop = find_loop(tokens)
    assert loop is not None and loop.start == changed + 1 and loop.period == 10


def test_the_shortest_period_is_reported():
    tokens = distinct(8) + [1, 2] * 40  # also periodic with 4, 6, …
    assert find_loop(tokens) == RepetitionLoop(start=8, period=2, wasted_steps=78)


@pytest.mark.parametrize("case", [
    "broken_before_the_end", "last_copy_changed", "two_copies", "short_tail", "table_rows", "ngram_banned",
])  # fmt: skip
def test_near_loops_do_not_count(case):
    unit = list(range(40))
    tokens = {
        # repeated for a long while, then the model moved on: not a loop that runs to the budget
        "broken_before_the_end": distinct(10) + unit * 10 + distinct(30, first=5000),
        # the last copy differs in its last token
        "last_copy_changed": distinct(10) + unit * 10 + unit[:-1] + [77],
        # a paragraph written twice is not a loop
        "two_copies": distinct(10) + unit * 2,
        # a rule of 31 identical tokens at the budget
        "short_tail": distinct(10) + [3] * 31,
        # the same row structure with new content in every cell
        "table_rows": [t for row in range(60) for t in (1, 2000 + row, 3, 4000 + row, 5)],
        # what the vendor's no-repeat 20-gram ban leaves of a loop: a token changed every 20 tokens
        "ngram_banned": [800 + i // 20 if i % 20 == 19 else unit[i % 40] for i in range(1200)],
    }[case]
    assert find_loop(tokens) is None


def test_empty_and_tiny_outputs():
    assert find_loop([]) is None
    assert find_loop([1]) is None
    assert find_loop([5] * LOOP_MIN_TOKENS) == RepetitionLoop(start=0, period=1, wasted_steps=LOOP_MIN_TOKENS - 1)


@given(
    prefix=st.lists(st.integers(0, 50), max_size=60),
    unit=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    copies=st.integers(3, 12),
)
def test_any_periodic_tail_is_found_and_satisfies_the_definition(prefix, unit, copies):
    tokens = prefix + unit * copies
    loop = find_loop(tokens)
    if len(unit) * copies < LOOP_MIN_TOKENS:
        return  # too short to be called a loop; what a shorter tail gives is covered above
    assert loop is not None
    assert loop.start <= len(prefix)  # the loop may begin earlier, where the prefix already repeats
    assert all(tokens[i] == tokens[i - loop.period] for i in range(loop.start + loop.period, len(tokens)))
    assert loop.start == 0 or tokens[loop.start - 1] != tokens[loop.start - 1 + loop.period]
    assert loop.period <= len(unit) and loop.wasted_steps == len(tokens) - loop.start - loop.period


def test_a_long_random_output_is_fast_and_loop_free():
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(8192)]
    assert find_loop(tokens) is None
