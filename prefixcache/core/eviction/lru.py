"""``lru``: the design's order, and the core's default."""

from __future__ import annotations

from prefixcache.core.eviction.base import FreeKVCacheBlockQueue


class LRUFreeBlockQueue(FreeKVCacheBlockQueue):
    """Released blocks join the tail in the order given: the head is the least recently
    released block, and a request's deepest blocks go before its prefix. Every method is
    the contract's default."""

    policy_name = "lru"
    summary = "the design's order"
