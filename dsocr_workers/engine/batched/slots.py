"""The batched engine's device state and decode step: pages in the slots of one static KV cache.

Each layer's keys and values are one [slots, heads, capacity, head_dim] tensor; slot `s` holds one page's
positions 0..length[s]-1. `decode_slots` feeds every row of a bucket its last token at its own position,
writes its key and value there and attends over that slot's positions, in one of two ways
(`SlotAttention`): "masked" reads each slot's whole capacity under a mask (SDPA, or the eager engine's
attention); "filled" reads only each row's filled blocks (FlexAttention over the fast engine's attention
modules). A slot that holds no page computes a throwaway row of length 1, which writes only its own
position 0. Every tensor the step touches sits at a fixed address with shapes set by the bucket, so the
step compiles once, dynamic in the bucket, under dynamo (a package per bucket where built ahead:
coldstart/aoti.py), and is captured as a CUDA graph per bucket (runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions, flex_attention
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from dsocr_workers.engine.batched.memory import CAPACITY_ALIGN
from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.engine.sampling import ban_repeated_ngrams, select_token
from dsocr_workers.model.decoder import CACHE_ARGUMENT
from dsocr_workers.model.fused import AttendingCache, FusedQKVAttention
from dsocr_workers.model.interface import OCRModel

# How a decode step's attention reads the slots: the whole capacity under a mask, or each row's filled
# blocks only.
SlotAttention = Literal["masked", "filled"]
# FlexAttention's KV block: a slot's capacity is a whole number of them.
KV_BLOCK = CAPACITY_ALIGN


@dataclass(frozen=True)
class SlotRows:
    """Rows of `SlotState` (the first n slots: a bucket; or one slot: a prefill's first token). Views:
    writes land in the state."""

    tokens: Tensor  # [n, C] int64
    length: Tensor  # [n] int64
    prompt_length: Tensor  # [n] int64
    active: Tensor  # [n] int64: 1 where a page decodes, 0 in a free slot (its length does not move)


@dataclass
class SlotState:
    """Per-slot decode state on the device, updated in place."""

    tokens: Tensor  # [S, C] int64: prompt then output
    length: Tensor  # [S] int64: tokens written
    prompt_length: Tensor  # [S] int64
    active: Tensor  # [S] int64
    visible: Tensor  # [S] int64: `length` as the filled attention's mask reads it (`refresh_visible`)
    whitelist: Tensor | None  # the n-gram ban's never-banned ids

    @classmethod
    def allocate(cls, slots: int, capacity: int, device: torch.device, options: DecodeOptions) -> SlotState:
        whitelist = None
        if options.ngram_whitelist:
            whitelist = torch.tensor(options.ngram_whitelist, dtype=torch.int64, device=device)
        state = cls(
            torch.zeros(slots, capacity, dtype=torch.int64, device=device),
            torch.ones(slots, dtype=torch.int64, device=device),
            torch.ones(slots, dtype=torch.int64, device=device),
            torch.zeros(slots, dtype=torch.int64, device=device),
            torch.ones(slots, dtype=torch.int64, device=device),
            whitelist,
        )
        if device.type == "cuda":  # graph inputs updated in place: replayable only at fixed addresses
            for tensor in (state.tokens, state.length, state.prompt_length, state.active, state.visible):
                torch._dynamo.mark_static_address(tensor)
        return state

    def refresh_visible(self) -> None:
        """`visible` = `length`: a copy kernel before a filled step (inside its CUDA graph), so the step's
        mask reads a graph input that no other input views (`FilledSlotsCache` says why)."""
        self.visible.copy_(self.length)

    def rows(self, count: int) -> SlotRows:
        return SlotRows(
            self.tokens[:count], self.length[:count], self.prompt_length[:count], self.active[:count]
        )

    def row(self, slot: int) -> SlotRows:
        pick = slice(slot, slot + 1)
        return SlotRows(self.tokens[pick], self.length[pick], self.prompt_length[pick], self.active[pick])

    def start(self, slot: int, prompt_ids: Tensor) -> None:
        """A page's prompt into `slot` (no sync): the slot decodes from the next step on."""
        count = prompt_ids.numel()
        self.tokens[slot, :count].copy_(prompt_ids, non_blocking=True)
        self.length[slot].fill_(count)
        self.prompt_length[slot].fill_(count)
        self.active[slot].fill_(1)

    def release(self, slot: int) -> None:
        """`slot` holds no page from the next step on: length 1, so its throwaway row feeds token 0 at
        position 0 and writes nothing past it."""
        self.active[slot].fill_(0)
        self.length[slot].fill_(1)
        self.prompt_length[slot].fill_(1)


@dataclass
class SlotCache:
    """Every layer's keys and values for all slots: [S, heads, capacity, head_dim] each."""

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def allocate(cls, model: OCRModel, slots: int, capacity: int, device: torch.device) -> SlotCache:
        text, dtype = model.config.text, model.lm_head.weight.dtype
        shape = (slots, text.num_key_value_heads, capacity, text.head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(text.num_hidden_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(text.num_hidden_layers)]
        if device.type == "cuda":
            for tensor in (*keys, *values):
                torch._dynamo.mark_static_address(tensor)
        return cls(keys, values)

    @staticmethod
    def bytes_per_position(model: OCRModel) -> int:
        """Keys and values of one position in every layer."""
        text = model.config.text
        return (
            2
            * text.num_hidden_layers
            * text.num_key_value_heads
            * text.head_dim
            * model.lm_head.weight.dtype.itemsize
        )

    def load_prompt(self, slot: int, prefilled: StaticCache, length: int) -> None:
        """A prompt's keys and values, as a batch-1 prefill left them in `prefilled`, into `slot`."""
        layers: list[StaticLayer] = prefilled.layers  # type: ignore[assignment]  # as DecodeBuffers allocates them
        for keys, values, layer in zip(self.keys, self.values, layers, strict=True):
            assert layer.keys is not None and layer.values is not None
            keys[slot, :, :length].copy_(layer.keys[0, :, :length])
            values[slot, :, :length].copy_(layer.values[0, :, :length])


class _StepCache:
    """What a decoder layer's attention calls `cache.update(key, value, layer_idx)` on during a batched
    step: each row's key and value written at its own position, the bucket's keys and values returned."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], positions: Tensor) -> None:
        self.keys, self.values, self.positions = keys, values, positions
        self.rows = torch.arange(positions.shape[0], device=positions.device)

    def update(
        self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.positions] = key[:, :, 0]
        values[self.rows, :, self.positions] = value[:, :, 0]
        return keys, values


class FilledSlotsCache(AttendingCache):
    """The "filled" attention's cache: the bucket's rows write their key and value at their own position,
    then FlexAttention over each row's positions 0..length-1 only. Its keys and values are every slot's
    and its batch the engine's slots: the bucket's queries are padded with rows that read no block, and
    their outputs dropped. The block mask (each bucket row's ceil(length / KV_BLOCK) leading blocks, the
    last one masked per position) is built once per step from `visible` (every slot's length), inside
    the step's CUDA graph."""

    # Compiled with its batch dynamic, FlexAttention's decoding kernel misreads rows longer than one
    # block, hence the batch of every slot; and a mask that reads lengths computed inside the graph is
    # misread too, hence `visible`, a graph input of its own (`SlotState.refresh_visible`).

    def __init__(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        length: Tensor,
        visible: Tensor,
        kernel_options: FlexKernelOptions | None,
    ) -> None:
        self.keys, self.values = keys, values
        self.kernel_options = kernel_options
        self.positions = length - 1
        rows, device = length.shape[0], length.device
        self.rows = torch.arange(rows, device=device)
        slots, capacity = keys[0].shape[0], keys[0].shape[2]
        blocks = capacity // KV_BLOCK

        def visible_positions(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx < visible[b]

        in_bucket = torch.arange(slots, device=device) < rows  # the rows past the bucket read no block
        filled = (
            torch.where(in_bucket, (visible + KV_BLOCK - 1) // KV_BLOCK, 0).to(torch.int32).view(-1, 1, 1)
        )
        order = torch.arange(blocks, dtype=torch.int32, device=device).expand(slots, 1, 1, blocks)
        self.block_mask = BlockMask.from_kv_blocks(
            filled,
            order.contiguous(),
            BLOCK_SIZE=KV_BLOCK,
            mask_mod=visible_positions,
            seq_lengths=(1, capacity),
        )

    def update_and_attend(
        self, query: Tensor, key: Tensor, value: Tensor, layer_idx: int, scaling: float
    ) -> Tensor:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.positions] = key[:, :, 0]
        values[self.rows, :, self.positions] = value[:, :, 0]
        # The queries padded to every slot by a scatter and the bucket's rows gathered back, rather than
        # concatenated and sliced: the compiler specialises a graph to the full bucket on a concatenation
        # that may be empty or a slice of the slots' dimension.
        padded = query.new_zeros(keys.shape[0], *query.shape[1:]).index_copy(0, self.rows, query)
        output = flex_attention(
            padded, keys, values, block_mask=self.block_mask, scale=scaling, kernel_options=self.kernel_options
        )
        return output.index_select(0, self.rows)  # type: ignore[union-attr]


def attention_mask(length: Tensor, capacity: int, attn_implementation: str, dtype: torch.dtype) -> Tensor:
    """[n, 1, 1, capacity]: each row sees its positions 0..length-1 (the one being written included)."""
    visible = (torch.arange(capacity, device=length.device).unsqueeze(0) < length.unsqueeze(1))[
        :, None, None, :
    ]
    return _as_mask(visible, attn_implementation, dtype)


def _as_mask(visible: Tensor, attn_implementation: str, dtype: torch.dtype) -> Tensor:
    """A boolean mask for SDPA, an additive one for the eager attention (transformers' masks for each)."""
    if attn_implementation == "eager":
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(dtype).min
        )
    return visible


def choose_tokens(logits: Tensor, rows: SlotRows, options: DecodeOptions, whitelist: Tensor | None) -> Tensor:
    """Ban repeated n-grams per row, pick each row's token, append it where the row is active. [n] int64."""
    search_from = rows.prompt_length if options.ngram_window is not None else 0
    banned = ban_repeated_ngrams(
        logits,
        rows.tokens,
        rows.length,
        options.no_repeat_ngram_size,
        options.ngram_window,
        whitelist,
        search_from,
    )
    chosen = select_token(banned, options).reshape(-1)
    # A free slot's length is 1: its write lands at index 1 of its own row and is never read.
    rows.tokens.scatter_(1, rows.length.unsqueeze(1), chosen.unsqueeze(1))
    rows.length.add_(rows.active)
    return chosen


def reads_filled_slots(model: OCRModel) -> bool:
    """Whether the model's attention modules let the batched step read only each slot's filled positions
    (the fast engine's, model/fused.py)."""
    return all(isinstance(layer.self_attn, FusedQKVAttention) for layer in model.language_model.layers)


# The tile, warps and stages swept fastest on compute capability 9.0 (docs/benchmarks.md, "The filled
# attention's kernel options"), kept to it: tiles of 128 positions in two stages need shared memory that
# GPUs with 100 KiB a multiprocessor do not have.
TUNED_CAPABILITY = (9, 0)
TUNED_TILE = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}


def filled_kernel_options(rows: int, multiprocessors: int, capability: tuple[int, int]) -> FlexKernelOptions | None:
    """The filled attention's decoding kernel options over `rows` (slots x heads) on a GPU of
    `multiprocessors` and compute `capability`; None leaves FlexAttention's own choices, which give a
    row one split once rows outnumber the multiprocessors."""
    # One thread block a row leaves staggered batches waiting on their longest rows: two splits even them
    # out. SPLIT_KV is read by flex_decoding.py, not declared in the TypedDict.
    if rows <= multiprocessors:
        return None
    tile = TUNED_TILE if capability == TUNED_CAPABILITY else {}
    return cast(FlexKernelOptions, {"SPLIT_KV": 2, **tile})


def decode_slots(
    model: OCRModel,
    keys: list[Tensor],
    values: list[Tensor],
    rows: SlotRows,
    options: DecodeOptions,
    whitelist: Tensor | None,
    visible: Tensor | None = None,
    kernel_options: FlexKernelOptions | None = None,
) -> Tensor:
    """One decode step over a bucket's rows: feed each row's last token at its position, choose the next
    one (`choose_tokens`). The "masked" attention where `visible` is None (`keys`/`values`: every layer's,
    the bucket's slots); else the "filled" one (every slot's keys and values, `visible` every slot's
    length: `SlotState.visible`; `kernel_options`: `filled_kernel_options`). Returns the tokens, [n]."""
    language_model = model.language_model
    positions = rows.length - 1
    fed = rows.tokens.gather(1, positions.unsqueeze(1))  # [n, 1]
    hidden = model.embed(fed)
    cache: FilledSlotsCache | _StepCache
    mask = None
    if visible is not None:
        cache = FilledSlotsCache(keys, values, rows.length, visible, kernel_options)
    else:
        mask = attention_mask(
            rows.length, keys[0].shape[2], language_model.config._attn_implementation, hidden.dtype
        )
        cache = _StepCache(keys, values, positions)
    last = _last_hidden(model, hidden, positions.unsqueeze(1), mask, cache)
    return choose_tokens(model.logits(last), rows, options, whitelist)


def _last_hidden(
    model: OCRModel,
    hidden: Tensor,
    position_ids: Tensor,
    mask: Tensor | None,
    cache: FilledSlotsCache | _StepCache,
) -> Tensor:
    """`hidden` [rows, n, hidden] at `position_ids` through every layer (their keys and values into
    `cache`, attending under `mask`), then the final norm of each row's last position: [rows, hidden]."""
    language_model = model.language_model
    position_embeddings = language_model.rotary_emb(hidden, position_ids)
    for layer in language_model.layers:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **{CACHE_ARGUMENT: cache},
        )
    return language_model.norm(hidden[:, -1])
