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

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence

from prefixcache.core import BlockHash, KVCacheBlock
from prefixcache.core.block_pool import BlockHashToBlockMap
from prefixcache.core.eviction.scored import ScoredFreeBlockQueue

NEVER = 1 << 60  # next use of a hash that is never usefully accessed again
EMPTY = 1 << 61  # priority of a block holding no cached content: always reused first


class FutureUses:
    """For each hash, the admission indices of its useful accesses and of the requests that
    recompute it (module docstring), and its chain depth.

    ``hash_sequences`` yields the chain of each admitted request in admission order (it is
    read once, so a generator will do) and ``max_hit_blocks[k]`` how many blocks of the
    ``k``-th a lookup may hit. Memory: per distinct hash a dict entry, its slot (an int)
    and 12 bytes of arrays, about 75 bytes in all; 4 bytes per useful access (the accesses
    of all hashes in one array, each hash's run sorted), and 8 more while it is built.
    """

    __slots__ = ("_slot_of", "_use_starts", "_uses", "_recomputes", "_depths")

    def __init__(self, hash_sequences: Iterable[Sequence[BlockHash]],
                 max_hit_blocks: Iterable[int]) -> None:
        slot_of: dict[BlockHash, int] = {}
        depths = array("I")
        # One entry per useful access: the hash's slot and the admission index.
        access_slots, access_indices = array("I"), array("I")
        recomputes: dict[BlockHash, list[int]] = {}
        for index, (hashes, num_hit_able) in enumerate(
                zip(hash_sequences, max_hit_blocks, strict=True)):
            for depth, block_hash in enumerate(hashes):
                slot = slot_of.get(block_hash)
                if slot is None:
                    slot = slot_of[block_hash] = len(depths)
                    depths.append(depth)
                if depth < num_hit_able:
                    access_slots.append(slot)
                    access_indices.append(index)
                else:
                    recomputes.setdefault(block_hash, []).append(index)
        # Group the accesses by slot (a counting sort: stable, so each run stays sorted).
        use_starts = array("Q", bytes(8 * (len(depths) + 1)))
        for slot in access_slots:
            use_starts[slot + 1] += 1
        for slot in range(len(depths)):
            use_starts[slot + 1] += use_starts[slot]
        uses = array("I", bytes(4 * len(access_slots)))
        next_free = use_starts[:-1]
        for slot, index in zip(access_slots, access_indices, strict=True):
            position = next_free[slot]
            uses[position] = index
            next_free[slot] = position + 1
        self._slot_of = slot_of
        self._use_starts = use_starts
        self._uses = uses
        self._recomputes = recomputes
        self._depths = depths

    def next_use(self, block_hash: BlockHash, now: int) -> int:
        """The first useful access of ``block_hash`` after admission ``now``, or NEVER."""
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return NEVER
        uses, end = self._uses, self._use_starts[slot + 1]
        k = bisect_right(uses, now, self._use_starts[slot], end)
        return uses[k] if k < end else NEVER

    def next_recompute(self, block_hash: BlockHash, now: int) -> int:
        """The first admission after ``now`` that recomputes ``block_hash``, or NEVER."""
        indices = self._recomputes.get(block_hash)
        if indices is None:
            return NEVER
        k = bisect_right(indices, now)
        return indices[k] if k < len(indices) else NEVER

    def num_uses_until(self, block_hash: BlockHash, now: int) -> int:
        """How many useful accesses of ``block_hash`` admissions 0 .. ``now`` made."""
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return 0
        start = self._use_starts[slot]
        return bisect_right(self._uses, now, start, self._use_starts[slot + 1]) - start

    def depth(self, block_hash: BlockHash) -> int:
        slot = self._slot_of.get(block_hash)
        return 0 if slot is None else self._depths[slot]


class BeladyFreeBlockQueue(ScoredFreeBlockQueue):
    """The free queue ordered by Belady's rule (module docstring), given the future.

    The replay sets :attr:`now` to the admission index of the request being allocated.
    A block's key is (-next use, -depth): furthest next use, then deepest, goes first. A
    key expires when its next use passes without hitting the block, or when the request
    that recomputes it is admitted; the block is then re-keyed when it surfaces, unless
    its hash is held by another block too, which makes it worthless: it goes first.
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
        self._key_expiry: dict[int, int] = {}  # block id -> when its key stops being true
        super().__init__(blocks)

    def key_for(self, block: KVCacheBlock) -> tuple[int, int]:
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
        self._key_expiry[block.block_id] = expiry
        return -next_use, -depth

    def _take_or_rekey(self, block: KVCacheBlock) -> bool:
        if (self._key_expiry[block.block_id] <= self.now
                and not self._is_duplicated(block.block_hash)):
            # Its access has come and gone without hitting it, or its recomputation has
            # been admitted: re-key to what comes next.
            self.append(block)
            return False
        return True

    def _is_duplicated(self, block_hash: BlockHash | None) -> bool:
        """Whether another block holds ``block_hash`` too (False for no hash)."""
        cached = self.cached
        return (block_hash is not None and cached is not None
                and len(cached.get_all_blocks(block_hash)) > 1)
