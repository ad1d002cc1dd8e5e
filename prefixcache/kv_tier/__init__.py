"""prefixcache.kv_tier — a second KV tier behind the block pool, shared by replicas
(Redis/Valkey) or kept across restarts (a local directory).

The in-process block pool stays the first tier. On a local miss the scheduler asks the
tier how many further blocks of the prompt's hash chain it holds, loads them and has the
worker copy their bytes into freshly allocated blocks before the prefill; blocks the
engine computes are offered to the tier by a background writer. See :mod:`.tier` for the
contract, :mod:`.identity` for what makes two engines' blocks interchangeable and
:mod:`.block_value` for how every value is verified before use.

Torch-free: the tier moves bytes; :mod:`prefixcache.worker.kv_transfer` turns them into
tensors.
"""

from __future__ import annotations

from prefixcache.kv_tier.backend import KVTierBackend
from prefixcache.kv_tier.identity import (
    KV_LAYOUT_VERSION,
    KVLayout,
    unshareable_hash_seed_reason,
)
from prefixcache.kv_tier.tier import (
    ADMISSION_POLICIES,
    DEFAULT_WRITE_QUEUE_BYTES,
    KVTier,
    KVTierStats,
)

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_WRITE_QUEUE_BYTES",
    "KV_LAYOUT_VERSION",
    "KVLayout",
    "KVTier",
    "KVTierBackend",
    "KVTierStats",
    "kv_tier_url_problem",
    "open_backend",
    "unshareable_hash_seed_reason",
]

DISK_PREFIX = "disk:"
URL_FORMS = "redis://HOST:PORT/DB (Redis or Valkey) or disk:/PATH (a local directory)"


def kv_tier_url_problem(url: str) -> str | None:
    """What is wrong with a ``--kv-tier`` value, or None (no connection is made)."""
    from prefixcache.kv_tier.redis_backend import redis_url_problem

    if url.startswith(DISK_PREFIX):
        return None if url[len(DISK_PREFIX):] else "disk: needs a directory, e.g. disk:/var/kv"
    if "://" not in url:
        return f"expected {URL_FORMS}"
    problem = redis_url_problem(url)
    return None if problem is None else f"{problem} (expected {URL_FORMS})"


def open_backend(url: str, *, max_bytes: int | None = None,
                 timeout_s: float = 1.0) -> KVTierBackend:
    """The backend a ``--kv-tier`` value names. ``max_bytes`` bounds a disk tier (a Redis
    server is bounded by its own ``maxmemory``: ValueError if given). Connecting to Redis
    is lazy: a server that is down makes misses, not a failure here."""
    problem = kv_tier_url_problem(url)
    if problem is not None:
        raise ValueError(f"--kv-tier {url!r}: {problem}")
    if url.startswith(DISK_PREFIX):
        from prefixcache.kv_tier.disk_backend import DiskBackend

        return DiskBackend(url[len(DISK_PREFIX):], max_bytes=max_bytes)
    if max_bytes is not None:
        raise ValueError("--kv-tier-max-size bounds a disk tier; bound a Redis/Valkey tier "
                         "with the server's maxmemory and maxmemory-policy allkeys-lru")
    from prefixcache.kv_tier.redis_backend import RedisBackend

    return RedisBackend(url, timeout_s=timeout_s)
