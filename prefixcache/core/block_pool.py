"""The block pool: every block, the free queue, and the map from block hash to cached block.

Mechanism only — the KV cache manager decides which request gets which blocks; the pool
keeps the books:

* ``blocks[i]`` is block ``i``, created once.
* ``free_block_queue`` holds exactly the blocks with ``ref_cnt == 0``, in eviction order
  (head first). Its class is the eviction policy (:mod:`prefixcache.core.eviction`),
  chosen by name or built by a factory when the pool is; it is never replaced.
* ``cached_block_hash_to_block`` finds a cached block by hash. A cached block may be free
  (ref 0, still reusable until evicted) or in use.

Invariants kept by every public method: a block is cached iff it has a ``block_hash``
and is findable under it. A block loses its hash (cleared, removed from the map) in
three places only: when it is taken from the head of the free queue for new content
(evicted); when it is released while another block still holds its hash (a redundant
duplicate, :meth:`BlockPool._uncache_released_duplicates`; the hash stays cached); and
when :meth:`BlockPool.reset_prefix_cache` forgets every hash.

KV events (when enabled) describe the set of cached *hashes*: ``BlockStored`` lists a hash
only when it becomes findable, ``BlockRemoved`` only when no block holds it any more. So a
router's set of hashes built from the events equals ours even when duplicate blocks hold
one hash (vLLM reports each duplicate block, which a set-based index cannot follow).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction import (
    DEFAULT_EVICTION_POLICY,
    FreeQueueFactory,
    make_free_block_queue,
)
from prefixcache.core.kv_events import (
    DEFAULT_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

if TYPE_CHECKING:
    from prefixcache.core.hashing import BlockHash
    from prefixcache.core.request import Request

# What a cached block holds, compared by the collision guard: (token ids, extra keys).
BlockContent = tuple[list[int], "tuple | None"]


class BlockHashToBlockMap:
    """Block hash -> cached block(s). One hash may be held by several blocks (duplicates).

    A key maps to a single :class:`KVCacheBlock` in the common case and to a
    ``{block_id: block}`` dict (insertion order) once duplicates exist, so the common
    lookup costs one dict access.
    """

    __slots__ = ("_cache", "_num_blocks")

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._num_blocks = 0

    @property
    def num_duplicate_blocks(self) -> int:
        """Blocks cached under a hash that another block also holds."""
        return self._num_blocks - len(self._cache)

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cache

    def keys(self):
        return self._cache.keys()

    @staticmethod
    def pick_block_to_share(blocks: Iterable[KVCacheBlock]) -> KVCacheBlock | None:
        """Of ``blocks``, duplicates holding the same content, the one a cache hit takes:
        the first in use (``ref_cnt > 0``), else the first; None when there are none.

        Every lookup decides between duplicates here. In use is preferred because sharing
        a block another request holds takes nothing from the free queue, so the hit costs
        no free block (taking the free copy would spend one on content already in use);
        and so whether a request fits does not depend on whether the eviction policy
        happened to keep the free copy around.
        """
        first = None
        for block in blocks:
            if block.ref_cnt:
                return block
            if first is None:
                first = block
        return first

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block a cache hit on ``block_hash`` takes (see :meth:`pick_block_to_share`),
        or None when the hash is not cached."""
        entry = self._cache.get(block_hash)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return self.pick_block_to_share(entry.values())

    def get_longest_cached_prefix(self, block_hashes: list[BlockHash],
                                  max_num_blocks: int) -> list[KVCacheBlock]:
        """For the leading ``block_hashes`` (at most ``max_num_blocks``) that are all cached,
        the block a hit on each takes (as :meth:`get_one_block`), stopping at the first
        miss. One loop, as it runs for every prompt looked up."""
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        lookup = self._cache.get
        for i in range(min(max_num_blocks, len(block_hashes))):
            entry = lookup(block_hashes[i])
            if entry is None:
                break
            if type(entry) is not KVCacheBlock:
                entry = self.pick_block_to_share(entry.values())
            append(entry)
        return blocks

    def get_all_blocks(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        entry = self._cache.get(block_hash)
        if entry is None:
            return []
        if type(entry) is KVCacheBlock:
            return [entry]
        return list(entry.values())

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> bool:
        """Add ``block`` under ``block_hash``; True when the hash was not cached before."""
        cache = self._cache
        entry = cache.get(block_hash)
        self._num_blocks += 1
        if entry is None:
            cache[block_hash] = block
            return True
        if type(entry) is KVCacheBlock:
            cache[block_hash] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block
        return False

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from under ``block_hash``; the removed block, or None
        when that block is not cached under that hash (then nothing changes)."""
        cache = self._cache
        entry = cache.get(block_hash)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id != block_id:
                return None
            del cache[block_hash]
            self._num_blocks -= 1
            return entry
        block = entry.pop(block_id, None)
        if block is not None:
            self._num_blocks -= 1
        if not entry:
            del cache[block_hash]
        return block

    def clear(self) -> None:
        self._cache.clear()
        self._num_blocks = 0


class BlockPool:
    """Owns all ``num_blocks`` blocks of one KV cache; see the module docstring.

    The free queue is the registered policy ``eviction_policy`` or, when
    ``free_queue_factory`` is given, what it builds (``eviction_policy`` then only names
    it): see :data:`~prefixcache.core.eviction.FreeQueueFactory`.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        enable_events: bool = False,
        verify_cached_tokens: bool = False,
        medium: str | None = DEFAULT_MEDIUM,
        free_queue_factory: FreeQueueFactory | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        if free_queue_factory is None:
            self.free_block_queue = make_free_block_queue(eviction_policy, self.blocks)
        else:
            self.free_block_queue = free_queue_factory(self.blocks,
                                                       self.cached_block_hash_to_block)
        self.eviction_policy = eviction_policy
        # Fixed with the queue: policies that do not learn from hits in use cost the hit
        # path nothing.
        self._observes_hits_in_use = self.free_block_queue.observes_hits_in_use
        self.enable_events = enable_events
        self.medium = medium
        self._events: list[KVCacheEvent] = []
        self.num_evictions = 0
        # The collision guard remembers what each cached block holds, by block id.
        self.verify_cached_tokens = verify_cached_tokens
        self.block_contents: list[BlockContent | None] | None = (
            [None] * num_blocks if verify_cached_tokens else None
        )

    # -- lookup -----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block a cache hit on ``block_hash`` takes, or None (see
        :meth:`BlockHashToBlockMap.pick_block_to_share`)."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    # -- allocation -------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue so
        they cannot be evicted while in use. Hits on blocks already in use are reported to
        a free queue that observes them."""
        queue = self.free_block_queue
        remove = queue.remove
        note_hit_in_use = queue.note_hit_in_use if self._observes_hits_in_use else None
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            elif note_hit_in_use is not None:
                note_hit_in_use(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with ref 1,
        evicting any cached content they held. Raises ValueError, changing nothing, if
        ``num_blocks`` is negative or too few are free.

        With events on, the hashes this evicts go out as one ``BlockRemoved``: a batch
        allocation evicts dozens of blocks, and one event per block cost more than the
        allocation itself."""
        if num_blocks < 0:  # checked here too: an eviction policy may not check it
            raise ValueError(f"cannot take a negative number of blocks ({num_blocks})")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            removed_hashes: list[BlockHash] | None = [] if self.enable_events else None
            for block in blocks:
                if block.block_hash is not None:
                    self._evict(block, removed_hashes)
                block.ref_cnt = 1
            if removed_hashes:
                self._events.append(BlockRemoved(block_hashes=removed_hashes,
                                                 medium=self.medium))
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock, removed_hashes: list[BlockHash] | None) -> None:
        """Uncache ``block``, taken for new content; its hash joins ``removed_hashes``
        (when given) if no other block still holds it."""
        self._drop_hash(block, removed_hashes)
        self.num_evictions += 1

    def _drop_hash(self, block: KVCacheBlock, removed_hashes: list[BlockHash] | None) -> None:
        """Uncache ``block``; its hash joins ``removed_hashes`` (when given) if no other
        block still holds it."""
        block_hash = block.block_hash
        cache = self.cached_block_hash_to_block
        cache.pop(block_hash, block.block_id)
        block.block_hash = None
        if self.block_contents is not None:
            self.block_contents[block.block_id] = None
        if removed_hashes is not None and block_hash not in cache:
            removed_hashes.append(block_hash)

    def uncache_unwritten(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the hashes of ``blocks`` (held by a request) whose KV was never written:
        they were cached when scheduled, and the model step that was to fill them failed.
        No lookup can hit them afterwards; hashes no other block holds go out as one
        ``BlockRemoved``. Not evictions: ``num_evictions`` is unchanged."""
        if not self.enable_caching:
            return
        removed_hashes: list[BlockHash] | None = [] if self.enable_events else None
        for block in blocks:
            if block.block_hash is not None:
                self._drop_hash(block, removed_hashes)
        if removed_hashes:
            self._events.append(BlockRemoved(block_hashes=removed_hashes, medium=self.medium))

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int,
                          block_size: int) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes.

        ``blocks`` is the request's block table; the blocks before ``num_cached_blocks``
        are already cached (hits or earlier steps); the rest are fresh and unhashed.
        """
        block_hashes = request.block_hashes
        insert = self.cached_block_hash_to_block.insert
        contents = self.block_contents
        emit = self.enable_events
        new_hash_indices: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            is_new_hash = insert(block_hash, block)
            if contents is not None:
                contents[block.block_id] = self.request_block_content(request, i, block_size)
            if emit and is_new_hash:
                new_hash_indices.append(i)
        if new_hash_indices:
            self._emit_stored(request, new_hash_indices, block_size)

    @staticmethod
    def request_block_content(request: Request, block_index: int,
                              block_size: int) -> BlockContent:
        """What full block ``block_index`` of ``request`` holds, for the collision guard."""
        start = block_index * block_size
        extra = request.block_extra_keys(block_index, block_size) if request.has_extra_keys \
            else None
        return request.all_token_ids[start:start + block_size], extra

    def _emit_stored(self, request: Request, block_indices: list[int], block_size: int) -> None:
        """One BlockStored per run of consecutive newly cached hashes."""
        block_hashes = request.block_hashes
        run_start = 0
        for k in range(1, len(block_indices) + 1):
            if k < len(block_indices) and block_indices[k] == block_indices[k - 1] + 1:
                continue
            first, last = block_indices[run_start], block_indices[k - 1]
            self._events.append(BlockStored(
                block_hashes=block_hashes[first:last + 1],
                parent_block_hash=block_hashes[first - 1] if first > 0 else None,
                token_ids=request.all_token_ids[first * block_size:(last + 1) * block_size],
                block_size=block_size,
                lora_id=request.lora_id,
                medium=self.medium,
                lora_name=request.lora_name,
                extra_keys=[request.block_extra_keys(i, block_size)
                            for i in range(first, last + 1)] if request.has_extra_keys
                else None,
            ))
            run_start = k

    # -- release ----------------------------------------------------------------------

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock],
                    request: Request | None = None) -> None:
        """Drop one reference from each block; blocks reaching zero are released to the
        free queue in the given order (first given = evicted first, under ``lru``).
        ``request``, whose blocks they are, is passed on to the eviction policy.

        A block that is already free is freed twice: ValueError, raised once the blocks
        before it are released as usual (so the pool stays consistent); it and the blocks
        after it are left as they were.
        """
        released = []
        for block in ordered_blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt == 1:
                released.append(block)
            elif ref_cnt < 1:  # only shared blocks reach this test: free on the hot path
                if released:
                    self._release(released, request)
                raise ValueError(f"block {block.block_id} is already free (ref_cnt "
                                 f"{ref_cnt}): freed twice?")
            block.ref_cnt = ref_cnt - 1
        if released:
            self._release(released, request)

    def _release(self, released: list[KVCacheBlock], request: Request | None) -> None:
        """Hand blocks that just reached ``ref_cnt == 0`` to the free queue."""
        if self.cached_block_hash_to_block.num_duplicate_blocks:
            self._uncache_released_duplicates(released)
        self.free_block_queue.release(released, request)

    def _uncache_released_duplicates(self, released: list[KVCacheBlock]) -> None:
        """A released block whose hash another block also holds is redundant: drop its
        hash, so the design's duplicated blocks disappear when their request is freed and
        the hash stays on exactly one block. The hash itself remains cached, so no event."""
        cache = self.cached_block_hash_to_block
        for block in released:
            block_hash = block.block_hash
            if block_hash is not None and len(cache.get_all_blocks(block_hash)) > 1:
                self._drop_hash(block, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block is
        held by a request, since its hash would then outlive the map entry."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.block_contents is not None:
            self.block_contents = [None] * self.num_blocks
        self.free_block_queue.forget_cached_content()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Drain and return the events since the last call (oldest first)."""
        events = self._events
        self._events = []
        return events
