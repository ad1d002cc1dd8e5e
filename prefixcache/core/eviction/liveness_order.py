"""The liveness order: ``document-liveness``'s order without its depth term, as
``adaptive`` follows it.

Content a request released is keyed ``logit(p) + H(release)`` from a
:class:`~prefixcache.core.eviction.document_liveness_model.DocumentLivenessModel`: ``p``
the chance that a document of the request's class gets another request, ``H`` the
model's clock when the content was released. Content released without a finished
request to tell its document gets the overall ``p``. Lowest key first: after a silence,
a document's log-odds of being alive are ``logit(p) + H(release) - H(now)``, and
``H(now)`` is common to every block. What ``document-liveness`` adds, the share of blocks
at each depth that a document's next request reaches, is left out: it needs every
prompt's tail hashes kept per document and compared at each request, and moves nothing
on the traces it was measured on.

A release is described by its *parts*, ``(finest class or UNKNOWN_CLASS, H at release,
release number)``; every block of a release shares them.

- :class:`LivenessOrderQueue` is the order over real free blocks, built when ``adaptive``
  starts following it, from the free blocks and the parts each was last released with.
- :class:`PythonShadowLivenessOrder` is its shadow cache: sampled hashes only, counting
  the hits the order would have had; :data:`ShadowLivenessOrder` is the one ``adaptive``
  uses, the same in C where the package was built with a compiler.

Both re-key everything they hold when the model refits (``num_fits`` changes).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.document_liveness_model import DocumentLivenessModel
from prefixcache.core.eviction.scored import GroupedScoredFreeBlockQueue
from prefixcache.core.hashing import BlockHash

# The class of content released without a finished request to tell its document.
UNKNOWN_CLASS = -1

ReleaseParts = tuple[int, float, int]


def liveness_key(model: DocumentLivenessModel, parts: ReleaseParts) -> float:
    """``logit(p) + H(release)`` from the model's current estimates."""
    finest_class, clock, _ = parts
    if finest_class == UNKNOWN_CLASS:
        return model.overall_log_odds + clock
    return model.class_log_odds(finest_class) + clock


class LivenessOrderQueue(GroupedScoredFreeBlockQueue):
    """Free blocks in the liveness order (module docstring): blocks holding nothing first,
    in the order they came; then the lowest key, among equal keys the release made first,
    within a release the order its blocks were given. The blocks of one release form one
    group, and groups of one class one list, so a re-key costs one key per class."""

    def __init__(self, model: DocumentLivenessModel) -> None:
        self.model = model
        self._num_fits_keyed = model.num_fits
        super().__init__(())

    @classmethod
    def from_free_blocks(cls, model: DocumentLivenessModel, blocks: list[KVCacheBlock],
                         parts_of: list[ReleaseParts | None]) -> LivenessOrderQueue:
        """The queue of ``blocks`` (every free block, in some order that is kept among the
        empty ones and within each release): ``parts_of[block_id]`` are the parts each
        holding content was last released with (None: released without them, keyed as
        content of an unknown document released now)."""
        queue = cls(model)
        unknown = (UNKNOWN_CLASS, model.clock, -1)
        releases: dict[int, tuple[ReleaseParts, list[KVCacheBlock]]] = {}
        for block in blocks:
            if block.block_hash is None:
                queue._add_empty(block)
                continue
            parts = parts_of[block.block_id] or unknown
            release = releases.get(id(parts))
            if release is None:
                releases[id(parts)] = (parts, [block])
            else:
                release[1].append(block)
        # Releases in the order they were made (unknown ones last: keyed as of now).
        for parts, released in sorted(releases.values(),
                                      key=lambda release: (release[0][2] < 0, release[0][2])):
            queue._add_n_to_group(queue._new_group(parts), released)
        return queue

    def key_of_parts(self, parts: ReleaseParts) -> float:
        return liveness_key(self.model, parts)

    def list_of_parts(self, parts: ReleaseParts) -> int:
        """The class: under one set of estimates a key is a per-class value plus the
        clock at release, which only advances."""
        return parts[0]

    def parts_for(self, block: KVCacheBlock) -> ReleaseParts | None:
        """A block handed in without context: an unknown document's, released now (empty
        blocks: None)."""
        if block.block_hash is None:
            return None
        return UNKNOWN_CLASS, self.model.clock, -1

    def add_released(self, blocks: list[KVCacheBlock], parts: ReleaseParts) -> None:
        """A release: the empty blocks join their FIFO, the others one group keyed by
        ``parts``, in order. Re-keys first if the model refitted since the last time."""
        if self.model.num_fits != self._num_fits_keyed:
            self._num_fits_keyed = self.model.num_fits
            self._recompute_keys()
        held = []
        for block in blocks:
            if block.block_hash is None:
                self._add_empty(block)
            else:
                held.append(block)
        if held:
            self._add_n_to_group(self._new_group(parts), held)


class PythonShadowLivenessOrder:
    """A hash-only cache of ``capacity`` entries in the liveness order: the hashes a
    request is given are keyed by :attr:`parts`, the first :attr:`num_shared` of them by
    :attr:`shared_parts` (all three set by the caller before each :meth:`access`; the two
    parts of one release differ only in their class), the lowest key evicted first, among
    equal keys the entry made first (a request's deepest hash first). ``num_hits``
    counts, as in the other shadows, the hashes found held; the caller may scale it
    (decay). Re-keys every entry when the model refits. No ghost list: a hash evicted is
    forgotten.

    This is the reference; :class:`NativeShadowLivenessOrder` keeps the same entries in
    the same order in C."""

    __slots__ = ("capacity", "model", "parts", "shared_parts", "num_shared", "num_hits",
                 "_entries", "_heap", "_order", "_num_fits_keyed")

    def __init__(self, capacity: int, model: DocumentLivenessModel) -> None:
        self.capacity = max(1, capacity)
        self.model = model
        self.parts: ReleaseParts = (UNKNOWN_CLASS, 0.0, -1)
        self.shared_parts: ReleaseParts = self.parts
        self.num_shared = 0
        self.num_hits = 0.0
        self._entries: dict[BlockHash, tuple[ReleaseParts, int]] = {}
        # (key, order, hash); an entry whose order is not its hash's current one is stale.
        self._heap: list[tuple[float, int, BlockHash]] = []
        self._order = 0
        self._num_fits_keyed = model.num_fits

    def __len__(self) -> int:
        return len(self._entries)

    def access(self, hashes: Sequence[BlockHash],
               low_reuse_hashes: Collection[BlockHash] | None = None) -> int:
        """One request's sampled hashes, prefix first: count the held ones as hits, then
        hold all of them keyed by :attr:`parts`. ``low_reuse_hashes`` is ignored (the
        order has no low-reuse segment). Returns the number of hits."""
        entries = self._entries
        num_hits = sum(1 for block_hash in hashes if block_hash in entries)
        if self.model.num_fits != self._num_fits_keyed:
            self._rekey()
        own_parts, shared_parts, num_shared = self.parts, self.shared_parts, self.num_shared
        own_key = liveness_key(self.model, own_parts)
        shared_key = liveness_key(self.model, shared_parts) if num_shared else own_key
        heap, order = self._heap, self._order
        for position in range(len(hashes) - 1, -1, -1):  # the deepest first: evicted first
            block_hash = hashes[position]
            parts, key = ((shared_parts, shared_key) if position < num_shared
                          else (own_parts, own_key))
            order += 1
            entries[block_hash] = (parts, order)
            heapq.heappush(heap, (key, order, block_hash))
        self._order = order
        while len(entries) > self.capacity:
            _, order, block_hash = heapq.heappop(heap)
            entry = entries.get(block_hash)
            if entry is not None and entry[1] == order:
                del entries[block_hash]
        if len(heap) > 4 * self.capacity + 64:  # stale entries of hashes given again
            self._rekey()
        self.num_hits += num_hits
        return num_hits

    def _rekey(self) -> None:
        model = self.model
        self._num_fits_keyed = model.num_fits
        key_of = {}  # per release: its entries share parts
        heap = []
        for block_hash, (parts, order) in self._entries.items():
            key = key_of.get(id(parts))
            if key is None:
                key = key_of[id(parts)] = liveness_key(model, parts)
            heap.append((key, order, block_hash))
        heapq.heapify(heap)
        self._heap = heap

    def keys_in_order(self) -> list[BlockHash]:
        """The hashes held, next to evict first. For tests."""
        model = self.model
        return [block_hash for _, _, block_hash in sorted(
            (liveness_key(model, parts), order, block_hash)
            for block_hash, (parts, order) in self._entries.items())]

    def forget(self) -> None:
        """Drop every hash held."""
        self._entries.clear()
        self._heap = []


class NativeShadowLivenessOrder:
    """:class:`PythonShadowLivenessOrder`'s contract, its entries kept in C
    (``_key_order_shadow_native.c``): the same hits, the same evictions."""

    __slots__ = ("model", "parts", "shared_parts", "num_shared", "_shadow", "_num_fits_keyed")

    def __init__(self, capacity: int, model: DocumentLivenessModel) -> None:
        self.model = model
        self.parts: ReleaseParts = (UNKNOWN_CLASS, 0.0, -1)
        self.shared_parts: ReleaseParts = self.parts
        self.num_shared = 0
        self._shadow = KeyOrderShadow(capacity)
        self._num_fits_keyed = model.num_fits

    @property
    def capacity(self) -> int:
        return self._shadow.capacity

    @property
    def num_hits(self) -> float:
        return self._shadow.num_hits

    @num_hits.setter
    def num_hits(self, value: float) -> None:
        self._shadow.num_hits = value

    def __len__(self) -> int:
        return len(self._shadow)

    def access(self, hashes: Sequence[BlockHash],
               low_reuse_hashes: Collection[BlockHash] | None = None) -> int:
        model = self.model
        if model.num_fits != self._num_fits_keyed:
            self._num_fits_keyed = model.num_fits
            self._shadow.rekey(model.all_class_log_odds, model.overall_log_odds)
        parts, num_shared = self.parts, self.num_shared
        if not num_shared:
            return self._shadow.access(hashes, parts[0], parts[1], liveness_key(model, parts))
        shared_parts = self.shared_parts
        return self._shadow.access(hashes, parts[0], parts[1], liveness_key(model, parts),
                                   num_shared, shared_parts[0],
                                   liveness_key(model, shared_parts))

    def keys_in_order(self) -> list[BlockHash]:
        return self._shadow.keys_in_order()

    def forget(self) -> None:
        self._shadow.forget()


try:
    from prefixcache.core.eviction._key_order_shadow_native import KeyOrderShadow
except ImportError:  # built without a C compiler: the Python shadow decides the same
    KeyOrderShadow = None

#: Whether ``adaptive``'s liveness shadow runs in C.
NATIVE_LIVENESS_SHADOW = KeyOrderShadow is not None
ShadowLivenessOrder = (NativeShadowLivenessOrder if NATIVE_LIVENESS_SHADOW
                       else PythonShadowLivenessOrder)
