"""Policies that keep the free queue in segments, each in LRU order: ``unhashed-first``
(blocks holding nothing before cached ones), the two-segment queue that ``2q``,
``learned-reuse`` and the replayer's dead-content diagnostics build on, and ``2q``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.base import FreeKVCacheBlockQueue
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request


class UnhashedFirstFreeBlockQueue(FreeKVCacheBlockQueue):
    """Released blocks without a hash (partial tails, or every block when caching is off)
    go to the head, most recently released first, so they are reused before any cached
    block is evicted; cached blocks join the tail as under ``lru``."""

    policy_name = "unhashed-first"
    summary = "vLLM 0.33's order"

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        unhashed = [block for block in blocks if block.block_hash is None]
        if not unhashed:
            self.append_n(blocks)
            return
        self.prepend_n(unhashed)
        self.append_n([block for block in blocks if block.block_hash is not None])


class TwoSegmentFreeBlockQueue(FreeKVCacheBlockQueue):
    """A free queue in two LRU segments: *lower* (the inherited list) is drained first,
    then *upper*. Subclasses decide, in ``release``, where released blocks go, placing
    them with :meth:`place`; they see blocks taken for new content by extending
    ``popleft_n`` and hits on free blocks by extending ``remove``.

    ``in_upper[block_id]`` says which segment a free block is in (the pool's blocks are
    numbered 0 .. num_blocks - 1); ``num_lower`` counts the lower segment and
    ``num_free_blocks`` both. The inherited ``append``/``append_n``/``prepend_n`` act on
    the *lower* segment (so "tail" there is still evicted before every upper block);
    :meth:`append_upper` fills the upper one. A prefix-cache reset moves the upper
    segment's blocks, in order, to the head of the lower one: they hold nothing any more.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        self.num_block_ids = max((block.block_id for block in blocks), default=-1) + 1
        self.in_upper = bytearray(self.num_block_ids)
        self.upper = FreeKVCacheBlockQueue(())
        self.num_lower = 0
        super().__init__(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        self._check_take(n)
        if not n:
            return []
        return self._take_lower_then_upper(n)

    def _take_lower_then_upper(self, n: int) -> list[KVCacheBlock]:
        """``popleft_n`` once checked: ``0 < n <= num_free_blocks`` blocks of these two
        segments (a subclass with a segment of its own counts it in ``num_free_blocks``
        and takes from it first)."""
        from_lower = min(n, self.num_lower)
        popped = FreeKVCacheBlockQueue.popleft_n(self, from_lower)
        self.num_lower -= from_lower
        if from_lower < n:
            more = self.upper.popleft_n(n - from_lower)
            self.num_free_blocks -= len(more)
            in_upper = self.in_upper
            for block in more:
                in_upper[block.block_id] = 0
            popped.extend(more)
        return popped

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def remove(self, block: KVCacheBlock) -> None:
        if self.in_upper[block.block_id]:
            self.in_upper[block.block_id] = 0
            self.upper.remove(block)
            self.num_free_blocks -= 1
        else:
            super().remove(block)
            self.num_lower -= 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        self.num_lower += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        super().prepend_n(blocks)
        self.num_lower += len(blocks)

    def place(self, unhashed: list[KVCacheBlock], lower: list[KVCacheBlock],
              upper: list[KVCacheBlock]) -> None:
        """Put released blocks in the usual three places, each list keeping its order:
        ``unhashed`` (holding nothing) at the head of lower, ``lower`` at its tail,
        ``upper`` at the tail of upper."""
        if unhashed:
            self.prepend_n(unhashed)
        if lower:
            self.append_n(lower)
        if upper:
            self.append_upper(upper)

    def append_upper(self, blocks: list[KVCacheBlock]) -> None:
        """Append ``blocks`` to the tail of the upper segment."""
        in_upper = self.in_upper
        for block in blocks:
            in_upper[block.block_id] = 1
        self.upper.append_n(blocks)
        self.num_free_blocks += len(blocks)

    def forget_cached_content(self) -> None:
        """Empty the upper segment into the head of the lower one (class docstring), so no
        block outlives content cached after the reset; subclasses extend this."""
        upper = self.upper
        if upper.num_free_blocks:
            emptied = upper.popleft_n(upper.num_free_blocks)
            self.num_free_blocks -= len(emptied)
            self.in_upper = bytearray(self.num_block_ids)
            self.prepend_n(emptied)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Lower head to tail, then upper head to tail: the eviction order."""
        return super().get_all_free_blocks() + self.upper.get_all_free_blocks()


class TwoQueueFreeBlockQueue(TwoSegmentFreeBlockQueue):
    """Segmented LRU with a ghost list: content referenced again is protected from content
    referenced once.

    The lower segment (*probation*) holds free blocks whose content has been referenced
    once, the upper one (*protected*) those whose content was referenced again: hit while
    free (``remove``), or released under a hash still in the *ghost* list — the hashes of
    the last ``ghost_factor * num_blocks`` evicted blocks (hashes only, no KV), so content
    whose reuse comes back after longer than the cache holds it is protected too. The
    mark is dropped when a block is taken for new content. An evicted block's hash joins
    the ghost even while a duplicate block still in use holds it; that duplicate's
    release then finds it there and is protected as if recomputed.

    Released blocks without a hash go to the head of probation. Protected holds at most
    ``protected_fraction`` of all blocks; beyond that its least recently used blocks are
    demoted to the tail of probation. Hits on blocks another request holds are not
    observed. A prefix-cache reset forgets the ghost and the marks.
    """

    policy_name = "2q"
    summary = "protects content referenced twice"
    protected_fraction = 0.9
    ghost_factor = 2

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        super().__init__(blocks)
        self.is_reused = bytearray(self.num_block_ids)
        self.max_protected = int(self.protected_fraction * len(blocks))
        self.ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_ghost = self.ghost_factor * len(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        popped = super().popleft_n(n)
        is_reused = self.is_reused
        ghost = self.ghost
        for block in popped:
            is_reused[block.block_id] = 0
            if block.block_hash is not None:  # about to be evicted by the pool
                ghost[block.block_hash] = None
        while len(ghost) > self.max_ghost:
            ghost.popitem(last=False)
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self.is_reused[block.block_id] = 1

    def forget_cached_content(self) -> None:
        super().forget_cached_content()
        self.ghost.clear()
        self.is_reused = bytearray(self.num_block_ids)

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
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
        self.place(unhashed, probation, [])
        if protected:
            self._protect(protected)

    def _protect(self, blocks: list[KVCacheBlock]) -> None:
        """Append ``blocks`` to protected, demoting its overflow to probation's tail."""
        self.append_upper(blocks)
        overflow = self.upper.num_free_blocks - self.max_protected
        if overflow > 0:
            demoted = self.upper.popleft_n(overflow)
            in_upper = self.in_upper
            for block in demoted:
                in_upper[block.block_id] = 0
            self.num_free_blocks -= overflow
            self.append_n(demoted)
