"""KV-cache blocks and the free block queue.

Every :class:`KVCacheBlock` is created once, when the pool is built. The free queue is an
intrusive doubly linked list threaded through the blocks themselves (``prev_free_block`` /
``next_free_block``) between two sentinel blocks, so removing a block from the middle —
which happens whenever a cache hit "touches" a free block — is O(1) and no wrapper objects
are allocated on the hot path.

The queue's order *is* the eviction order: blocks are taken from the head. Who appends
where (the free-order policy) is decided in :mod:`prefixcache.core.eviction`.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.core.hashing import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in the paged KV cache.

    ``block_hash`` is set when the block is full and cached, and cleared when it is
    evicted; ``ref_cnt`` counts the requests whose block tables hold it. A block is in the
    free queue exactly when ``ref_cnt == 0``.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"hashed={self.block_hash is not None})")


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, head = next to evict, between two sentinels.

    Every operation is O(1) per block moved. Blocks must be passed in only while they are
    not in the queue, and removed only while they are; the manager guarantees both through
    ``ref_cnt``.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    #: Whether the pool should call :meth:`note_hit_in_use`. Off by default, so a policy
    #: that does not learn from hits costs the hit path nothing.
    observes_hits_in_use = False

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when empty."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        following = block.next_free_block
        self.fake_free_list_head.next_free_block = following
        following.prev_free_block = self.fake_free_list_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first. Raises ValueError, removing
        nothing, if ``n`` is negative or fewer than ``n`` are free."""
        if not self._can_take(n):
            return []
        head = self.fake_free_list_head
        block = head.next_free_block
        popped = [None] * n
        for i in range(n):
            popped[i] = block
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return popped

    def _can_take(self, n: int) -> bool:
        """``popleft_n``'s checks, for every queue: ValueError if ``n`` is negative (it
        would corrupt ``num_free_blocks``) or more than are free; False for 0."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise ValueError(
                f"No free blocks available: asked for {n}, {self.num_free_blocks} free"
            )
        return n > 0

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail in the given order (the last one is evicted last)."""
        if blocks:
            tail = self.fake_free_list_tail
            self._link_between(tail.prev_free_block, blocks, tail)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head in the given order (the first one is evicted first)."""
        if blocks:
            head = self.fake_free_list_head
            self._link_between(head, blocks, head.next_free_block)

    def _link_between(self, before: KVCacheBlock, blocks: list[KVCacheBlock],
                      after: KVCacheBlock) -> None:
        """Link ``blocks``, in order, between the adjacent nodes ``before`` and ``after``."""
        last = before
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = after
        after.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def note_hit_in_use(self, block: KVCacheBlock) -> None:
        """Called by the pool (only if :attr:`observes_hits_in_use`) when a request hits
        ``block`` while another request holds it, so the block is not in the queue: a
        reuse the queue would otherwise never see."""

    def forget_cached_content(self) -> None:
        """Called by the pool's prefix-cache reset, once every hash is dropped (so every
        block is free): a policy forgets what it remembers of cached content (ghost lists,
        reuse marks, segments). The linked list itself keeps no such memory."""

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next to evict) to tail. O(n); for tests and tools."""
        blocks = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
