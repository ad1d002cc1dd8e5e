"""prefixcache.core — the automatic prefix caching KV-cache manager.

Vocabulary, used with these meanings everywhere in the project:

block
    ``block_size`` consecutive token slots of the paged KV cache, identified by a
    ``block_id``. Every block exists from start-up (:class:`KVCacheBlock`).
slot
    One token's place in a block: ``block_id * block_size + offset``.
computed
    A request's tokens whose KV is already in its blocks (``num_computed_tokens``).
cached
    A *full* block registered under its block hash, so other requests can reuse it. A
    cached block stays cached after its requests finish, until it is evicted.
hit
    Prompt tokens that a request did not have to compute because their blocks were cached
    (``num_hit_tokens``; always whole blocks, never the last prompt token).

This package depends only on the standard library, ``cbor2`` and, for the xxhash
algorithms, the optional ``xxhash`` package. It never imports torch or numpy.
"""

from prefixcache.core.arithmetic import cdiv
from prefixcache.core.block import KVCacheBlock
from prefixcache.core.block_pool import BlockHashToBlockMap, BlockPool
from prefixcache.core.eviction import (
    DEFAULT_EVICTION_POLICY,
    EVICTION_POLICIES,
    FreeKVCacheBlockQueue,
    FreeQueueFactory,
    describe_eviction_policies,
)
from prefixcache.core.hashing import (
    DEFAULT_HASH_ALGO,
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    BlockHash,
    BlockHasher,
    block_hash_to_int64,
    get_hash_fn,
    resolve_hash_seed,
)
from prefixcache.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from prefixcache.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefixcache.core.request import MultiModalFeature, Request

__all__ = [
    "DEFAULT_EVICTION_POLICY",
    "DEFAULT_HASH_ALGO",
    "DEFAULT_HASH_SEED",
    "EVICTION_POLICIES",
    "HASH_ALGOS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "FreeQueueFactory",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "block_hash_to_int64",
    "cdiv",
    "describe_eviction_policies",
    "get_hash_fn",
    "resolve_hash_seed",
]
