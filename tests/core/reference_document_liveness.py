"""``document-liveness`` at its plainest, for the tests to hold the real one to.

The queue: every group with free blocks in one heap on (key, order); at every re-key each
of them gets its key again from the estimates of that moment, O(groups). The real queue
keeps groups in lists, one per (class, depth class), and keys only the lists' heads; it
must take blocks in exactly this order.

The model's fit: plain loops over the states and the releases in every EM iteration, and
the wait's shape from every kept state's wait. The real fit computes what stays the same
between iterations once (in C where it is built), keeps the ended waits in order as they
end, and finds what a next request shares by a binary search; it must give exactly the
same estimates.
"""

from __future__ import annotations

import heapq
import math
import statistics

from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.core.eviction.document_liveness_model import (
    EXPONENTIAL_MEDIAN_OVER_MEAN,
    MIN_ENDED_WAITS,
    DocumentLivenessModel,
)
from prefixcache.core.hashing import BlockHash


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
    """The model with its fit written as plain loops, its wait's shape taken from every
    kept state at every fit, and what a next request shares looked up block by block."""

    def _fit(self) -> None:
        """The fit as plain loops over the states and releases, every iteration."""
        now = self.now
        width = self.hazard_bin
        starts = self._state_start  # in time order: the first is the earliest
        continued_at = self._state_continued_at
        classes = list(zip(*self._state_class_ids, strict=True))  # per state, per level
        first_bin, origin, rates = self._fit_window()
        num_bins = len(rates)
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

    def _ended_wait_shape(self) -> float:
        """From the waits of every kept state, collected and ordered at every fit."""
        waits = [at - start for start, at in zip(self._state_start, self._state_continued_at,
                                                 strict=True) if at >= 0]
        if len(waits) < MIN_ENDED_WAITS:
            return 1.0
        median = max(statistics.median(waits), 1)
        mean = sum(waits) / len(waits)
        return max(1.0, EXPONENTIAL_MEDIAN_OVER_MEAN * mean / median)

    def observe_next_request(self, previous_num_blocks: int,
                             previous_tail_hashes: list[BlockHash],
                             new_hashes: list[BlockHash], block_size: int) -> None:
        """Every tail block looked up in a set of the new prompt's hashes."""
        shared = set(new_hashes)
        num_tail = len(previous_tail_hashes)
        deep_is_shared = bool(previous_tail_hashes) and previous_tail_hashes[0] in shared
        seen, shared_counts = self._depth_seen, self._depth_shared
        for depth, first, end in self.depth_class_runs(previous_num_blocks, block_size):
            seen[depth] += end - first
            for distance in range(first, min(end, num_tail)):
                if previous_tail_hashes[num_tail - 1 - distance] in shared:
                    shared_counts[depth] += 1
            if deep_is_shared and end > num_tail:
                shared_counts[depth] += end - max(first, num_tail)
