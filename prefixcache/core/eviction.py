"""Eviction policies: where freed blocks go in the free queue, and so which block is
evicted next.

Blocks are always taken from the head of the free queue; a policy only decides how blocks
whose last reference was just dropped are *released* into it. Every policy is a
:class:`~prefixcache.core.block.FreeKVCacheBlockQueue` (the block pool exposes it as
``free_block_queue``) with one extra method:

``release(blocks)``
    ``blocks`` just reached ``ref_cnt == 0``, given in the design's append order: a
    request's block table reversed, so its deepest (least reusable) block comes first.

Policies:

``lru`` (default — the design)
    Append every released block to the tail in the given order. The head is the least
    recently used block, and a request's tail blocks are evicted before its prefix.
``unhashed-first`` (vLLM 0.33's order)
    Released blocks that hold no cached content (partial tails, or any block when caching
    is off) go to the head, most recently released first, so they are reused before any
    cached block is evicted; cached blocks are appended as in ``lru``.

New policies register in :data:`EVICTION_POLICIES`.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.core.block import FreeKVCacheBlockQueue, KVCacheBlock


class LRUFreeBlockQueue(FreeKVCacheBlockQueue):
    """The design's order: released blocks join the tail in the order given."""

    policy_name = "lru"

    def release(self, blocks: list[KVCacheBlock]) -> None:
        self.append_n(blocks)


class UnhashedFirstFreeBlockQueue(FreeKVCacheBlockQueue):
    """Blocks without a hash jump to the head; cached blocks join the tail."""

    policy_name = "unhashed-first"

    def release(self, blocks: list[KVCacheBlock]) -> None:
        unhashed = [block for block in blocks if block.block_hash is None]
        if not unhashed:
            self.append_n(blocks)
            return
        self.prepend_n(unhashed)
        self.append_n([block for block in blocks if block.block_hash is not None])


EVICTION_POLICIES: dict[str, type[FreeKVCacheBlockQueue]] = {
    LRUFreeBlockQueue.policy_name: LRUFreeBlockQueue,
    UnhashedFirstFreeBlockQueue.policy_name: UnhashedFirstFreeBlockQueue,
}
DEFAULT_EVICTION_POLICY = LRUFreeBlockQueue.policy_name


def make_free_block_queue(
    policy_name: str, blocks: Iterable[KVCacheBlock]
) -> FreeKVCacheBlockQueue:
    """The free queue of policy ``policy_name``, initially holding ``blocks`` in order."""
    try:
        policy = EVICTION_POLICIES[policy_name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy_name!r}; choose one of "
            f"{', '.join(EVICTION_POLICIES)}"
        ) from None
    return policy(blocks)
