import ast
import inspect
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dsocr_workers.engine import sampling
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.sampling import NGramBan, ban_repeated_ngrams, filter_logits, select_token
from dsocr_workers.errors import InputError

VOCAB = 7


def vendor_windowed_ban(generated: list[int], scores: torch.Tensor, n: int, window: int, whitelist: set[int]):
    """The vendor vLLM processor's rule (spec §9.1), written as the plain loop it is."""
    if len(generated) < n:
        return scores
    suffix = tuple(generated[len(generated) - (n - 1) :])
    banned = set()
    for i in range(max(0, len(generated) - window), len(generated) - n + 1):
        if tuple(generated[i : i + n - 1]) == suffix:
            banned.add(generated[i + n - 1])
    scores = scores.clone()
    for token in banned - whitelist:
        scores[0, token] = float("-inf")
    return scores


def buffer_with(ids: list[int], capacity: int, junk_seed: int) -> torch.Tensor:
    """A token buffer holding `ids`, with random (valid) ids past the end that the ban must ignore."""
    junk = torch.randint(0, VOCAB, (capacity,), generator=torch.Generator().manual_seed(junk_seed))
    junk[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return junk


# Few distinct tokens make repeats, and so bans, common.
sequences = st.lists(st.integers(0, 2), max_size=48)


@settings(max_examples=300, deadline=None)
@given(ids=sequences, n=st.integers(1, 6), junk_seed=st.integers(0, 2**16))
def test_full_ban_equals_transformers(ids, n, junk_seed):
    scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(junk_seed))
    expected = NoRepeatNGramLogitsProcessor(n)(torch.tensor([ids], dtype=torch.int64), scores.clone())
    tokens = buffer_with(ids, 64, junk_seed)
    got = ban_repeated_ngrams(scores.clone(), tokens, torch.tensor(len(ids)), n)
    assert torch.equal(got, expected)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2), max_size=12),
    generated=sequences,
    n=st.integers(1, 6),
    window=st.integers(1, 30),
    whitelist=st.sets(st.integers(0, VOCAB - 1), max_size=2),
    junk_seed=st.integers(0, 2**16),
)
def test_windowed_ban_equals_vendor_rule_over_generated_tokens(prompt, generated, n, window, whitelist, junk_seed):
    scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(junk_seed))
    expected = vendor_windowed_ban(generated, scores, n, window, whitelist)
    tokens = buffer_with(prompt + generated, 64, junk_seed)
    got = ban_repeated_ngrams(
        scores.clone(),
        tokens,
        torch.tensor(len(prompt) + len(generated)),
        n,
        window=window,
        whitelist=torch.tensor(sorted(whitelist), dtype=torch.int64) if whitelist else None,
        search_from=torch.tensor(len(prompt)),
    )
    assert torch.equal(got, expected)


def test_windowed_ban_forgets_ngrams_outside_the_window():
    # "0 1 2" occurs at the start; the suffix is "0 1" again at the end.
    ids = [0, 1, 2] + [3, 4, 5, 6] * 3 + [0, 1]
    scores = torch.zeros(1, VOCAB)
    length = torch.tensor(len(ids))
    full = ban_repeated_ngrams(scores, buffer_with(ids, 32, 0), length, 3)
    assert full[0, 2] == float("-inf")
    windowed = ban_repeated_ngrams(scores, buffer_with(ids, 32, 0), length, 3, window=5)
    assert torch.isfinite(windowed).all()
    whitelisted = ban_repeated_ngrams(
        scores, buffer_with(ids, 32, 0), length, 3, whitelist=torch.tensor([2])
    )
    assert torch.isfinite(whitelisted).all()


def test_ngram_ban_state_matches_transformers_while_generating():
    options = DecodeOptions(no_repeat_ngram_size=3)
    prompt = torch.tensor([1, 2, 3, 1, 2])
    ban = NGramBan.create(prompt, capacity=40, options=options)
    history = prompt.tolist()
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        scores = torch.randn(1, VOCAB, generator=gen)
        expected = NoRepeatNGramLogitsProcessor(3)(torch.tensor([history]), scores.clone())
        got = ban(scores.clone())
        assert torch.equal(got, expected)
        token = select_token(got, options)
        ban.append(token)
        history.append(int(token))
    assert int(ban.length) == len(history)
    assert ban.tokens[: len(history)].tolist() == history


def test_ngram_ban_zero_size_disables():
    ban = NGramBan.create(torch.tensor([1, 1, 1, 1]), 8, DecodeOptions(no_repeat_ngram_size=0))
    scores = torch.randn(1, VOCAB)
    assert torch.equal(ban(scores), scores)


def test_greedy_is_argmax():
    logits = torch.randn(1, 1000)
    assert select_token(logits, DecodeOptions()).tolist() == [int(logits.argmax())]
    assert select_token(logits, DecodeOptions()).dtype == torch.int64


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    options = DecodeOptions(temperature=1.0, seed=0)
    logits = torch.zeros(1, 1000)  # uniform: every draw depends on the generator alone

    def draws(seed):
        gen = torch.Generator().manual_seed(seed)
        return [int(select_token(logits, options, gen)) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    gen = torch.Generator().manual_seed(0)
    options = DecodeOptions(temperature=1.0)
    counts = torch.bincount(
        torch.cat([select_token(probs.log(), options, gen) for _ in range(4000)]), minlength=3
    )
    assert torch.allclose(counts / 4000, probs[0], atol=0.03)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 40), temperature=st.floats(0.1, 3.0))
def test_top_k_equals_transformers(seed, top_k, temperature):
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(seed))
    expected = TopKLogitsWarper(top_k)(None, logits / temperature)
    got = filter_logits(logits, DecodeOptions(temperature=temperature, top_k=top_k))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[torch.isfinite(got)], expected[torch.isfinite(expected)])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**16), top_p=st.floats(0.01, 0.99), temperature=st.floats(0.1, 3.0))
def test_top_p_equals_transformers(seed, top_p, temperature):
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(seed)) * 3
    expected = TopPLogitsWarper(top_p)(None, logits / temperature)
    got = filter_logits(logits, DecodeOptions(temperature=temperature, top_p=top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.isfinite(got).any()


def test_sampling_never_picks_a_filtered_token():
    logits = torch.arange(10, dtype=torch.float32).view(1, -1)
    gen = torch.Generator().manual_seed(1)
    picks = {int(select_token(logits, DecodeOptions(temperature=5.0, top_k=3), gen)) for _ in range(300)}
    assert picks == {7, 8, 9}
    banned = logits.clone()
    banned[0, 9] = float("-inf")
    picks = {int(select_token(banned, DecodeOptions(temperature=5.0, top_k=3), gen)) for _ in range(300)}
    assert 9 not in picks


@pytest.mark.parametrize(
    "options",
    [
        DecodeOptions(temperature=-1.0),
        DecodeOptions(top_p=0.0),
        DecodeOptions(top_p=1.5),
        DecodeOptions(top_k=-2),
        DecodeOptions(no_repeat_ngram_size=-1),
        DecodeOptions(ngram_window=0),
    ],
)
def test_bad_options_are_input_errors(options):
    with pytest.raises(InputError):
        sampling.validate_options(options)


HOST_SYNCS = {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize", "multinomial"}


@pytest.mark.parametrize(
    "function",
    [ban_repeated_ngrams, NGramBan.__call__, NGramBan.append, filter_logits, select_token],
)
def test_step_path_has_no_host_sync(function):
    # On the CPU a sync cannot be observed, so keep the step path free of the calls that make one.
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not called & HOST_SYNCS
    # int(t), float(t), bool(t) of a tensor read it back too; float("-inf") of a literal does not.
    conversions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") in {"int", "float", "bool"}
        and not all(isinstance(arg, ast.Constant) for arg in node.args)
    ]
    assert not conversions


def test_tiny_top_p_keeps_the_most_likely_token():
    # 1 - 1e-9 rounds to 1.0 in float32, so every cumulative mass is "in the tail": the top token
    # must still survive.
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(5))
    kept = torch.isfinite(filter_logits(logits, DecodeOptions(temperature=1.0, top_p=1e-9)))
    assert kept.sum() == 1 and kept[0, logits.argmax()]
