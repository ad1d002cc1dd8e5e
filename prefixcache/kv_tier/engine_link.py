"""What the engine does with its tier after each step: offer the blocks the step made
full (and the local hits it admitted) to the tier's background writer.

Reads need no link: the tier is the scheduler's external prefix source
(:class:`~prefixcache.core.external_prefix.ExternalPrefixSource`) as it is.
Torch-free: the caller passes the worker's ``read_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prefixcache.core.scheduler import ScheduledRequest
from prefixcache.kv_tier.tier import KVTier

ReadBlocks = Callable[[Sequence[int]], list[bytes]]


def offer_step_blocks(tier: KVTier, scheduled_requests: Iterable[ScheduledRequest],
                      block_size: int, read_blocks: ReadBlocks) -> int:
    """After a step ran: copy out and queue for the tier every block it completed, and
    every local hit of a request it admitted, that the tier wants (see
    :meth:`KVTier.wants`); returns how many were queued.

    Blocks loaded from the tier are neither: they are skipped. Call it before the next
    step, which may reuse freed blocks for other content."""
    block_hashes_to_store: list[bytes] = []
    token_ids_to_store: list[list[int]] = []
    block_ids_to_read: list[int] = []
    offered: set[bytes] = set()
    wants = tier.wants
    for scheduled in scheduled_requests:
        request = scheduled.request
        block_hashes = request.block_hashes
        end_block = min((scheduled.start_position + scheduled.num_new_tokens) // block_size,
                        len(block_hashes))
        computed_blocks = range(scheduled.start_position // block_size, end_block)
        hit_blocks = range(scheduled.num_hit_tokens // block_size)
        for blocks in (hit_blocks, computed_blocks):
            for i in blocks:
                block_hash = block_hashes[i]
                if block_hash in offered or not wants(block_hash):
                    continue
                offered.add(block_hash)
                block_hashes_to_store.append(block_hash)
                token_ids_to_store.append(request.all_token_ids[i * block_size:
                                                                (i + 1) * block_size])
                block_ids_to_read.append(scheduled.block_ids[i])
    if not block_ids_to_read:
        return 0
    payloads = read_blocks(block_ids_to_read)
    num_queued = 0
    for block_hash, token_ids, payload in zip(block_hashes_to_store, token_ids_to_store,
                                              payloads, strict=True):
        num_queued += tier.store(block_hash, token_ids, payload)
    return num_queued
