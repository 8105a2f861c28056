"""How many pages the batched engine holds at once: its KV cache sized from the token budget and the
device's free memory (`plan_kv`), and the refusal of a page that cannot fit (`PageRefused`, an input
error: final, never retried) rather than an out-of-memory error or an index out of range in a worker."""

from __future__ import annotations

from dataclasses import dataclass

from dsocr_workers.errors import InputError

# A slot's capacity is a whole number of blocks: FlexAttention's KV blocks (the "filled" attention reads
# a row's filled blocks only), whole tiles for the other kernels.
CAPACITY_ALIGN = 128
GiB = 2**30
# Kept free beyond the KV cache: the decode step's activations at the largest bucket, the graphs' pools,
# a joining page's vision and its prefill's scratch cache; a caller may ask for more.
DEFAULT_RESERVE_BYTES = 4 * GiB


class PageRefused(InputError):
    """A page the batched engine cannot hold: its prompt and token budget exceed a slot."""


@dataclass(frozen=True)
class KVPlan:
    """The batched engine's KV cache: `slots` × `capacity` positions of `bytes_per_position` each."""

    slots: int
    capacity: int  # positions per slot: the longest prompt accepted + the token budget, aligned
    max_prompt_tokens: int
    max_new_tokens: int
    bytes_per_position: int  # keys and values of every layer
    free_bytes: int | None  # the device's free memory when planned (None: a CPU, not limited)
    reserve_bytes: int
    limited_by: str  # "max_batch" (as asked) or "memory" (fewer slots fit)

    @property
    def slot_bytes(self) -> int:
        return self.capacity * self.bytes_per_position

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def describe(self) -> str:
        free = "" if self.free_bytes is None else f" of {self.free_bytes / GiB:.1f} GiB free"
        return (
            f"{self.slots} slots x {self.capacity} positions ({self.max_prompt_tokens} prompt + "
            f"{self.max_new_tokens} new) x {self.bytes_per_position / 1024:.1f} KiB = "
            f"{self.kv_bytes / GiB:.2f} GiB KV cache{free}, {self.reserve_bytes / GiB:.1f} GiB kept in "
            f"reserve; limited by {self.limited_by}"
        )

    def check_fits(self, prompt_tokens: int, budget: int) -> None:
        """Refuse a page whose positions exceed a slot, saying why."""
        needed = prompt_tokens + budget
        if needed > self.capacity:
            raise PageRefused(
                f"the page needs {needed} KV positions ({prompt_tokens} prompt + {budget} new tokens); a slot of "
                f"the batched engine holds {self.capacity} ({self.max_prompt_tokens} prompt + {self.max_new_tokens} "
                "new, sized at its start): start it with a larger max_prompt_tokens / max_new_tokens, or run "
                "this page on the batch-1 path"
            )


def plan_kv(
    max_batch: int,
    max_prompt_tokens: int,
    max_new_tokens: int,
    bytes_per_position: int,
    free_bytes: int | None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    max_positions: int | None = None,
) -> KVPlan:
    """The slots and their capacity for `max_batch` pages of up to `max_prompt_tokens` + `max_new_tokens`
    positions, within `free_bytes` less `reserve_bytes` (None: no limit, a CPU). Raises InputError where
    not one slot fits, or the budget is not positive."""
    if max_batch < 1:
        raise InputError(f"max_batch must be at least 1, got {max_batch}")
    if max_prompt_tokens < 1 or max_new_tokens < 1:
        raise InputError(
            f"max_prompt_tokens and max_new_tokens must be positive, got {max_prompt_tokens}, "
            f"{max_new_tokens}"
        )
    capacity = -(-(max_prompt_tokens + max_new_tokens) // CAPACITY_ALIGN) * CAPACITY_ALIGN
    if max_positions is not None:
        capacity = min(capacity, max_positions // CAPACITY_ALIGN * CAPACITY_ALIGN)
    slots, limited_by = max_batch, "max_batch"
    if free_bytes is not None:
        fitting = max(free_bytes - reserve_bytes, 0) // (capacity * bytes_per_position)
        if fitting < 1:
            raise InputError(
                f"not one batched slot fits: {capacity} positions x {bytes_per_position / 1024:.1f} KiB = "
                f"{capacity * bytes_per_position / GiB:.2f} GiB, with {free_bytes / GiB:.2f} GiB free and "
                f"{reserve_bytes / GiB:.1f} GiB kept in reserve"
            )
        if fitting < max_batch:
            slots, limited_by = int(fitting), "memory"
    return KVPlan(
        slots,
        capacity,
        max_prompt_tokens,
        max_new_tokens,
        bytes_per_position,
        free_bytes,
        reserve_bytes,
        limited_by,
    )
