"""Belady's offline-optimal eviction, as a free queue for the real KV cache manager.

Definition used throughout prefixcache (replays, sweeps, tests):

    Replay the same requests, in the same admission order, through the same
    :class:`~prefixcache.core.KVCacheManager` with the same capacity, pinning and
    admission rules as every online policy; only the choice of which free block to reuse
    differs. When a new block is needed, take first a free block holding nothing cached,
    else the free cached block whose hash is next *usefully* accessed furthest in the
    future (never again counts as infinitely far), and among equal next uses the deepest
    block of its prefix chain. A hash that some request *recomputes* before its next
    useful access counts as never used again until that request comes.

A *useful* access of hash ``h`` is an admitted request whose chain has ``h`` within its
first ``max_hit_blocks`` blocks — the only positions a lookup can hit. A request with ``h``
beyond them (a prompt ending on a block boundary never hits its last block) recomputes
``h``: from then on ``h`` is cached whether the old copy was kept or not (the manager keeps
one copy when the request finishes), so the old copy is worth nothing until then, and is
re-keyed if it is still there when that request is admitted — to nothing again while the
new copy exists (a free block whose hash another block also holds is always the first
cached block to go: dropping it loses nothing). Live requests' blocks
are pinned (not in the free queue), exactly as for the online policies, so the optimum is
over eviction choices only; admission timing never depends on the policy (the number of
free blocks after each step is the same for every policy), so all policies see the same
sequence of live sets.

Why this is the optimum: a child block is never usefully accessed before its parent (every
request reaching the child passes through the parent), so furthest-next-use with
deepest-first ties keeps the set of cached hashes prefix-closed. A request's hits are then
exactly the cached hashes of its hit-able chain, which makes the problem classic paging
with pinned pages, where furthest-in-future is optimal by Belady's exchange argument; a
recomputation is a free reload of the page, which is why the copy it replaces is worth
nothing before it. (A parent marked worthless that way may go while its child stays, but
no request can reach the child before the parent is recomputed.) ``infinite >= Belady``
holds because Belady only hits hashes seen before; ``Belady >= policy`` is checked by the
tests and reported by every sweep.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

from prefixcache.core import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock
from prefixcache.core.block_pool import BlockHashToBlockMap

NEVER = 1 << 60  # next use of a hash that is never usefully accessed again
EMPTY = 1 << 61  # priority of a block holding no cached content: always reused first


class FutureUses:
    """For each hash, the admission indices of its useful accesses and of the requests that
    recompute it (module docstring), and its chain depth.

    ``hash_sequences[k]`` is the chain of the ``k``-th admitted request and
    ``max_hit_blocks[k]`` how many of its blocks a lookup may hit.
    """

    __slots__ = ("_hash_to_uses", "_hash_to_recomputes", "_hash_to_depth")

    def __init__(self, hash_sequences: list[list[BlockHash]], max_hit_blocks: list[int]) -> None:
        hash_to_uses: dict[BlockHash, list[int]] = {}
        hash_to_recomputes: dict[BlockHash, list[int]] = {}
        hash_to_depth: dict[BlockHash, int] = {}
        for index, (hashes, num_hit_able) in enumerate(
                zip(hash_sequences, max_hit_blocks, strict=True)):
            for depth, block_hash in enumerate(hashes):
                occurrences = hash_to_uses if depth < num_hit_able else hash_to_recomputes
                indices = occurrences.get(block_hash)
                if indices is None:
                    occurrences[block_hash] = [index]
                else:
                    indices.append(index)
                if block_hash not in hash_to_depth:
                    hash_to_depth[block_hash] = depth
        self._hash_to_uses = hash_to_uses
        self._hash_to_recomputes = hash_to_recomputes
        self._hash_to_depth = hash_to_depth

    def next_use(self, block_hash: BlockHash, now: int) -> int:
        """The first useful access of ``block_hash`` after admission ``now``, or NEVER."""
        return _first_after(self._hash_to_uses.get(block_hash), now)

    def next_recompute(self, block_hash: BlockHash, now: int) -> int:
        """The first admission after ``now`` that recomputes ``block_hash``, or NEVER."""
        return _first_after(self._hash_to_recomputes.get(block_hash), now)

    def num_uses_until(self, block_hash: BlockHash, now: int) -> int:
        """How many useful accesses of ``block_hash`` admissions 0 .. ``now`` made."""
        uses = self._hash_to_uses.get(block_hash)
        return 0 if uses is None else bisect_right(uses, now)

    def depth(self, block_hash: BlockHash) -> int:
        return self._hash_to_depth.get(block_hash, 0)


def _first_after(indices: list[int] | None, now: int) -> int:
    """The first of the sorted ``indices`` greater than ``now``, or NEVER."""
    if indices is None:
        return NEVER
    k = bisect_right(indices, now)
    return indices[k] if k < len(indices) else NEVER


class BeladyFreeBlockQueue(FreeKVCacheBlockQueue):
    """The free queue ordered by Belady's rule (module docstring), given the future.

    The replay sets :attr:`now` to the admission index of the request being allocated.
    A lazy max-heap replaces the linked list: removal marks an entry stale, and an entry
    whose key has expired — its next use has passed without hitting it, or the request
    that recomputes it has been admitted — is re-keyed when it reaches the top, unless
    its hash is then held by another block too, which makes it worthless: it goes first.
    ``cached`` is the pool's hash map, to see such duplicates (without it, every block is
    taken to be its hash's only holder). Same contract as every free queue: holds exactly
    the ref-0 blocks.
    """

    policy_name = "belady"

    def __init__(self, blocks, future: FutureUses,
                 cached: BlockHashToBlockMap | None = None) -> None:
        self.future = future
        self.cached = cached
        self.now = -1
        # (-next use, -depth, push order, version, key expiry, block)
        self._heap: list[tuple[int, int, int, int, int, KVCacheBlock]] = []
        self._versions: dict[int, int] = {}
        self._seq = 0
        super().__init__(blocks)

    # -- the heap -------------------------------------------------------------------------

    def _push(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            next_use, depth, expiry = EMPTY, 0, NEVER
        else:
            future = self.future
            next_use = future.next_use(block_hash, self.now)
            # From ``now`` on: the request being admitted may be the one recomputing it.
            recompute = future.next_recompute(block_hash, self.now - 1)
            if recompute < next_use:
                # Worthless until recomputed, and while the recomputing request allocates.
                next_use, expiry = NEVER, recompute + 1
            else:
                expiry = next_use
            depth = future.depth(block_hash)
        version = self._versions.get(block.block_id, 0) + 1
        self._versions[block.block_id] = version
        self._seq += 1
        # Min-heap on (-next use, -depth): furthest next use, then deepest, comes out first.
        heapq.heappush(self._heap, (-next_use, -depth, self._seq, version, expiry, block))
        self.num_free_blocks += 1

    def _pop_best(self) -> KVCacheBlock:
        heap = self._heap
        versions = self._versions
        while heap:
            _, _, _, version, expiry, block = heapq.heappop(heap)
            if versions.get(block.block_id) != version:
                continue  # removed (touched) or pushed again since
            if expiry <= self.now and not self._is_duplicated(block.block_hash):
                # Its access has come and gone without hitting it, or its recomputation
                # has been admitted: re-key to what comes next.
                versions[block.block_id] = version + 1
                self.num_free_blocks -= 1
                self._push(block)
                continue
            versions[block.block_id] = version + 1
            self.num_free_blocks -= 1
            return block
        raise ValueError("No free blocks available")

    def _is_duplicated(self, block_hash: BlockHash | None) -> bool:
        """Whether another block holds ``block_hash`` too (False for no hash)."""
        cached = self.cached
        return (block_hash is not None and cached is not None
                and len(cached.get_all_blocks(block_hash)) > 1)

    # -- the free-queue contract -----------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self._pop_best()

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n < 0:
            raise ValueError(f"cannot take a negative number of blocks ({n})")
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
        live = [entry for entry in self._heap if versions.get(entry[5].block_id) == entry[3]]
        return [entry[5] for entry in sorted(live, key=lambda entry: entry[:3])]
