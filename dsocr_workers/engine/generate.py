"""The inference core, gpt-fast style: `prefill()` runs the language model once over the prompt (image
embeddings already scattered in) and fills a static KV cache; `decode_one_token()` feeds the last token
back and picks the next one, entirely on the device.

Decode state lives in preallocated device tensors (the token buffer of `NGramBan`, prompt + output, and
its length; the cache's own fill counter), updated in place, so the `fast` engine can compile the step
once and replay it as a CUDA graph: no host sync and no allocation per token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.sampling import NGramBan, select_token
from dsocr_workers.engine.stopping import REPETITION_WINDOW, ends_in_loop, loop_check_due
from dsocr_workers.model.config import EOS_TOKEN_ID
from dsocr_workers.model.decoder import CACHE_ARGUMENT
from dsocr_workers.model.interface import OCRModel

MIN_CACHE_BUCKET = 1024
# Checks (engine/stopping.py's cadence) in flight before the host waits for the oldest: the device
# still has that many intervals of steps queued, so it never runs dry. At most
# (EOS_LOOKAHEAD + 1) * EOS_CHECK_INTERVAL steps are computed past EOS, counted as wasted steps.
EOS_LOOKAHEAD = 2


def cache_bucket(needed: int, max_positions: int) -> int:
    """Cache sizes come in powers of two (≥ 1024, ≤ the model's positions): a compiled decode step
    specialises on the cache shape, so a handful of buckets bounds recompilation, while a cache sized
    to the job keeps decode attention from reading thousands of empty positions."""
    bucket = MIN_CACHE_BUCKET
    while bucket < needed:
        bucket *= 2
    return min(bucket, max_positions)


class _BucketLayer(StaticLayer):
    """transformers' static cache layer, telling the attention mask its length as the size of its
    tensors rather than as the Python int it was built with: a compiled step would take that int as a
    constant, the same in every bucket, and compile again for the next one."""

    def get_mask_sizes(self, *args: object, **kwargs: object) -> tuple[int, int]:
        assert self.keys is not None, "allocated by early_initialization"
        return self.keys.shape[2], 0


@dataclass
class DecodeBuffers:
    """Static per-bucket state reused by every job of a session: the KV cache and the token buffer."""

    cache: StaticCache
    tokens: torch.Tensor  # [capacity] int64, prompt then output
    length: torch.Tensor  # 0-d int64: tokens written so far
    prompt_length: torch.Tensor  # 0-d int64
    host_tokens: torch.Tensor  # [capacity] int64, pinned on CUDA: where the output is read back
    eos_flags: torch.Tensor  # [EOS_LOOKAHEAD + 2] bool, pinned on CUDA: EosWatch's slots
    cache_bytes: int  # keys and values of every layer
    # The n-gram state over these buffers, kept while the job options allow: a compiled step guards
    # on its argument objects, and a fresh one per job would recompile the step.
    _bans: dict[tuple, NGramBan] = field(default_factory=dict)

    @classmethod
    def allocate(cls, model: OCRModel, capacity: int, device: torch.device) -> DecodeBuffers:
        config = model.language_model.config
        text, dtype = model.config.text, model.lm_head.weight.dtype
        cache = StaticCache(config=config, max_cache_len=capacity)
        # Allocate (and mark static) now rather than lazily at the first update, which would happen
        # inside the compiled prefill where static addresses cannot be marked.
        cache.early_initialization(
            batch_size=1,
            num_heads=text.num_key_value_heads,
            head_dim=text.head_dim,
            dtype=dtype,
            device=device,
        )
        cache_bytes = (
            2 * len(cache.layers) * text.num_key_value_heads * capacity * text.head_dim * dtype.itemsize
        )
        tokens = torch.zeros(capacity, dtype=torch.int64, device=device)
        # One compiled decode step for every bucket: the capacity is a symbol from the first compilation,
        # not a constant that the second bucket would compile again.
        torch._dynamo.maybe_mark_dynamic(tokens, 0)
        for layer in cache.layers:
            if type(layer) is StaticLayer:  # every layer of this model: full attention
                layer.__class__ = _BucketLayer
                torch._dynamo.maybe_mark_dynamic(layer.keys, 2)
                torch._dynamo.maybe_mark_dynamic(layer.values, 2)
        length = torch.zeros((), dtype=torch.int64, device=device)
        prompt_length = torch.zeros((), dtype=torch.int64, device=device)
        if device.type == "cuda":
            # In-place updates of graph inputs are only replayable at fixed addresses.
            for tensor in (tokens, length, prompt_length):
                torch._dynamo.mark_static_address(tensor)
        pinned = device.type == "cuda"
        host_tokens = torch.zeros(capacity, dtype=torch.int64, pin_memory=pinned)
        eos_flags = torch.zeros(EOS_LOOKAHEAD + 2, dtype=torch.bool, pin_memory=pinned)
        return cls(cache, tokens, length, prompt_length, host_tokens, eos_flags, cache_bytes)

    def start(self, prompt_tokens: int, options: DecodeOptions) -> NGramBan:
        """A new job whose prompt's ids are in `tokens[:prompt_tokens]` (`DeepSeekOCRSession.upload` puts
        them there): its n-gram state over these buffers. The cache keeps what the last job left: a prefill
        fills it from slot 0, and no query reads a slot past its own position before decoding writes it."""
        self.length.fill_(prompt_tokens)
        self.prompt_length.fill_(prompt_tokens)
        key = (options.no_repeat_ngram_size, options.ngram_window, options.ngram_whitelist)
        if key not in self._bans:
            whitelist = None
            if options.ngram_whitelist:
                whitelist = torch.tensor(
                    options.ngram_whitelist, dtype=torch.int64, device=self.tokens.device
                )
            self._bans[key] = NGramBan(self.tokens, self.length, self.prompt_length, *key[:2], whitelist)
        return self._bans[key]

    @property
    def kv_length(self) -> int:
        """Cache fill (a host sync: for checks, not for the timed path)."""
        return int(self.cache.get_seq_length())

    def read_tokens(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] on the host: one copy into pinned memory, then a wait for that copy alone."""
        count = stop - start
        if self.tokens.device.type != "cuda":
            return self.tokens[start:stop].tolist()
        self.host_tokens[:count].copy_(self.tokens[start:stop], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return self.host_tokens[:count].tolist()


@dataclass
class _Check:
    slot: int
    event: torch.cuda.Event


class EosWatch:
    """Whether EOS is among the tokens written so far, without stalling the device.

    Every EOS_CHECK_INTERVAL steps a check is enqueued behind the decode steps: a flag computed on the
    device and copied to a pinned host slot, then an event. The host reads a check once its event has
    fired (`query`, no wait), and waits for one only when EOS_LOOKAHEAD newer checks are queued behind
    it, i.e. while the device still has that many intervals of steps to run. On the CPU the work is
    synchronous anyway and each check is read at once."""

    def __init__(self, buffers: DecodeBuffers, prompt_tokens: int, enabled: bool) -> None:
        self.buffers = buffers
        self.prompt_tokens = prompt_tokens
        self.enabled = enabled
        self.cuda = buffers.tokens.device.type == "cuda"
        self._pending: deque[_Check] = deque()
        self._next_slot = 0

    def seen(self, steps: int) -> bool:
        """Call before each decode step with the steps run so far; True once EOS is known written."""
        if not self.enabled or not loop_check_due(steps):
            return False
        written = self.buffers.tokens[self.prompt_tokens : self.prompt_tokens + 1 + steps]
        if not self.cuda:
            return bool((written == EOS_TOKEN_ID).any())
        flags = self.buffers.eos_flags
        slot = self._next_slot
        self._next_slot = (slot + 1) % flags.numel()
        flags[slot : slot + 1].copy_((written == EOS_TOKEN_ID).any().view(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append(_Check(slot, event))
        while self._pending and (len(self._pending) > EOS_LOOKAHEAD or self._pending[0].event.query()):
            check = self._pending.popleft()
            check.event.synchronize()
            if bool(flags[check.slot]):
                return True
        return False


class RepetitionWatch:
    """Whether the tokens written so far end in a repetition loop (engine/loops.py), looked at with the
    EOS watch's cadence and without stalling the device either.

    On CUDA every EOS_CHECK_INTERVAL steps the tokens written since the last look are copied behind the
    decode steps into the pinned host buffer, then an event; a look runs once its event has fired, and
    waits only when EOS_LOOKAHEAD newer looks are queued. On the CPU the tokens are read directly. Off,
    `seen` returns at once: nothing is copied and nothing waits."""

    def __init__(self, buffers: DecodeBuffers, prompt_tokens: int, enabled: bool) -> None:
        self.buffers = buffers
        self.prompt_tokens = prompt_tokens
        self.enabled = enabled
        self.cuda = buffers.tokens.device.type == "cuda"
        self._pending: deque[tuple[int, torch.cuda.Event]] = deque()  # (tokens on the host, copy done)
        self._copied = 0

    def seen(self, steps: int) -> bool:
        """Call before each decode step with the steps run so far; True once a loop is known."""
        if not self.enabled or not loop_check_due(steps):
            return False
        written = 1 + steps
        start = self.prompt_tokens
        if not self.cuda:
            return self._loops(self.buffers.tokens[start : start + written])
        host = self.buffers.host_tokens
        host[self._copied : written].copy_(
            self.buffers.tokens[start + self._copied : start + written], non_blocking=True
        )
        self._copied = written
        event = torch.cuda.Event()
        event.record()
        self._pending.append((written, event))
        while self._pending and (len(self._pending) > EOS_LOOKAHEAD or self._pending[0][1].query()):
            count, event = self._pending.popleft()
            event.synchronize()
            if self._loops(host[:count]):
                return True
        return False

    @staticmethod
    def _loops(tokens: torch.Tensor) -> bool:
        return ends_in_loop(tokens[-REPETITION_WINDOW:].tolist())


def prefill(model: OCRModel, embeds: torch.Tensor, cache: StaticCache) -> torch.Tensor:
    """One forward over the whole prompt (positions 0..L-1) into `cache` from slot 0, whatever it held;
    returns the last position's logits [1, V]."""
    layers: list[StaticLayer] = cache.layers  # type: ignore[assignment]  # as DecodeBuffers allocates
    for layer in layers:
        layer.cumulative_length.zero_()
    positions = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
    hidden = model.language_model(
        inputs_embeds=embeds, position_ids=positions, use_cache=True, **{CACHE_ARGUMENT: cache}
    ).last_hidden_state
    return model.logits(hidden[:, -1])


def choose_token(
    logits: torch.Tensor, ban: NGramBan, options: DecodeOptions, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ban repeated n-grams, pick a token, append it to the sequence buffer. Returns it, [1] int64."""
    token = select_token(ban(logits), options, generator)
    ban.append(token)
    return token


def decode_one_token(
    model: OCRModel, cache: StaticCache, ban: NGramBan, options: DecodeOptions
) -> torch.Tensor:
    """Feed the last token of the buffer at its position, choose the next one. Everything it reads and
    writes is a device tensor at a fixed address; the Python arguments are fixed per job."""
    position = (ban.length - 1).view(1, 1)
    token = ban.tokens[position.view(1)].view(1, 1)
    hidden = model.language_model(
        inputs_embeds=model.embed(token), position_ids=position, use_cache=True, **{CACHE_ARGUMENT: cache}
    ).last_hidden_state
    return choose_token(model.logits(hidden[:, -1]), ban, options)
