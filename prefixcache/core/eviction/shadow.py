"""Shadow caches: hash-only miniatures of a free-queue order, fed a sample of the traffic,
that count the hits the order would have had. ``adaptive`` runs one per candidate order
and follows the one that would have hit most.

:class:`PythonShadowSegmentedLRU` is the reference. The package also builds the same
contract in C (``_shadow_native.c``), because ``adaptive`` feeds five shadows on every
finished request and in Python they cost more than the rest of the policy; the tests hold
the two to the same keys in the same orders. :data:`ShadowSegmentedLRU` and
:func:`sampled_hashes` are what ``adaptive`` uses: the C ones when the package was built
with a C compiler (:data:`NATIVE_SHADOWS`), else the Python ones. Either way every
decision is the same; only the cost differs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from prefixcache.core.hashing import BlockHash


class PythonShadowSegmentedLRU:
    """A hash-only segmented LRU of ``capacity`` entries with ``2q``'s promotion rules:
    a hash seen again while held, or while in the ghost list of its last
    ``ghost_factor * capacity`` evictions, is protected; protected holds at most
    ``protected_fraction`` of the entries, its oldest demoted to the newest probation
    ones. With ``low_reuse_first``, new hashes the caller marks low-reuse wait in a
    segment evicted before probation.

    :meth:`access` is the whole interface; ``num_hits`` is the count the caller compares
    (and may decay). With nothing protected (a fraction below ``1 / capacity``) it is an
    LRU over hashes in which a request's hashes seen before (held, or in the ghost) become
    more recent than its new ones."""

    __slots__ = ("capacity", "max_ghost", "max_protected", "low_reuse_first", "low_reuse",
                 "probation", "protected", "ghost", "num_hits")

    def __init__(self, capacity: int, protected_fraction: float,
                 low_reuse_first: bool = False, ghost_factor: int = 1) -> None:
        self.capacity = max(1, capacity)
        self.max_ghost = ghost_factor * self.capacity
        self.max_protected = int(protected_fraction * self.capacity)
        self.low_reuse_first = low_reuse_first
        self.low_reuse: OrderedDict[BlockHash, None] = OrderedDict()
        self.probation: OrderedDict[BlockHash, None] = OrderedDict()
        self.protected: OrderedDict[BlockHash, None] = OrderedDict()
        self.ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_hits = 0.0

    def access(self, hashes: list[BlockHash],
               low_reuse_hashes: Collection[BlockHash] = ()) -> int:
        """One request's sampled hashes (distinct), prefix first: count the held ones as
        hits, then make all of them the most recent, the deepest least recent (it is
        evicted first, as in the real queue's release order). New hashes in
        ``low_reuse_hashes`` go to the low-reuse segment when this shadow evicts such
        content first. Returns the number of hits."""
        probation, protected, ghost, low_reuse = (self.probation, self.protected,
                                                  self.ghost, self.low_reuse)
        num_hits = 0
        # One pass: a request's hashes are distinct, so each one's membership when it is
        # reached is what it was before the request.
        marks = low_reuse_hashes if self.low_reuse_first else ()
        if self.max_protected:
            for block_hash in reversed(hashes):
                if block_hash in protected:
                    protected.move_to_end(block_hash)
                    num_hits += 1
                elif block_hash in probation:
                    del probation[block_hash]
                    protected[block_hash] = None
                    num_hits += 1
                elif block_hash in low_reuse:
                    del low_reuse[block_hash]
                    protected[block_hash] = None
                    num_hits += 1
                elif block_hash in ghost:
                    del ghost[block_hash]
                    protected[block_hash] = None
                elif block_hash in marks:
                    low_reuse[block_hash] = None
                else:
                    probation[block_hash] = None
        else:
            # Nothing stays protected: what would be promoted joins probation's tail, in
            # order, after the request's new hashes (protected's overflow would put it
            # there), without passing through protected.
            promoted = []
            for block_hash in reversed(hashes):
                if block_hash in probation:
                    del probation[block_hash]
                    promoted.append(block_hash)
                    num_hits += 1
                elif block_hash in low_reuse:
                    del low_reuse[block_hash]
                    promoted.append(block_hash)
                    num_hits += 1
                elif block_hash in ghost:
                    del ghost[block_hash]
                    promoted.append(block_hash)
                elif block_hash in marks:
                    low_reuse[block_hash] = None
                else:
                    probation[block_hash] = None
            for block_hash in promoted:
                probation[block_hash] = None
        if num_hits:
            self.num_hits += num_hits
        if self.max_protected:
            for _ in range(len(protected) - self.max_protected):
                probation[protected.popitem(last=False)[0]] = None
        num_evicted = len(low_reuse) + len(probation) + len(protected) - self.capacity
        if num_evicted > 0:
            for _ in range(num_evicted):
                segment = low_reuse if low_reuse else probation if probation else protected
                ghost[segment.popitem(last=False)[0]] = None
            for _ in range(len(ghost) - self.max_ghost):
                ghost.popitem(last=False)
        return num_hits

    def __len__(self) -> int:
        return len(self.low_reuse) + len(self.probation) + len(self.protected)

    def forget(self) -> None:
        self.low_reuse.clear()
        self.probation.clear()
        self.protected.clear()
        self.ghost.clear()


def python_sampled_hashes(block_hashes: Sequence[BlockHash], threshold: int) -> list[BlockHash]:
    """The hashes whose last byte is below ``threshold``, in order: a spatial sample (a
    hash is always in or always out)."""
    return [block_hash for block_hash in block_hashes if block_hash[-1] < threshold]


try:
    from prefixcache.core.eviction._shadow_native import (
        ShadowSegmentedLRU as NativeShadowSegmentedLRU,
    )
    from prefixcache.core.eviction._shadow_native import (
        sampled_hashes as native_sampled_hashes,
    )
except ImportError:  # built without a C compiler: the Python ones decide the same
    NativeShadowSegmentedLRU = native_sampled_hashes = None

#: Whether ``adaptive`` runs the C shadows.
NATIVE_SHADOWS = NativeShadowSegmentedLRU is not None
ShadowSegmentedLRU = NativeShadowSegmentedLRU if NATIVE_SHADOWS else PythonShadowSegmentedLRU
sampled_hashes = native_sampled_hashes if NATIVE_SHADOWS else python_sampled_hashes
