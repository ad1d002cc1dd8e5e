"""Dead-content oracles: what an online policy would gain by knowing which content is
never looked up again.

Belady's optimum (:mod:`prefixcache.sim.belady`) knows *when* every hash comes back. These
offline free queues know less — only *whether* it comes back — which is what a perfect
reuse predictor (a learned policy at its best) could know. They answer "how much of the
LRU→Belady gap is a question of recognising dead content, and of which kind":

``dead-first``
    Evict first the free blocks whose hash is never usefully accessed again (same *useful*
    as Belady's: within a later admitted request's hit-able blocks); otherwise ``lru``.
``dead-once-first``
    The same, but only for content used by a single request so far (seen once): the part
    a policy could find from what the request that cached it looked like.
``dead-repeat-first``
    Only for content already reused: the part that needs predicting when a reused
    document's last question has come.

Unhashed blocks go first, as in ``unhashed-first``. A block's class is fixed when it is
released; a block whose last use passes without hitting it (its prefix was evicted) stays
where it was, so these are diagnostics, not optima — but still offline, so they are never
reported as the best online policy.
"""

from __future__ import annotations

from prefixcache.core import KVCacheBlock
from prefixcache.core.eviction.segmented import TwoSegmentFreeBlockQueue
from prefixcache.sim.belady import NEVER, FutureUses

DEAD_CONTENT_KINDS = {
    "dead-first": "any",
    "dead-once-first": "once",
    "dead-repeat-first": "repeat",
}


class DeadContentFirstFreeBlockQueue(TwoSegmentFreeBlockQueue):
    """Free queue that evicts dead content of ``kind`` ("any", "once" or "repeat") first.

    The replay sets :attr:`now` to the admission index of the latest request, as for
    :class:`~prefixcache.sim.belady.BeladyFreeBlockQueue`.
    """

    def __init__(self, blocks, future: FutureUses, kind: str) -> None:
        if kind not in ("any", "once", "repeat"):
            raise ValueError(f"unknown dead-content kind {kind!r}")
        self.future = future
        self.kind = kind
        self.now = -1
        super().__init__(blocks)

    def _is_evicted_first(self, block: KVCacheBlock) -> bool:
        future, now = self.future, self.now
        block_hash = block.block_hash
        if future.next_use(block_hash, now) != NEVER:
            return False
        if self.kind == "any":
            return True
        reused = future.num_uses_until(block_hash, now) >= 2
        return reused if self.kind == "repeat" else not reused

    def release(self, blocks: list[KVCacheBlock], request=None) -> None:
        unhashed, dead, alive = [], [], []
        for block in blocks:
            if block.block_hash is None:
                unhashed.append(block)
            elif self._is_evicted_first(block):
                dead.append(block)
            else:
                alive.append(block)
        self.place(unhashed, dead, alive)
