"""Belady's offline-optimal eviction, as a free queue for the real KV cache manager.

Definition used throughout prefixcache (replays, sweeps, tests):

    Replay the same requests, in the same admission order, through the same
    :class:`~prefixcache.core.KVCacheManager` with the same capacity, pinning and
    admission rules as every online policy; only the choice of which free block to reuse
    differs. When a new block is needed, take first a free block holding nothing cached,
    else the free cached block whose hash is next *usefully* accessed furthest in the
    future (never again counts as infinitely far), and among equal next uses the deepest
    block of its prefix chain.

A *useful* access of hash ``h`` is an admitted request whose chain has ``h`` within its
first ``max_hit_blocks`` blocks — the only positions a lookup can hit. Live requests' blocks
are pinned (not in the free queue), exactly as for the online policies, so the optimum is
over eviction choices only; admission timing never depends on the policy (the number of
free blocks after each step is the same for every policy), so all policies see the same
sequence of live sets.

Why this is the optimum: a child block is never usefully accessed before its parent (every
request reaching the child passes through the parent), so furthest-next-use with
deepest-first ties keeps the set of cached hashes prefix-closed. A request's hits are then
exactly the cached hashes of its hit-able chain, which makes the problem classic paging
with pinned pages, where furthest-in-future is optimal by Belady's exchange argument. The
one exception is a duplicate block (a request whose prompt ends on a block boundary never
hits its last block and recomputes it): its stale next use can make the result a hair
below optimal, never above what the manager can do. ``infinite >= Belady`` holds because
Belady only hits hashes seen before; ``Belady >= policy`` is checked by the tests and
reported by every sweep.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

from prefixcache.core import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

NEVER = 1 << 60  # next use of a hash that is never usefully accessed again
EMPTY = 1 << 61  # priority of a block holding no cached content: always reused first


class FutureUses:
    """For each hash, the admission indices of its useful accesses, and its chain depth.

    ``hash_sequences[k]`` is the chain of the ``k``-th admitted request and
    ``max_hit_blocks[k]`` how many of its blocks a lookup may hit.
    """

    __slots__ = ("_hash_to_uses", "_hash_to_depth")

    def __init__(self, hash_sequences: list[list[BlockHash]], max_hit_blocks: list[int]) -> None:
        hash_to_uses: dict[BlockHash, list[int]] = {}
        hash_to_depth: dict[BlockHash, int] = {}
        for index, (hashes, num_hit_able) in enumerate(
                zip(hash_sequences, max_hit_blocks, strict=True)):
            for depth, block_hash in enumerate(hashes):
                if depth < num_hit_able:
                    uses = hash_to_uses.get(block_hash)
                    if uses is None:
                        hash_to_uses[block_hash] = [index]
                    else:
                        uses.append(index)
                if block_hash not in hash_to_depth:
                    hash_to_depth[block_hash] = depth
        self._hash_to_uses = hash_to_uses
        self._hash_to_depth = hash_to_depth

    def next_use(self, block_hash: BlockHash, now: int) -> int:
        """The first useful access of ``block_hash`` after admission ``now``, or NEVER."""
        uses = self._hash_to_uses.get(block_hash)
        if uses is None:
            return NEVER
        k = bisect_right(uses, now)
        return uses[k] if k < len(uses) else NEVER

    def num_uses_until(self, block_hash: BlockHash, now: int) -> int:
        """How many useful accesses of ``block_hash`` admissions 0 .. ``now`` made."""
        uses = self._hash_to_uses.get(block_hash)
        return 0 if uses is None else bisect_right(uses, now)

    def depth(self, block_hash: BlockHash) -> int:
        return self._hash_to_depth.get(block_hash, 0)


class BeladyFreeBlockQueue(FreeKVCacheBlockQueue):
    """The free queue ordered by Belady's rule (module docstring), given the future.

    The replay sets :attr:`now` to the admission index of the request being allocated.
    A lazy max-heap replaces the linked list: removal marks an entry stale, and an entry
    whose next use has already passed (the access did not hit it) is re-keyed when it
    reaches the top. Same contract as every free queue: holds exactly the ref-0 blocks.
    """

    policy_name = "belady"

    def __init__(self, blocks, future: FutureUses) -> None:
        self.future = future
        self.now = -1
        self._heap: list[tuple[int, int, int, int, KVCacheBlock]] = []
        self._versions: dict[int, int] = {}
        self._seq = 0
        super().__init__(blocks)

    # -- the heap -------------------------------------------------------------------------

    def _push(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            next_use, depth = EMPTY, 0
        else:
            next_use = self.future.next_use(block_hash, self.now)
            depth = self.future.depth(block_hash)
        version = self._versions.get(block.block_id, 0) + 1
        self._versions[block.block_id] = version
        self._seq += 1
        # Min-heap on (-next use, -depth): furthest next use, then deepest, comes out first.
        heapq.heappush(self._heap, (-next_use, -depth, self._seq, version, block))
        self.num_free_blocks += 1

    def _pop_best(self) -> KVCacheBlock:
        heap = self._heap
        versions = self._versions
        while heap:
            neg_next_use, _, _, version, block = heapq.heappop(heap)
            if versions.get(block.block_id) != version:
                continue  # removed (touched) or pushed again since
            next_use = -neg_next_use
            if block.block_hash is not None and next_use <= self.now:
                # Its access has come and gone without hitting it: re-key to the next one.
                versions[block.block_id] = version + 1
                self.num_free_blocks -= 1
                self._push(block)
                continue
            versions[block.block_id] = version + 1
            self.num_free_blocks -= 1
            return block
        raise ValueError("No free blocks available")

    # -- the free-queue contract -----------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self._pop_best()

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(
                f"No free blocks available: asked for {n}, {self.num_free_blocks} free"
            )
        return [self._pop_best() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        versions = self._versions
        version = versions.get(block.block_id)
        if version is None or version % 2 == 0:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        versions[block.block_id] = version + 1
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._push(block)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self._push(block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        self.append_n(blocks)  # the order is the heap's, whatever the caller asks

    def release(self, blocks: list[KVCacheBlock], request=None) -> None:
        self.append_n(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in current eviction order (ignoring re-keying). O(n log n)."""
        versions = self._versions
        live = [entry for entry in self._heap if versions.get(entry[4].block_id) == entry[3]]
        return [entry[4] for entry in sorted(live, key=lambda entry: entry[:3])]
