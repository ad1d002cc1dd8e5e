"""KV-cache blocks.

Every :class:`KVCacheBlock` is created once, when the pool is built. The free queue
(:mod:`prefixcache.core.eviction`) threads its linked list through the blocks themselves
(``prev_free_block`` / ``next_free_block``), so taking a block out of the middle — which
every cache hit on a free block does — is O(1) and allocates nothing on the hot path.
"""

from __future__ import annotations

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
