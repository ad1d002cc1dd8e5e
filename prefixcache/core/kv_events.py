"""KV-cache events: what the block pool reports about the cached set.

These are plain, dependency-free records. The block pool appends them as blocks become
cached, are evicted, or are all cleared; ``KVCacheManager.take_events()`` drains them.
The wire encoding (msgspec msgpack, vLLM-compatible) lives in ``prefixcache.events``,
which depends on this module and never the other way round.

Block hashes here are the raw ``bytes`` the core computes; converting them to the 64-bit
integers that routers expect is the wire layer's job.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's name for the primary KV tier. Routers compare it as a string, so we keep vLLM's
# spelling even though our primary tier may live in host memory.
DEFAULT_MEDIUM = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of consecutive blocks of one request became cached.

    ``token_ids`` holds ``block_size * len(block_hashes)`` tokens, block after block.
    ``parent_block_hash`` is the hash of the block logically before the first stored one,
    or None when the first stored block starts the sequence. ``extra_keys`` has one entry
    per stored block: that block's tagged extra-key tuple, or None when it has none.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = DEFAULT_MEDIUM
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes are no longer cached: each was evicted from the last block holding it.
    Evicting one of several duplicate blocks of a hash reports nothing; one event covers
    every hash that one allocation evicted."""

    block_hashes: list[bytes]
    medium: str | None = DEFAULT_MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset; every previously stored hash is gone."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
