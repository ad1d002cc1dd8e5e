"""The scheduler -> model runner hand-off for one sequence in one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.lora.adapter import LoRAAdapter


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's work in a step.

    Contract: the sequence's first `start_position` tokens already have K/V in the blocks of
    `block_ids`; this step computes `token_ids` at positions `start_position ..
    start_position + len(token_ids) - 1` and writes their K/V into the same block table, which
    must therefore hold at least `ceil((start_position + len(token_ids)) / block_size)` blocks.
    A prefix-cache hit is just a larger `start_position` on a fresh request.
    `lora_adapter` is the adapter its tokens run with (None: the base model); its blocks'
    K/V were computed with the same adapter (the adapter's name is in their hashes).
    """

    request_id: str
    token_ids: list[int]  # tokens to compute this step: a prefill chunk, or 1 decode token
    start_position: int  # tokens of this sequence already in the KV cache
    block_ids: list[int]  # the request's whole block table (from the KV cache manager)
    needs_logits: bool  # the chunk ends at the last known token, so a token will be sampled
    lora_adapter: LoRAAdapter | None = None
