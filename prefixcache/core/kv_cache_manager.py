"""The KV cache manager: which blocks hold each request's KV, and which are reused.

The scheduler drives it per request:

1. ``get_computed_blocks(request)`` — the longest run of cached full blocks matching the
   request's prefix. Read-only: no reference counts (nor statistics) change, so a request
   that is then not scheduled leaves no trace.
2. ``allocate_slots(request, num_new_tokens, ...)`` — make room for the tokens to compute
   now. It checks first and returns None, changing nothing, when they cannot fit; else it
   touches the hit blocks, pops new blocks from the free queue head (evicting what they
   cached) and caches every block that became full, so requests later in the same batch
   can already hit it.
3. The caller advances ``request.num_computed_tokens`` and appends sampled tokens.
4. ``free(request)`` — release the block table in reverse order, so a request's deepest
   blocks are evicted first and its shared prefix last.

Block tables are append-only: a block that turns out to duplicate a cached one stays in
the table until the request is freed (the design's "duplicated blocks"); freeing it then
drops the redundant copy's hash, so one hash is held by one free block.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.core.arithmetic import cdiv
from prefixcache.core.block import KVCacheBlock
from prefixcache.core.block_pool import BlockPool
from prefixcache.core.eviction import DEFAULT_EVICTION_POLICY, FreeQueueFactory
from prefixcache.core.hashing import DEFAULT_HASH_ALGO, BlockHasher, get_hash_fn
from prefixcache.core.kv_events import DEFAULT_MEDIUM, KVCacheEvent
from prefixcache.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache use since the last read, counted once per admission: ``requests``
    admitted that read the cache (caching on, ``skip_reading_prefix_cache`` off), their
    tokens at admission (``queries``) and of those, tokens served from the cache
    (``hits``).

    An admission is a request's first allocation (:meth:`KVCacheManager.allocate_slots`
    on a request holding no blocks) — not each lookup, since a scheduler looks a request
    that does not fit yet up again at every step. A preempted request (``num_preemptions``
    above zero), freed and admitted again, is counted in ``preempted_requests``,
    ``preempted_queries`` and ``preempted_hits`` instead, as in vLLM: its hits spare a
    recomputation, not a first computation, and would otherwise inflate the hit rate.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates paged KV blocks to requests and reuses cached prefix blocks.

    ``num_blocks`` blocks of ``block_size`` tokens each. With ``enable_caching=False``
    nothing is hashed or reused. ``hash_algo``/``hash_seed`` choose the block hash (see
    :mod:`prefixcache.core.hashing`), ``eviction_policy`` the free-queue order by name (see
    :mod:`prefixcache.core.eviction`), or ``free_queue_factory`` builds the free queue for
    a policy outside the registry (``eviction_policy`` then only names it).
    ``verify_cached_tokens`` is the collision guard:
    every hit is checked against the token ids (and extra keys) the cached block was
    stored with, so even a colliding fast hash can never serve another prefix's KV.
    ``enable_events`` records :mod:`~prefixcache.core.kv_events` for ``take_events``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = DEFAULT_HASH_ALGO,
        hash_seed: str | None = None,
        enable_events: bool = False,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        verify_cached_tokens: bool = False,
        medium: str | None = DEFAULT_MEDIUM,
        free_queue_factory: FreeQueueFactory | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        if enable_caching:
            self.block_hasher: BlockHasher | None = BlockHasher(block_size, hash_algo, hash_seed)
        else:
            get_hash_fn(hash_algo)  # still reject a bad name, even though nothing is hashed
            self.block_hasher = None
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching=enable_caching,
            eviction_policy=eviction_policy,
            enable_events=enable_events and enable_caching,
            verify_cached_tokens=verify_cached_tokens and enable_caching,
            medium=medium,
            free_queue_factory=free_queue_factory,
        )
        self.verify_cached_tokens = self.block_pool.verify_cached_tokens
        self.num_hash_collisions = 0
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request's table are already cached.
        self.req_to_num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- lookup -----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix, and their token count.

        At least the last prompt token is always left to compute (its logits are needed),
        so a hit covers at most ``(num_tokens - 1) // block_size`` blocks. Changes no
        reference counts, nor the statistics (counted at admission, by
        :meth:`allocate_slots`). Requests with ``skip_reading_prefix_cache`` get no hit (they
        still write their blocks to the cache when allocated).
        """
        if not self.enable_caching:
            return [], 0
        request.attach_block_hasher(self.block_hasher)
        if request.skip_reading_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.verify_cached_tokens:
            computed = self._find_verified_hits(request, max_hit_blocks)
        else:
            computed = self.block_pool.cached_block_hash_to_block.get_longest_cached_prefix(
                request.block_hashes, max_hit_blocks)
        return computed, len(computed) * self.block_size

    def _find_verified_hits(self, request: Request, max_hit_blocks: int) -> list[KVCacheBlock]:
        """Like the plain lookup, but a block counts only if it holds this very content:
        the same token ids and the same extra keys as the request's block. Among duplicates
        that hold it, the one the plain lookup would take is preferred the same way."""
        pool = self.block_pool
        contents = pool.block_contents
        cache = pool.cached_block_hash_to_block
        get_one_block = cache.get_one_block
        request_block_content = pool.request_block_content
        block_hashes = request.block_hashes
        block_size = self.block_size
        computed: list[KVCacheBlock] = []
        for i in range(min(max_hit_blocks, len(block_hashes))):
            block_hash = block_hashes[i]
            match = get_one_block(block_hash)
            if match is None:
                break
            expected = request_block_content(request, i, block_size)
            if contents[match.block_id] != expected:
                # A colliding hash: another block filed under it may hold this content.
                match = cache.pick_block_to_share(
                    b for b in cache.get_all_blocks(block_hash)
                    if contents[b.block_id] == expected)
            if match is None:
                self.num_hash_collisions += 1
                break
            computed.append(match)
        return computed

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` tokens after its computed ones.

        ``new_computed_blocks``/``num_new_computed_tokens`` are a fresh cache hit from
        :meth:`get_computed_blocks` (new requests only). ``num_lookahead_tokens`` reserves
        extra slots that are not cached yet. Returns the newly allocated blocks (possibly
        empty), or None — with nothing changed — when the free blocks cannot cover them
        (hit blocks that are free count against capacity, since touching takes them). A
        request's first allocation is its admission: it counts in the prefix-cache
        statistics then, with ``num_new_computed_tokens`` as its hits.

        Raises ValueError, with nothing changed, for a negative count, hit blocks for a
        request that already holds blocks, ``num_new_computed_tokens`` other than the hit
        blocks' tokens, or prompt tokens that cannot be hashed.
        """
        block_size = self.block_size
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_hit_blocks = self._check_allocation(request_id, req_blocks, num_new_tokens,
                                                num_new_computed_tokens, new_computed_blocks,
                                                num_lookahead_tokens)
        num_existing_blocks = 0 if req_blocks is None else len(req_blocks)

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_slots_needed = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_required_blocks = cdiv(num_slots_needed, block_size)
        num_new_blocks = num_required_blocks - num_existing_blocks - num_hit_blocks

        caching = self.enable_caching
        if caching:
            # Hash the request (if new to us) before the check: hashing may raise on bad
            # tokens. Every block that becomes full must have its hash by now.
            if request.block_hasher is None:
                request.attach_block_hasher(self.block_hasher)
            num_full_blocks = min(num_computed_tokens + num_new_tokens,
                                  request.num_tokens) // block_size
            num_cached = num_hit_blocks if req_blocks is None else \
                self.req_to_num_cached_blocks[request_id] + num_hit_blocks
            if num_full_blocks > num_cached and num_full_blocks > len(request.block_hashes):
                raise ValueError(
                    f"request {request_id!r} has {request.num_tokens} tokens but hashes for "
                    f"{len(request.block_hashes)} blocks: append tokens with "
                    "append_output_token_ids, not to all_token_ids directly")
        pool = self.block_pool
        if num_new_blocks > 0:
            num_free_hit_blocks = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) \
                if num_hit_blocks else 0
            if num_new_blocks > pool.free_block_queue.num_free_blocks - num_free_hit_blocks:
                return None

        # Committed from here on: nothing below can fail.
        if req_blocks is None:  # the request's admission
            req_blocks = self.req_to_blocks[request_id] = []
            self.req_to_num_cached_blocks[request_id] = 0
            if caching and not request.skip_reading_prefix_cache:
                stats = self.prefix_cache_stats
                if request.num_preemptions:
                    stats.preempted_requests += 1
                    stats.preempted_queries += request.num_tokens
                    stats.preempted_hits += num_new_computed_tokens
                else:
                    stats.requests += 1
                    stats.queries += request.num_tokens
                    stats.hits += num_new_computed_tokens
        if num_hit_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if caching:
            if num_full_blocks > num_cached:
                pool.cache_full_blocks(request, req_blocks, num_cached, num_full_blocks,
                                       block_size)
                self.req_to_num_cached_blocks[request_id] = num_full_blocks
            elif num_hit_blocks:
                self.req_to_num_cached_blocks[request_id] = num_cached
        return new_blocks

    def _check_allocation(self, request_id: str, req_blocks: list[KVCacheBlock] | None,
                          num_new_tokens: int, num_new_computed_tokens: int,
                          new_computed_blocks: list[KVCacheBlock] | None,
                          num_lookahead_tokens: int) -> int:
        """:meth:`allocate_slots`' argument checks (its docstring lists them), before
        anything changes; returns the number of hit blocks."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("num_new_computed_tokens and num_lookahead_tokens must be >= 0")
        if not new_computed_blocks:
            if num_new_computed_tokens:
                raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} without "
                                 "the hit blocks (new_computed_blocks) that hold them")
            return 0
        num_hit_blocks = len(new_computed_blocks)
        if req_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks: a cache hit "
                             "can only be added before its first allocation")
        if num_new_computed_tokens != num_hit_blocks * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{num_hit_blocks} hit blocks of {self.block_size} tokens")
        return num_hit_blocks

    def uncache_uncomputed(self, request: Request, num_computed_tokens: int) -> None:
        """The request's KV was written only for its first ``num_computed_tokens`` tokens:
        the model step scheduled to compute the rest failed. Its blocks past them were
        cached as soon as they were scheduled full, so drop those hashes before anyone
        hits them (a request sharing them in the same step failed with it). Call it
        before :meth:`free`; a request holding no blocks is a no-op."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        # Blocks before this one were full, and so written, before the failed step.
        first_unwritten = num_computed_tokens // self.block_size
        self.block_pool.uncache_unwritten(blocks[first_unwritten:])
        if self.req_to_num_cached_blocks.get(request_id, 0) > first_unwritten:
            self.req_to_num_cached_blocks[request_id] = first_unwritten

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first. Freeing a request that holds no
        blocks (never allocated, or already freed) is a no-op, so abort paths may call it
        unconditionally."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks), request)

    # -- inspection and control -------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids ([] for an unknown request)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached free blocks count as free)."""
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block. False, and nothing changed, while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The admissions' cache use since the previous call (see
        :class:`PrefixCacheStats`); the counters start again from zero."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV events recorded since the last call ([] when events are off)."""
        return self.block_pool.take_events()
