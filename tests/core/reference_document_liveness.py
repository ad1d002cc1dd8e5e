"""``document-liveness``'s queue at its plainest, for the tests to hold the real one to.

Every group with free blocks in one heap on (key, order); at every re-key each of them
gets its key again from the estimates of that moment, O(groups). The real queue keeps
groups in lists, one per (class, depth class), and keys only the lists' heads; it must
take blocks in exactly this order.
"""

from __future__ import annotations

import heapq

from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue


class OneHeapDocumentLivenessQueue(DocumentLivenessFreeBlockQueue):
    """No lists: the heap of new groups holds every group, re-keyed at every re-key."""

    def _recompute_keys(self) -> None:
        heap = []
        for group in self._live_groups.values():
            group.key = self.key_of_parts(group.parts)
            group.heap_version += 1  # the entries pushed before are stale
            heap.append((group.key, group.order, group.heap_version, group))
        heapq.heapify(heap)
        self._new_heap = heap
        self._new_groups = []
