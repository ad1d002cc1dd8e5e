"""A free queue ordered by a score per block instead of by position: a lazy min-heap.

The linked list of :class:`~prefixcache.core.block.FreeKVCacheBlockQueue` can only put a
block at either end. A policy that ranks every free block by a computed value (Belady's
next use, a predicted chance of reuse) needs a priority queue; this is that queue, behind
the same contract, so the block pool cannot tell the difference.

Removal (a cache hit on a free block) must stay cheap, so entries are never searched for:
each block carries a version, odd while it is in the queue, and a heap entry whose version
is not the block's current one is stale and skipped when it surfaces. Stale entries are
compacted away once they outnumber the live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from prefixcache.core.block import FreeKVCacheBlockQueue, KVCacheBlock


class ScoredFreeBlockQueue(FreeKVCacheBlockQueue):
    """Free blocks in a min-heap on ``(key, push order)``: the lowest key is evicted first,
    and among equal keys the block pushed first.

    Subclasses say what a block's key is: :meth:`key_for` for blocks handed in without
    context (``append``, ``append_n``, ``prepend_n``, and ``release`` unless overridden),
    or :meth:`_push` with a key of their own. Keys must be mutually comparable (numbers,
    or tuples of them). :meth:`_take_or_rekey` may veto a block that surfaces (for keys
    that expire). Same contract as every free queue: it holds exactly the ``ref_cnt == 0``
    blocks, each once; ``prepend_n`` cannot honour "first" and orders by key like the rest.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # (key, push order, version, block); version odd = in the queue.
        self._heap: list[tuple[Any, int, int, KVCacheBlock]] = []
        self._versions: dict[int, int] = {}
        self._num_pushed = 0
        super().__init__(blocks)

    # -- what subclasses decide ----------------------------------------------------------

    def key_for(self, block: KVCacheBlock) -> Any:
        """The key of ``block`` handed in without context. Lower is evicted sooner."""
        raise NotImplementedError

    def _take_or_rekey(self, block: KVCacheBlock) -> bool:
        """Called with the lowest block, already out of the queue: True to evict it; or
        False after pushing it back under a new key (the search then goes on)."""
        return True

    # -- the heap ------------------------------------------------------------------------

    def _push(self, block: KVCacheBlock, key: Any) -> None:
        version = self._versions.get(block.block_id, 0) + 1
        self._versions[block.block_id] = version
        self._num_pushed += 1
        heapq.heappush(self._heap, (key, self._num_pushed, version, block))
        self.num_free_blocks += 1

    def _pop_lowest(self) -> KVCacheBlock:
        heap = self._heap
        versions = self._versions
        while heap:
            _, _, version, block = heapq.heappop(heap)
            if versions.get(block.block_id) != version:
                continue  # removed (hit) or pushed again since
            versions[block.block_id] = version + 1
            self.num_free_blocks -= 1
            if self._take_or_rekey(block):
                return block
        raise ValueError("No free blocks available")

    def _recompute_keys(self, new_key: Callable[[KVCacheBlock, Any], Any]) -> None:
        """Give every free block the key ``new_key(block, old_key)``, keeping push order
        for ties (for keys computed from estimates that have since been refitted). O(n)."""
        entries = [(new_key(block, key), order, version, block)
                   for key, order, version, block in self._live_entries()]
        heapq.heapify(entries)
        self._heap = entries

    def _live_entries(self) -> list[tuple[Any, int, int, KVCacheBlock]]:
        versions = self._versions
        return [entry for entry in self._heap if versions.get(entry[3].block_id) == entry[2]]

    # -- the free-queue contract -----------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self._pop_lowest()

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n <= 0:
            return self._popleft_none(n)
        if n > self.num_free_blocks:
            raise ValueError(
                f"No free blocks available: asked for {n}, {self.num_free_blocks} free"
            )
        return [self._pop_lowest() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        versions = self._versions
        version = versions.get(block.block_id)
        if version is None or version % 2 == 0:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        versions[block.block_id] = version + 1
        self.num_free_blocks -= 1
        if len(self._heap) > 2 * self.num_free_blocks + 1024:
            # Hits leave stale entries behind; without this the heap would grow with every
            # hit for as long as the blocks stay free.
            self._heap = self._live_entries()
            heapq.heapify(self._heap)

    def append(self, block: KVCacheBlock) -> None:
        self._push(block, self.key_for(block))

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self._push(block, self.key_for(block))

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        self.append_n(blocks)  # the order is the keys', whatever the caller asks

    def release(self, blocks: list[KVCacheBlock], request=None) -> None:
        self.append_n(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order by current keys (a subclass that re-keys on
        the way out may still reorder). O(n log n); for tests and tools."""
        return [entry[3] for entry in sorted(self._live_entries(), key=lambda e: e[:2])]
