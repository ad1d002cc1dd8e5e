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
``2q`` (segmented LRU with a ghost list, see :class:`TwoQueueFreeBlockQueue`)
    Cached content referenced a second time (hit while free, or recomputed while its hash
    is in the ghost list of recent evictions) is protected: one-off prompts are evicted
    before it. Unhashed blocks go first, as in ``unhashed-first``.

New policies register in :data:`EVICTION_POLICIES`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import FreeKVCacheBlockQueue, KVCacheBlock
from prefixcache.core.hashing import BlockHash


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


class TwoQueueFreeBlockQueue(FreeKVCacheBlockQueue):
    """2Q-style segmented LRU: content referenced again is protected from one-off content.

    Two LRU segments make up the free queue: *probation* (the inherited list) holds free
    blocks whose content has been referenced once, *protected* those whose content was
    referenced again. Blocks are taken from probation first, then from protected.

    Content counts as referenced again when its block is hit while free (:meth:`remove`,
    called by the pool's ``touch``), or when it is released under a hash that is still
    remembered in the *ghost* list — the hashes of the last ``ghost_factor * num_blocks``
    evicted blocks (hashes only, no KV). The ghost is what lets a prefix whose reuse comes
    back after longer than the cache can hold it (e.g. the second question on a long
    document) earn protection: plain SLRU only protects what is hit while still cached.
    The mark is dropped when a block is taken for new content.

    Released blocks without a hash go to the head of probation (they hold nothing).
    Protected holds at most ``protected_fraction`` of all blocks; beyond that its least
    recently used blocks are demoted to the tail of probation, so a once-popular prefix
    cannot stay forever. Hits on blocks still held by another request are not seen (no
    ``remove``); such content is still protected once it comes back through the ghost.
    """

    policy_name = "2q"
    protected_fraction = 0.9
    ghost_factor = 2

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        size = max((block.block_id for block in blocks), default=-1) + 1
        # Indexed by block id: the pool's blocks are numbered 0 .. num_blocks - 1.
        self.is_reused = bytearray(size)
        self.is_protected = bytearray(size)
        self.protected = FreeKVCacheBlockQueue(())
        self.max_protected = int(self.protected_fraction * len(blocks))
        self.ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_ghost = self.ghost_factor * len(blocks)
        self.num_probation = 0
        super().__init__(blocks)

    # ``num_free_blocks`` counts both segments; the inherited list is probation.

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(
                f"No free blocks available: asked for {n}, {self.num_free_blocks} free"
            )
        from_probation = min(n, self.num_probation)
        popped = super().popleft_n(from_probation)
        self.num_probation -= from_probation
        if from_probation < n:
            more = self.protected.popleft_n(n - from_probation)
            self.num_free_blocks -= len(more)
            is_protected = self.is_protected
            for block in more:
                is_protected[block.block_id] = 0
            popped.extend(more)
        is_reused = self.is_reused
        ghost = self.ghost
        for block in popped:
            is_reused[block.block_id] = 0
            if block.block_hash is not None:  # about to be evicted by the pool
                ghost[block.block_hash] = None
        while len(ghost) > self.max_ghost:
            ghost.popitem(last=False)
        return popped

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def remove(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        self.is_reused[block_id] = 1
        if self.is_protected[block_id]:
            self.is_protected[block_id] = 0
            self.protected.remove(block)
            self.num_free_blocks -= 1
        else:
            super().remove(block)
            self.num_probation -= 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        self.num_probation += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        super().prepend_n(blocks)
        self.num_probation += len(blocks)

    def release(self, blocks: list[KVCacheBlock]) -> None:
        is_reused = self.is_reused
        ghost = self.ghost
        unhashed, probation, protected = [], [], []
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                unhashed.append(block)
            elif is_reused[block.block_id]:
                protected.append(block)
            elif block_hash in ghost:
                del ghost[block_hash]
                is_reused[block.block_id] = 1
                protected.append(block)
            else:
                probation.append(block)
        if unhashed:
            self.prepend_n(unhashed)
        if probation:
            self.append_n(probation)
        if protected:
            self._protect(protected)

    def _protect(self, blocks: list[KVCacheBlock]) -> None:
        is_protected = self.is_protected
        for block in blocks:
            is_protected[block.block_id] = 1
        self.protected.append_n(blocks)
        self.num_free_blocks += len(blocks)
        overflow = self.protected.num_free_blocks - self.max_protected
        if overflow > 0:
            demoted = self.protected.popleft_n(overflow)
            for block in demoted:
                is_protected[block.block_id] = 0
            self.num_free_blocks -= overflow
            self.append_n(demoted)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Probation head to tail, then protected head to tail: the eviction order."""
        return super().get_all_free_blocks() + self.protected.get_all_free_blocks()


EVICTION_POLICIES: dict[str, type[FreeKVCacheBlockQueue]] = {
    LRUFreeBlockQueue.policy_name: LRUFreeBlockQueue,
    UnhashedFirstFreeBlockQueue.policy_name: UnhashedFirstFreeBlockQueue,
    TwoQueueFreeBlockQueue.policy_name: TwoQueueFreeBlockQueue,
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
