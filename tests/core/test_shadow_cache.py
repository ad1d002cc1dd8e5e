"""The shadow caches ``adaptive`` runs per candidate: each specialised loop of
``ShadowSegmentedLRU.access``, in Python and in C, against a plain segmented LRU written
the obvious way; and the C build's own contract (bytes keys, references, the sample)."""

from __future__ import annotations

import gc
import random
import sys
from collections import OrderedDict

import pytest

from prefixcache.core.eviction import shadow as shadow_module
from prefixcache.core.eviction.adaptive import AdaptiveFreeBlockQueue
from prefixcache.core.eviction.shadow import (
    NATIVE_SHADOWS,
    NativeShadowSegmentedLRU,
    PythonShadowSegmentedLRU,
    native_sampled_hashes,
    python_sampled_hashes,
)

needs_native = pytest.mark.skipif(
    not NATIVE_SHADOWS, reason="the package was built without a C compiler "
    "(test_native_extensions.py says whether that is expected)")
#: Both implementations of the shadow: every behaviour test runs on each.
IMPLEMENTATIONS = [pytest.param(PythonShadowSegmentedLRU, id="python"),
                   pytest.param(NativeShadowSegmentedLRU, id="c", marks=needs_native)]


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


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("protected_fraction", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("low_reuse_first", [False, True])
@pytest.mark.parametrize("ghost_factor", [0, 1, 2])
def test_matches_a_plain_segmented_lru_on_random_traffic(implementation, protected_fraction,
                                                         low_reuse_first, ghost_factor):
    rng = random.Random(f"{protected_fraction}-{low_reuse_first}-{ghost_factor}")
    shadow = implementation(24, protected_fraction, low_reuse_first, ghost_factor)
    plain = PlainSegmentedLRU(24, protected_fraction, low_reuse_first, ghost_factor)
    num_hits = 0
    for step in range(3000):
        # Requests of 0-8 distinct hashes drawn from a pool three times the capacity, a
        # popular few more often; sometimes a few new hashes marked low-reuse. Hashes of
        # 1 and 2 bytes: some share a first byte, so keys of the C table collide.
        pool = range(8) if rng.random() < 0.3 else range(72)
        hashes = [bytes([h]) if h % 3 else bytes([h, 0])
                  for h in rng.sample(pool, rng.randint(0, min(8, len(pool))))]
        marks = {h for h in hashes if rng.random() < 0.5} if rng.random() < 0.3 else set()
        num_hits += shadow.access(hashes, marks) if marks else shadow.access(hashes)
        plain.access(hashes, marks)
        for name in ("low_reuse", "probation", "protected", "ghost"):
            assert list(getattr(shadow, name)) == list(getattr(plain, name)), (step, name)
        if step % 700 == 699:  # the caller's decay
            shadow.num_hits *= 0.5
            plain.num_hits *= 0.5
    assert shadow.num_hits == plain.num_hits
    assert len(shadow) == len(plain.low_reuse) + len(plain.probation) + len(plain.protected)
    assert num_hits > 0


@needs_native
@pytest.mark.parametrize("protected_fraction", [0.0, 0.9])
def test_c_and_python_agree_on_thousands_of_keys(protected_fraction):
    """Shadow-sized caches (hundreds of entries, thousands of ghosts) of 32-byte hashes:
    the C table grows, wraps and deletes by backward shift far past the small tests."""
    rng = random.Random(protected_fraction)
    python = PythonShadowSegmentedLRU(320, protected_fraction, True, 4)
    native = NativeShadowSegmentedLRU(320, protected_fraction, True, 4)
    universe = [rng.randbytes(32) for _ in range(4000)]
    for step in range(4000):
        hashes = list(dict.fromkeys(rng.choice(universe[:300] if rng.random() < 0.5
                                               else universe) for _ in range(10)))
        marks = set(hashes[::3])
        assert python.access(hashes, marks) == native.access(hashes, marks), step
        if step % 500 == 0 or step == 3999:
            for name in ("low_reuse", "probation", "protected", "ghost"):
                assert list(getattr(python, name)) == getattr(native, name), (step, name)
        if step == 2000:
            python.forget()
            native.forget()
    assert len(native.ghost) == 4 * 320
    assert python.num_hits == native.num_hits > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unprotected_shadow_puts_what_it_had_seen_after_the_new_hashes(implementation):
    shadow = implementation(4, 0.0)
    shadow.access([b"a", b"b"])
    assert shadow.access([b"a", b"c"]) == 1  # "a" held: a hit, and newer than "c"
    assert list(shadow.probation) == [b"b", b"c", b"a"]
    assert not shadow.protected


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unprotected_shadow_is_lru_over_hashes(implementation):
    shadow = implementation(3, 0.0)
    for block_hash in (b"a", b"b", b"c", b"d"):  # "a" is the oldest: evicted for "d"
        shadow.access([block_hash])
    shadow.access([b"a"])
    assert shadow.num_hits == 0
    shadow.access([b"c", b"d"])
    assert shadow.num_hits == 2
    assert not shadow.protected


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_protected_shadow_keeps_reused_hashes_through_a_scan(implementation):
    lru, segmented = implementation(4, 0.0), implementation(4, 0.5)
    for shadow in (lru, segmented):
        shadow.access([b"p"])
        shadow.access([b"p"])  # referenced again: protected in the segmented shadow
        shadow.access([b"x1", b"x2", b"x3", b"x4"])  # a one-off scan as big as the cache
        shadow.access([b"p"])
    assert (lru.num_hits, segmented.num_hits) == (1, 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_low_reuse_shadow_evicts_marked_new_hashes_first(implementation):
    plain, low_first = implementation(3, 0.0), implementation(3, 0.0, True)
    for shadow in (plain, low_first):
        shadow.access([b"doc"])
        shadow.access([b"x1", b"x2", b"x3"], {b"x1", b"x2", b"x3"})  # one-off, low reuse
        shadow.access([b"doc"])
    assert (plain.num_hits, low_first.num_hits) == (0, 1)
    assert not plain.low_reuse  # a shadow without the candidate ignores the marks


@needs_native
def test_c_shadow_refuses_keys_that_are_not_bytes_and_keeps_its_state():
    class Key(bytes):  # its own __hash__ or __eq__ could change the shadow mid-access
        pass

    shadow = NativeShadowSegmentedLRU(4, 0.5)
    shadow.access([b"a"])
    with pytest.raises(TypeError, match="bytes"):
        shadow.access([b"b", "c"])  # the deepest first: "c" is refused before b"b"
    with pytest.raises(TypeError, match="bytes"):
        shadow.access([Key(b"d")])
    assert shadow.probation == [b"a"] and shadow.num_hits == 0
    with pytest.raises(TypeError):
        shadow.access(7)
    with pytest.raises(ValueError):
        NativeShadowSegmentedLRU(4, 1.5)
    with pytest.raises(ValueError):
        NativeShadowSegmentedLRU(4, 0.5, False, -1)


@needs_native
def test_c_shadow_refuses_to_be_changed_from_inside_an_access():
    """A low-reuse container's __contains__ runs in the middle of an access: a call that
    changes the shadow from there is refused, and the access itself completes."""
    shadow = NativeShadowSegmentedLRU(4, 0.0, True)
    hashes = [b"a", b"b"]
    refused = []

    class Marks:
        def __contains__(self, block_hash):
            for change in (shadow.forget, lambda: shadow.access([b"z"]),
                           lambda: shadow.__init__(8, 0.5)):
                with pytest.raises(RuntimeError, match="middle of an access"):
                    change()
                refused.append(block_hash)
            hashes.clear()  # the caller's list: the shadow works on its own copy
            return True

    assert shadow.access(hashes, Marks()) == 0
    assert refused == [b"b"] * 3 + [b"a"] * 3
    assert shadow.low_reuse == [b"b", b"a"] and shadow.capacity == 4


@needs_native
def test_c_shadow_lets_go_of_its_keys():
    key = bytes(range(32))
    before = sys.getrefcount(key)
    shadow = NativeShadowSegmentedLRU(2, 0.0, False, 1)
    shadow.access([key])
    assert sys.getrefcount(key) == before + 1
    shadow.access([b"x", b"y"])  # evicted to the ghost: still held
    assert shadow.ghost == [key]
    shadow.access([b"z", b"w"])  # out of the ghost too
    assert sys.getrefcount(key) == before
    shadow.access([key])
    shadow.forget()
    assert sys.getrefcount(key) == before and not len(shadow) and not shadow.ghost
    shadow.access([key])
    del shadow
    gc.collect()
    assert sys.getrefcount(key) == before


@needs_native
def test_c_sample_is_the_python_one():
    rng = random.Random(3)
    hashes = [rng.randbytes(rng.choice((1, 8, 32))) for _ in range(2000)]
    for threshold in (0, 1, 20, 128, 255, 256):
        assert (native_sampled_hashes(hashes, threshold)
                == python_sampled_hashes(hashes, threshold))
    with pytest.raises(TypeError):
        native_sampled_hashes([b""], 20)
    with pytest.raises(TypeError):
        native_sampled_hashes(["ab"], 20)


def test_adaptive_uses_the_c_shadows_when_they_are_built():
    expected = NativeShadowSegmentedLRU if NATIVE_SHADOWS else PythonShadowSegmentedLRU
    assert shadow_module.ShadowSegmentedLRU is expected
    assert AdaptiveFreeBlockQueue.shadow_type is expected


