"""``document-liveness`` at its plainest, for the tests to hold the real one to.

The queue: every group with free blocks in one heap on (key, order); at every re-key each
of them gets its key again from the estimates of that moment, O(groups). The real queue
keeps groups in lists, one per (class, depth class), and keys only the lists' heads; it
must take blocks in exactly this order.

The model's fit: plain loops over the states and the releases in every EM iteration. The
real fit computes what stays the same between iterations once (in C where it is built);
it must give exactly the same estimates.
"""

from __future__ import annotations

import heapq
import math

from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.core.eviction.document_liveness_model import DocumentLivenessModel


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


def _cumulative(offset: int, rates: list[float], at_bin_start: list[float],
                width: int) -> float:
    """H at ``offset``: ``rates[j]`` over bin ``j`` of ``width`` releases, the last bin's
    rate beyond it."""
    j = min(offset // width, len(rates) - 1)
    return at_bin_start[j] + rates[j] * (offset - j * width)


class PlainLoopModel(DocumentLivenessModel):
    """The model with its fit written as plain loops."""

    def _fit(self) -> None:
        """The fit as plain loops over the states and releases, every iteration."""
        now = self.now
        width = self.hazard_bin
        starts = self._state_start  # in time order: the first is the earliest
        continued_at = self._state_continued_at
        classes = self._state_classes
        first_bin, origin, num_bins, rates = self._fit_window()
        leaf_p = self._leaf_p
        start_offsets = [start - origin for start in starts]
        end_offsets = [(at if at >= 0 else now) - origin for at in continued_at]
        events = [0] * num_bins  # continuations per bin: the same in every iteration
        for at in continued_at:
            if at >= 0:
                events[(at - origin) // width] += 1
        num_classes = [len(ids) for ids in self._class_ids]
        prior_weight = self.prior_weight
        overall = self.overall_p
        for _ in range(self.em_iterations):
            # E: the chance each waiting state's document is still alive.
            at_bin_start = [0.0]
            for rate in rates:
                at_bin_start.append(at_bin_start[-1] + rate * width)
            weights = []
            for start, end, at, state_classes in zip(start_offsets, end_offsets,
                                                      continued_at, classes, strict=True):
                if at >= 0:
                    weights.append(1.0)
                    continue
                p = leaf_p[state_classes[2]]
                alive = p * math.exp(_cumulative(start, rates, at_bin_start, width)
                                     - _cumulative(end, rates, at_bin_start, width))
                weights.append(alive / max(alive + 1.0 - p, 1e-12))
            # M: p per class, each shrunk towards its parent's.
            total = 0.0  # not sum(): it compensates rounding since Python 3.12
            for weight in weights:
                total += weight
            overall = (total + 1.0) / (len(weights) + 2.0)
            estimates: list[list[float]] = []
            for level in range(3):
                successes = [0.0] * num_classes[level]
                trials = [0] * num_classes[level]
                for weight, state_classes in zip(weights, classes, strict=True):
                    successes[state_classes[level]] += weight
                    trials[state_classes[level]] += 1
                parents = self._class_parents[level]
                estimates.append([
                    (successes[c] + prior_weight * (overall if level == 0
                                                    else estimates[-1][parents[c]]))
                    / (trials[c] + prior_weight)
                    for c in range(num_classes[level])])
            leaf_p = estimates[2]
            # M: the rate per bin, continuations over the expected alive exposure.
            change = [0.0] * (now - origin + 2)
            for start, end, weight in zip(start_offsets, end_offsets, weights, strict=True):
                change[start] += weight
                change[end] -= weight
            exposure = [0.0] * num_bins
            alive_count = 0.0
            for offset in range(now - origin + 1):
                alive_count += change[offset]
                exposure[offset // width] += alive_count
            rates = [(events[j] + 0.5) / (exposure[j] + 1.0) if exposure[j] > 0 else rates[j]
                     for j in range(num_bins)]
        self._adopt_fit(leaf_p, overall, first_bin, rates)
