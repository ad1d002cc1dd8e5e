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
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Sequence

from prefixcache.core import BlockHash, KVCacheBlock
from prefixcache.core.block_pool import BlockHashToBlockMap
from prefixcache.core.eviction.scored import VersionedFreeBlockQueue

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
        recomputes: dict[int, list[int]] = {}  # by slot
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
                    recomputes.setdefault(slot, []).append(index)
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
        slot = self._slot_of.get(block_hash)
        indices = None if slot is None else self._recomputes.get(slot)
        if indices is None:
            return NEVER
        k = bisect_right(indices, now)
        return indices[k] if k < len(indices) else NEVER

    def belady_key_parts(self, block_hashes: Iterable[BlockHash | None],
                         now: int) -> list[tuple[int, int, int]]:
        """For free blocks holding ``block_hashes`` as admission ``now`` allocates, each
        one's (next use its key ranks it by, when that key expires, depth).

        The next use is :meth:`next_use` after ``now``, unless a request recomputes the
        hash first (counting ``now`` itself): then NEVER, until just after that
        recomputation is admitted. Otherwise the key expires at the next use. A block
        holding nothing (None) gets (EMPTY, NEVER, 0). All in one call, as Belady's queue
        asks this for every block it is handed."""
        slot_of, depths, recomputes = self._slot_of, self._depths, self._recomputes
        uses, use_starts = self._uses, self._use_starts
        parts = []
        append = parts.append
        for block_hash in block_hashes:
            slot = None if block_hash is None else slot_of.get(block_hash)
            if slot is None:
                append((NEVER, NEVER, 0) if block_hash is not None else (EMPTY, NEVER, 0))
                continue
            end = use_starts[slot + 1]
            k = bisect_right(uses, now, use_starts[slot], end)
            next_use = uses[k] if k < end else NEVER
            recomputed_at = recomputes.get(slot)
            if recomputed_at is not None:
                k = bisect_right(recomputed_at, now - 1)
                if k < len(recomputed_at) and recomputed_at[k] < next_use:
                    append((NEVER, recomputed_at[k] + 1, depths[slot]))
                    continue
            append((next_use, next_use, depths[slot]))
        return parts

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


class _Run:
    """Blocks handed in together that share a next use and key expiry, in eviction order:
    ``entries`` holds ``(block, version, -depth, push order)`` from ``next_index`` on."""

    __slots__ = ("negative_next_use", "expiry", "entries", "next_index")

    def __init__(self, negative_next_use: int, expiry: int,
                 entries: list[tuple[KVCacheBlock, int, int, int]]) -> None:
        self.negative_next_use = negative_next_use
        self.expiry = expiry
        self.entries = entries
        self.next_index = 0


class BeladyFreeBlockQueue(VersionedFreeBlockQueue):
    """The free queue ordered by Belady's rule (module docstring), given the future.

    The replay sets :attr:`now` to the admission index of the request being allocated.
    A block's key is (-next use, -depth, the order it was handed in): furthest next use,
    then deepest, then handed in first, goes first; a block holding nothing cached has
    the lowest key of all. A key expires when its next use passes without hitting the
    block, or when the request that recomputes it is admitted; the block is then
    re-keyed when it surfaces, unless its hash is held by another block too, which makes
    it worthless: it goes first. ``cached`` is the pool's hash map, to see such
    duplicates (without it, every block is taken to be its hash's only holder). Same
    contract as every free queue: holds exactly the ref-0 blocks.

    The blocks a request releases come deepest first, and runs of them are next used by
    the same later request: so blocks are kept in *runs*, in key order, and the heap holds
    each run once, under the key of its first entry not yet passed. The run on top gives
    up blocks for as long as its next one is below every other run's first, without a
    heap step per block. Blocks come out in exactly the order of a heap with one entry
    per block (``tests/sim/reference_belady.py``, which the tests hold this queue to).
    """

    policy_name = "belady"

    def __init__(self, blocks, future: FutureUses,
                 cached: BlockHashToBlockMap | None = None) -> None:
        self.future = future
        self.cached = cached
        self.now = -1
        # (-next use, -depth, push order) of a run's first entry not yet passed (at most
        # its first current one's: entries behind it may be stale), and the run.
        self._heap: list[tuple[int, int, int, _Run]] = []
        self._num_pushed = 0
        self._num_entries = 0  # entries in runs, current or stale, not yet passed
        super().__init__(blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        order = self._num_pushed
        push_run = self._push_run
        run: _Run | None = None
        entries: list = []
        # The current run's key parts, and its last block's -depth.
        run_next_use = run_expiry = last_negative_depth = 0
        all_parts = self.future.belady_key_parts([block.block_hash for block in blocks],
                                                 self.now)
        for block, version, (next_use, expiry, depth) in zip(
                blocks, self._enter_n(blocks), all_parts, strict=True):
            order += 1
            # Within a run keys must rise: same next use, then shallower, then later.
            if (run is not None and next_use == run_next_use and expiry == run_expiry
                    and -depth >= last_negative_depth):
                entries.append((block, version, -depth, order))
            else:
                if run is not None:
                    push_run(run)
                entries = [(block, version, -depth, order)]
                run = _Run(-next_use, expiry, entries)
                run_next_use, run_expiry = next_use, expiry
            last_negative_depth = -depth
        if run is not None:
            push_run(run)
        self._num_pushed = order
        self._num_entries += len(blocks)

    def _push_run(self, run: _Run) -> None:
        _, _, negative_depth, order = run.entries[run.next_index]
        heapq.heappush(self._heap, (run.negative_next_use, negative_depth, order, run))

    def _pop_lowest(self) -> KVCacheBlock:
        return self._take(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        self._check_take(n)
        return self._take(n) if n else []

    def _take(self, n: int) -> list[KVCacheBlock]:
        """The next ``n`` blocks to evict (there are that many), re-keying on the way
        those whose key has expired. The run on top gives blocks for as long as its next
        key is below every other run's first: no heap step per block."""
        heap, versions = self._heap, self._versions
        taken: list[KVCacheBlock] = []
        while len(taken) < n:
            if not heap:
                raise ValueError("No free blocks available")
            run = heap[0][3]
            negative_next_use, entries, index = run.negative_next_use, run.entries, run.next_index
            # The least key of the other runs (a heap's second least is a child of its root).
            bound = min(heap[1:3])[:3] if len(heap) > 1 else None
            # The whole run comes first when its next use is further than every other's.
            whole_run = bound is None or negative_next_use < bound[0]
            expired = run.expiry <= self.now
            rekey = None
            end, wanted, num_left = len(entries), n - len(taken), 0
            while index < end and wanted:
                block, version, negative_depth, order = entries[index]
                if not whole_run and (negative_next_use, negative_depth, order) > bound:
                    break
                index += 1
                block_id = block.block_id
                if versions[block_id] != version:
                    continue  # stale: removed (hit) or handed in again since
                versions[block_id] = version + 1
                num_left += 1
                if expired and not self._is_duplicated(block.block_hash):
                    # Its access has come and gone without hitting it, or its
                    # recomputation has been admitted: re-key to what comes next.
                    rekey = block
                    break
                taken.append(block)
                wanted -= 1
            self.num_free_blocks -= num_left
            self._num_entries -= index - run.next_index
            run.next_index = index
            if index < len(entries):
                heapq.heapreplace(heap, (negative_next_use, entries[index][2],
                                         entries[index][3], run))
            else:
                heapq.heappop(heap)
            if rekey is not None:
                self.append(rekey)
        return taken

    def _is_duplicated(self, block_hash: BlockHash | None) -> bool:
        """Whether another block holds ``block_hash`` too (False for no hash)."""
        cached = self.cached
        return (block_hash is not None and cached is not None
                and len(cached.get_all_blocks(block_hash)) > 1)

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        if self._num_entries > 2 * self.num_free_blocks + 1024:
            # Hits leave stale entries behind; without this the runs would grow with
            # every hit for as long as their other blocks stay free.
            self._drop_stale_entries()

    def _current_entries(self, run: _Run) -> list[tuple[KVCacheBlock, int, int, int]]:
        """``run``'s entries still in the queue (not taken, hit or handed in again)."""
        versions = self._versions
        return [entry for entry in run.entries[run.next_index:]
                if versions[entry[0].block_id] == entry[1]]

    def _drop_stale_entries(self) -> None:
        runs = []
        for _, _, _, run in self._heap:
            current = self._current_entries(run)
            if current:
                run.entries, run.next_index = current, 0
                runs.append(run)
        self._heap = [(run.negative_next_use, run.entries[0][2], run.entries[0][3], run)
                      for run in runs]
        heapq.heapify(self._heap)
        self._num_entries = sum(len(run.entries) for run in runs)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order by current keys (re-keying on the way out
        may still reorder). O(n log n); for tests and tools."""
        keyed = [(run.negative_next_use, negative_depth, order, block)
                 for _, _, _, run in self._heap
                 for block, _, negative_depth, order in self._current_entries(run)]
        keyed.sort(key=lambda entry: entry[:3])
        return [entry[3] for entry in keyed]
