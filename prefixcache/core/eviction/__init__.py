"""Eviction policies: where released blocks go in the free queue, and so which free block
is evicted next.

The block pool takes blocks for new content from the head of its free queue; a policy is
the queue's class, a :class:`FreeKVCacheBlockQueue` (``base.py``), which declares every
method the pool calls and gives each the design's LRU behaviour. One file per policy
family; :data:`EVICTION_POLICIES` is the registry, name -> policy class (called with the
pool's blocks, it builds the queue). To add a policy: write its class in a new file, with
``policy_name`` and a one-line ``summary``, and list it in the registry below. What each
policy does and where it wins is in ``docs/eviction-policies.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.adaptive import AdaptiveFreeBlockQueue
from prefixcache.core.eviction.base import FreeKVCacheBlockQueue
from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.core.eviction.learned_reuse import (
    LearnedReuseFreeBlockQueue,
    output_length_signature,
)
from prefixcache.core.eviction.lru import LRUFreeBlockQueue
from prefixcache.core.eviction.segmented import (
    TwoQueueFreeBlockQueue,
    TwoSegmentFreeBlockQueue,
    UnhashedFirstFreeBlockQueue,
)

if TYPE_CHECKING:
    from prefixcache.core.block_pool import BlockHashToBlockMap

#: The registry, in the order help texts list the policies.
EVICTION_POLICIES: dict[str, type[FreeKVCacheBlockQueue]] = {
    policy.policy_name: policy for policy in (
        LRUFreeBlockQueue,
        UnhashedFirstFreeBlockQueue,
        TwoQueueFreeBlockQueue,
        LearnedReuseFreeBlockQueue,
        DocumentLivenessFreeBlockQueue,
        AdaptiveFreeBlockQueue,
    )
}
DEFAULT_EVICTION_POLICY = LRUFreeBlockQueue.policy_name

#: Builds a free queue outside the registry (the trace replayer's offline oracles): called
#: once with the pool's blocks (the queue starts with all of them, in order) and the
#: pool's hash-to-block map, which an oracle may read to see duplicated hashes.
FreeQueueFactory = Callable[[list[KVCacheBlock], "BlockHashToBlockMap"], FreeKVCacheBlockQueue]


def make_free_block_queue(
    policy_name: str, blocks: Iterable[KVCacheBlock]
) -> FreeKVCacheBlockQueue:
    """The free queue of policy ``policy_name``, initially holding ``blocks`` in order.
    Raises ValueError, naming the choices, for an unknown name."""
    try:
        policy = EVICTION_POLICIES[policy_name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy_name!r}; choose one of "
            f"{', '.join(EVICTION_POLICIES)}"
        ) from None
    return policy(blocks)


def describe_eviction_policies() -> str:
    """Every registered policy with its summary, for help texts: ``"lru (the design's
    order), unhashed-first (vLLM 0.33's order), ..."``."""
    return ", ".join(f"{name} ({policy.summary})" for name, policy in EVICTION_POLICIES.items())


__all__ = [
    "AdaptiveFreeBlockQueue",
    "DEFAULT_EVICTION_POLICY",
    "EVICTION_POLICIES",
    "DocumentLivenessFreeBlockQueue",
    "FreeKVCacheBlockQueue",
    "FreeQueueFactory",
    "LRUFreeBlockQueue",
    "LearnedReuseFreeBlockQueue",
    "TwoQueueFreeBlockQueue",
    "TwoSegmentFreeBlockQueue",
    "UnhashedFirstFreeBlockQueue",
    "describe_eviction_policies",
    "make_free_block_queue",
    "output_length_signature",
]
