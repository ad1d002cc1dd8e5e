"""The shadow caches ``adaptive`` runs per candidate: each specialised loop of
``ShadowSegmentedLRU.access`` against a plain segmented LRU written the obvious way."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from prefixcache.core.eviction.shadow import ShadowSegmentedLRU


class PlainSegmentedLRU:
    """The shadow's contract in one loop, no shortcuts: every hash tested against every
    segment, promotions through the protected segment and its overflow."""

    def __init__(self, capacity: int, protected_fraction: float, low_reuse_first: bool,
                 ghost_factor: int):
        self.capacity = capacity
        self.max_ghost = ghost_factor * capacity
        self.max_protected = int(protected_fraction * capacity)
        self.low_reuse_first = low_reuse_first
        self.low_reuse, self.probation = OrderedDict(), OrderedDict()
        self.protected, self.ghost = OrderedDict(), OrderedDict()
        self.num_hits = 0

    def access(self, hashes, marks=frozenset()):
        if not self.low_reuse_first:
            marks = frozenset()
        for block_hash in reversed(hashes):
            if block_hash in self.protected:
                self.protected.move_to_end(block_hash)
                self.num_hits += 1
            elif block_hash in self.probation or block_hash in self.low_reuse:
                self.probation.pop(block_hash, None)
                self.low_reuse.pop(block_hash, None)
                self.protected[block_hash] = None
                self.num_hits += 1
            elif block_hash in self.ghost:
                del self.ghost[block_hash]
                self.protected[block_hash] = None
            elif block_hash in marks:
                self.low_reuse[block_hash] = None
            else:
                self.probation[block_hash] = None
        while len(self.protected) > self.max_protected:
            self.probation[self.protected.popitem(last=False)[0]] = None
        while len(self.low_reuse) + len(self.probation) + len(self.protected) > self.capacity:
            segment = (self.low_reuse if self.low_reuse
                       else self.probation if self.probation else self.protected)
            self.ghost[segment.popitem(last=False)[0]] = None
        while len(self.ghost) > self.max_ghost:
            self.ghost.popitem(last=False)


@pytest.mark.parametrize("protected_fraction", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("low_reuse_first", [False, True])
@pytest.mark.parametrize("ghost_factor", [1, 2])
def test_matches_a_plain_segmented_lru_on_random_traffic(protected_fraction, low_reuse_first,
                                                         ghost_factor):
    rng = random.Random(f"{protected_fraction}-{low_reuse_first}-{ghost_factor}")
    shadow = ShadowSegmentedLRU(24, protected_fraction, low_reuse_first, ghost_factor)
    plain = PlainSegmentedLRU(24, protected_fraction, low_reuse_first, ghost_factor)
    num_hits = 0
    for step in range(3000):
        # Requests of 1-8 distinct hashes drawn from a pool three times the capacity, a
        # popular few more often; sometimes a few new hashes marked low-reuse.
        pool = range(8) if rng.random() < 0.3 else range(72)
        hashes = [bytes([h]) for h in rng.sample(pool, rng.randint(1, min(8, len(pool))))]
        marks = {h for h in hashes if rng.random() < 0.5} if rng.random() < 0.3 else set()
        num_hits += shadow.access(hashes, marks) if marks else shadow.access(hashes)
        plain.access(hashes, marks)
        for name in ("low_reuse", "probation", "protected", "ghost"):
            assert list(getattr(shadow, name)) == list(getattr(plain, name)), (step, name)
    assert shadow.num_hits == plain.num_hits == num_hits
    assert num_hits > 0


def test_unprotected_shadow_puts_what_it_had_seen_after_the_new_hashes():
    shadow = ShadowSegmentedLRU(4, 0.0)
    shadow.access([b"a", b"b"])
    assert shadow.access([b"a", b"c"]) == 1  # "a" held: a hit, and newer than "c"
    assert list(shadow.probation) == [b"b", b"c", b"a"]
    assert not shadow.protected

