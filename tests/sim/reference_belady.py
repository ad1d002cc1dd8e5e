"""Belady's free queue at its plainest, for the tests to hold the real one to.

One heap entry per free block, keyed by the module definition of
:mod:`prefixcache.sim.belady` directly: (-next use, -depth, push order), a block holding
nothing first of all; a key that has expired is renewed when its block surfaces, unless
another block holds the same hash (then the block goes). The real queue keeps a release's
blocks in runs to save heap steps; it must take blocks in exactly this order.
"""

from __future__ import annotations

from prefixcache.core import KVCacheBlock
from prefixcache.core.block_pool import BlockHashToBlockMap
from prefixcache.core.eviction.scored import ScoredFreeBlockQueue
from prefixcache.sim.belady import EMPTY, NEVER, FutureUses


class PerBlockBeladyQueue(ScoredFreeBlockQueue):
    policy_name = "belady"

    def __init__(self, blocks, future: FutureUses,
                 cached: BlockHashToBlockMap | None = None) -> None:
        self.future = future
        self.cached = cached
        self.now = -1
        self.key_expiry: dict[int, int] = {}
        super().__init__(blocks)

    def key_for(self, block: KVCacheBlock) -> tuple[int, int]:
        block_hash = block.block_hash
        if block_hash is None:
            next_use, depth, expiry = EMPTY, 0, NEVER
        else:
            next_use = self.future.next_use(block_hash, self.now)
            recompute = self.future.next_recompute(block_hash, self.now - 1)
            if recompute < next_use:
                next_use, expiry = NEVER, recompute + 1
            else:
                expiry = next_use
            depth = self.future.depth(block_hash)
        self.key_expiry[block.block_id] = expiry
        return -next_use, -depth

    def _take_or_rekey(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        duplicated = (block_hash is not None and self.cached is not None
                      and len(self.cached.get_all_blocks(block_hash)) > 1)
        if self.key_expiry[block.block_id] <= self.now and not duplicated:
            self.append(block)
            return False
        return True
