"""Decode policy: the no-repeat n-gram ban and token selection, on the device with static shapes.

Nothing here reads a tensor back to the host, and every shape is fixed by the buffer capacity and
the vocabulary, so the engine can put `NGramBan.__call__` / `append` and `select_token` inside a
compiled decode step or a CUDA graph. Options (n, window, temperature, top-k, top-p) are Python
values fixed for a job; a compiled step specializes on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.errors import InputError

# The vendor vocabulary (129,280) is 128 rows of 1,010 scores.
ARGMAX_ROWS = 128


def ban_repeated_ngrams(
    logits: Tensor,
    tokens: Tensor,
    length: Tensor,
    n: int,
    window: int | None = None,
    whitelist: Tensor | None = None,
    search_from: Tensor | int = 0,
) -> Tensor:
    """Set to -inf, row by row, every token that would complete an n-gram already in `tokens[:length]`.

    logits: [R, V] scores for each row's next token. tokens: [R, C] int64 ids (prompt then output), or
    [C] for one row, valid up to `length` ([R], or 0-d for one row; whatever lies beyond must still be
    ids in [0, V)). With `window` None this is transformers' NoRepeatNGramLogitsProcessor over the whole
    sequence (the vendor's HF `infer()`); with a window only n-grams inside the last `window` tokens and
    at or after `search_from` ([R], 0-d or a Python int) are searched (the vendor vLLM processor, which
    sees generated tokens only: pass the prompt length), and `whitelist` ids are never banned.
    """
    if n <= 0:
        return logits
    rows, vocab = logits.shape
    tokens, length = tokens.view(rows, -1), length.view(rows, 1)
    device = tokens.device
    windows = tokens.unfold(1, n, 1)  # [R, C - n + 1, n]: every n-gram start, valid or not
    starts = torch.arange(windows.shape[1], device=device)
    # The current suffix: the last n - 1 tokens, which the next token would turn into an n-gram.
    suffix = tokens.gather(1, (length - (n - 1) + torch.arange(n - 1, device=device)).clamp(min=0))
    # Python scalars stay scalars: a tensor made from one would be a host-to-device copy per step.
    floor = search_from.view(rows, 1) if isinstance(search_from, Tensor) else search_from
    valid = (starts <= length - n) & (starts >= floor)
    if window is not None:
        valid &= starts >= length - window
    hit = valid & (windows[:, :, : n - 1] == suffix.unsqueeze(1)).all(dim=-1)
    # Misses write to a spare column past the vocabulary, so every write is a True.
    banned = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, torch.where(hit, windows[:, :, n - 1], vocab), True)
    if whitelist is not None:
        banned.index_fill_(1, whitelist, False)
    return logits.masked_fill(banned[:, :vocab], float("-inf"))


@dataclass
class NGramBan:
    """The no-repeat n-gram state of one job: a preallocated token buffer (prompt + output) and its
    length, both on the device and updated in place, so a captured graph can replay them."""

    tokens: Tensor  # [capacity] int64
    length: Tensor  # 0-d int64
    prompt_length: Tensor  # 0-d int64: where the output starts (the windowed search's floor)
    n: int
    window: int | None = None
    whitelist: Tensor | None = None

    @classmethod
    def create(cls, prompt_ids: Tensor, capacity: int, options: DecodeOptions) -> NGramBan:
        """prompt_ids: [P] or [1, P] int64 on the engine's device; capacity >= P + new tokens."""
        prompt_ids = prompt_ids.reshape(-1)
        device = prompt_ids.device
        if capacity < prompt_ids.numel():
            raise ValueError(f"capacity {capacity} < prompt length {prompt_ids.numel()}")
        tokens = torch.zeros(capacity, dtype=torch.int64, device=device)
        tokens[: prompt_ids.numel()] = prompt_ids
        length = torch.tensor(prompt_ids.numel(), dtype=torch.int64, device=device)
        whitelist = None
        if options.ngram_whitelist:
            whitelist = torch.tensor(options.ngram_whitelist, dtype=torch.int64, device=device)
        return cls(
            tokens, length, length.clone(), options.no_repeat_ngram_size, options.ngram_window, whitelist
        )

    def __call__(self, logits: Tensor) -> Tensor:
        search_from = self.prompt_length if self.window is not None else 0
        return ban_repeated_ngrams(
            logits, self.tokens, self.length, self.n, self.window, self.whitelist, search_from
        )

    def append(self, token: Tensor) -> None:
        """Write the chosen token ([1] or 0-d int64, on the device) at `length` and advance it."""
        self.tokens.index_copy_(0, self.length.view(1), token.reshape(1).to(self.tokens.dtype))
        self.length.add_(1)


def step_key(options: DecodeOptions) -> tuple:
    """The options a decode step's code depends on (how a token is chosen, the n-gram ban): a compiled or
    graphed step serves every job whose key is the same, whatever its EOS, seed or repetition settings."""
    return (
        options.temperature,
        options.top_p,
        options.top_k,
        options.no_repeat_ngram_size,
        options.ngram_window,
        options.ngram_whitelist,
    )


def validate_options(options: DecodeOptions) -> None:
    """Reject options that cannot be honoured; host-side, once per job."""
    if options.temperature < 0:
        raise InputError(f"temperature must be >= 0, got {options.temperature}")
    if not 0 < options.top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {options.top_p}")
    if options.top_k < 0:
        raise InputError(f"top_k must be >= 0, got {options.top_k}")
    if options.no_repeat_ngram_size < 0:
        raise InputError(f"no_repeat_ngram_size must be >= 0, got {options.no_repeat_ngram_size}")
    if options.ngram_window is not None and options.ngram_window <= 0:
        raise InputError(f"ngram_window must be > 0, got {options.ngram_window}")


def filter_logits(logits: Tensor, options: DecodeOptions) -> Tensor:
    """Temperature, then top-k, then top-p (the order of transformers' warpers); removed tokens get
    -inf. At least one token always survives."""
    logits = logits / options.temperature
    if options.top_k > 0:
        kth = torch.topk(logits, min(options.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1.0:
        ascending, order = torch.sort(logits, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total mass is at most 1 - top_p; the most likely token stays.
        drop_sorted = cumulative <= 1 - options.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def select_token(logits: Tensor, options: DecodeOptions, generator: torch.Generator | None = None) -> Tensor:
    """The next token, [1] int64, from logits [1, V] (float32, bans already applied).

    Greedy when temperature is 0. Otherwise samples by an exponential race, argmax(p / E) with
    E ~ Exp(1), which draws from p without the host sync of torch.multinomial. `generator` seeds
    the race in eager mode; dynamo cannot trace a Generator argument, so a compiled step passes None
    and draws from the device's default generator (seed it with torch.manual_seed per job; CUDA
    graphs replay it through their registered Philox state).
    """
    if options.temperature == 0:
        return first_argmax(logits)
    probs = filter_logits(logits.float(), options).softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return first_argmax(probs / race)


def first_argmax(scores: Tensor) -> Tensor:
    """torch.argmax(scores, dim=-1) for scores [1, V], in two stages: the vocabulary in ARGMAX_ROWS rows,
    each row's first maximum, then the first row holding the best of them: the same index, ties
    included. Compiled, one argmax over the vocabulary is a single program block (inductor does not
    split an argmax); rows reduce in parallel."""
    vocab = scores.shape[-1]
    if scores.shape[0] != 1 or vocab % ARGMAX_ROWS:
        return torch.argmax(scores, dim=-1)
    rows = scores.view(ARGMAX_ROWS, vocab // ARGMAX_ROWS)
    in_row = rows.argmax(dim=-1)
    best_row = rows.gather(1, in_row.unsqueeze(1)).squeeze(1).argmax().view(1)
    return best_row * rows.shape[1] + in_row[best_row]
