"""``adaptive`` eviction: a segmented LRU whose protected share is chosen online by
simulating, on a sample of the traffic, what each candidate share would have hit.

The real free queue is :class:`~prefixcache.core.eviction.TwoQueueFreeBlockQueue`'s:
content referenced a second time (hit while free, or recomputed while its hash is in the
ghost list of recent evictions) goes to a *protected* segment evicted after every
*probation* block; unhashed blocks go first. What differs is the cap on the protected
segment: ``protected_fraction`` times the number of blocks, where the fraction is one of
:data:`CANDIDATE_PROTECTED_FRACTIONS`. A fraction of 0 protects nothing: the queue is then
``unhashed-first`` (LRU order, empty blocks first). Larger fractions resist one-off
content (fresh questions, tool outputs, one-off prompts) flushing what is looked up again,
and lose when what matters is recency (a conversation's newest turn).

Which fraction holds is decided by *shadow caches*, one per candidate: hash-only segmented
LRUs (no KV, no blocks) of ``sample_rate * num_blocks`` entries fed with the hashes, among
each finished request's block hashes, whose last byte is below ``256 * sample_rate`` (spatial
sampling: a hash is always in or always out, so the shadows see a consistent miniature of
the traffic). A shadow counts a hit for a sampled hash it holds when the request comes
back. Every shadow's hit count decays by half each time the shadows have seen
``decay_factor`` times their capacity in sampled hashes, so the choice follows the traffic
as it changes. The queue follows the candidate with the most decayed hits, but leaves the
current one only for a candidate ahead by more than ``switch_margin`` of its count (noise
in the sample must not make it flap). It starts at fraction 0, the design's order.

Cost: per finished request, one byte comparison per block hash and, for the sampled ones
(``sample_rate`` of them), one ordered-dict operation per shadow. Memory: the real queue's
ghost list (``2 * num_blocks`` hashes) plus, per shadow, at most
``2 * sample_rate * num_blocks`` hashes (entries and ghost; ``sample_rate * num_blocks``
is about ``shadow_entries``, and at least ``num_blocks / 256``). A prefix-cache reset empties
the shadows as well as the queue's marks and ghost; the learned scores are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.segmented import TwoQueueFreeBlockQueue
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request

#: The protected shares the queue chooses among: the design's LRU order, and two
#: segmented LRUs (the second is ``2q``'s).
CANDIDATE_PROTECTED_FRACTIONS = (0.0, 0.5, 0.9)


class ShadowSegmentedLRU:
    """A hash-only segmented LRU of ``capacity`` entries with ``2q``'s promotion rules:
    a hash seen again while held, or while in the ghost list of its last ``capacity``
    evictions, is protected; protected holds at most ``protected_fraction`` of the
    entries, its oldest demoted to the newest probation ones."""

    __slots__ = ("capacity", "max_protected", "probation", "protected", "ghost", "num_hits")

    def __init__(self, capacity: int, protected_fraction: float) -> None:
        self.capacity = max(1, capacity)
        self.max_protected = int(protected_fraction * self.capacity)
        self.probation: OrderedDict[BlockHash, None] = OrderedDict()
        self.protected: OrderedDict[BlockHash, None] = OrderedDict()
        self.ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_hits = 0.0

    def access(self, hashes: list[BlockHash]) -> None:
        """One request's sampled hashes, prefix first: count the held ones as hits, then
        make all of them the most recent, the deepest least recent (it is evicted first,
        as in the real queue's release order)."""
        probation, protected, ghost = self.probation, self.protected, self.ghost
        num_hits = 0
        # One pass: a request's hashes are distinct, so each one's membership when it is
        # reached is what it was before the request.
        for block_hash in reversed(hashes):
            if block_hash in protected:
                protected.move_to_end(block_hash)
                num_hits += 1
            elif block_hash in probation:
                del probation[block_hash]
                protected[block_hash] = None
                num_hits += 1
            elif block_hash in ghost:
                del ghost[block_hash]
                protected[block_hash] = None
            else:
                probation[block_hash] = None
        self.num_hits += num_hits
        while len(protected) > self.max_protected:
            block_hash, _ = protected.popitem(last=False)
            probation[block_hash] = None
        excess = len(probation) + len(protected) - self.capacity
        while excess > 0:
            segment = probation if probation else protected
            block_hash, _ = segment.popitem(last=False)
            ghost[block_hash] = None
            excess -= 1
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def forget(self) -> None:
        self.probation.clear()
        self.protected.clear()
        self.ghost.clear()


class AdaptiveFreeBlockQueue(TwoQueueFreeBlockQueue):
    """``2q``'s queue with its protected share chosen online (module docstring)."""

    policy_name = "adaptive"
    summary = "follows online whichever protected share would have hit most"
    shadow_entries = 512  # entries per shadow: sample_rate = shadow_entries / num_blocks
    decay_factor = 4
    switch_margin = 0.02

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        super().__init__(blocks)
        num_blocks = max(1, len(blocks))
        # The last byte of a hash is uniform: sample the hashes whose byte is below this.
        self.sample_threshold = max(1, min(256, round(256 * self.shadow_entries / num_blocks)))
        self.sample_rate = self.sample_threshold / 256
        shadow_capacity = max(1, round(self.sample_rate * num_blocks))
        self.shadows = [ShadowSegmentedLRU(shadow_capacity, fraction)
                        for fraction in CANDIDATE_PROTECTED_FRACTIONS]
        self.decay_every = self.decay_factor * shadow_capacity
        self.num_sampled_since_decay = 0
        self.num_blocks = num_blocks
        self.leader = 0
        self._set_protected_fraction(CANDIDATE_PROTECTED_FRACTIONS[0])

    @property
    def current_protected_fraction(self) -> float:
        return CANDIDATE_PROTECTED_FRACTIONS[self.leader]

    def _set_protected_fraction(self, fraction: float) -> None:
        self.max_protected = int(fraction * self.num_blocks)
        self._protect([])  # demotes whatever the new cap leaves over to probation

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        super().release(blocks, request)
        if request is not None:
            self._observe(request.block_hashes)

    def _observe(self, block_hashes: list[BlockHash]) -> None:
        threshold = self.sample_threshold
        sampled = [h for h in block_hashes if h[-1] < threshold] if threshold < 256 \
            else block_hashes
        if not sampled:
            return
        shadows = self.shadows
        for shadow in shadows:
            shadow.access(sampled)
        self.num_sampled_since_decay += len(sampled)
        if self.num_sampled_since_decay >= self.decay_every:
            self.num_sampled_since_decay = 0
            for shadow in shadows:
                shadow.num_hits *= 0.5
        scores = [shadow.num_hits for shadow in shadows]
        best = scores.index(max(scores))
        if best != self.leader and scores[best] > scores[self.leader] * (1 + self.switch_margin):
            self.leader = best
            self._set_protected_fraction(CANDIDATE_PROTECTED_FRACTIONS[best])

    def forget_cached_content(self) -> None:
        super().forget_cached_content()
        for shadow in self.shadows:
            shadow.forget()

    def policy_state(self) -> dict:
        """The protected share followed, and each candidate's share of the shadows' decayed
        hits (shares, not counts: the counts scale with the sample, which depends on the
        pool's size, while the choice depends only on how they compare)."""
        scores = self.candidate_scores()
        total = sum(scores.values())
        return {"protected_fraction": self.current_protected_fraction,
                "candidate_hit_shares": {str(fraction): round(hits / total, 4) if total else 0.0
                                         for fraction, hits in scores.items()}}

    def candidate_scores(self) -> dict[float, float]:
        """Each candidate protected fraction's decayed shadow hit count."""
        return {fraction: shadow.num_hits
                for fraction, shadow in zip(CANDIDATE_PROTECTED_FRACTIONS, self.shadows,
                                            strict=True)}
