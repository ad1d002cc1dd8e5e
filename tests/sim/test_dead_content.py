"""The dead-content diagnostics: offline, bounded by Belady, never the "best online policy",
and each knows only its kind of dead content."""

from __future__ import annotations

import pytest

from prefixcache.core import EVICTION_POLICIES, KVCacheBlock
from prefixcache.sim.belady import FutureUses
from prefixcache.sim.dead_content import DEAD_CONTENT_KINDS, DeadContentFirstFreeBlockQueue
from prefixcache.sim.replay import ReplayConfig, policy_names, replay
from prefixcache.sim.sweep import sweep
from tests.sim.helpers import prepared_prefix

DIAGNOSTICS = list(DEAD_CONTENT_KINDS)


@pytest.fixture(scope="module")
def prefix_512():
    return prepared_prefix(600, 512)


def test_diagnostics_are_replay_policies_but_not_online_ones():
    assert set(DIAGNOSTICS) <= set(policy_names())
    assert not set(DIAGNOSTICS) & set(EVICTION_POLICIES)


def test_bounded_by_belady_above_lru_and_never_reported_best(prefix_512):
    result = sweep(prefix_512, [2000, 4000], ["lru", *DIAGNOSTICS])
    assert result.ordering_violations == []
    rates = result.policy_to_hit_rates
    for i in range(2):
        assert rates["dead-first"][i] > rates["lru"][i]
        # Knowing all dead content is at least as good as knowing one kind of it.
        assert rates["dead-first"][i] >= max(rates["dead-once-first"][i],
                                              rates["dead-repeat-first"][i]) - 0.002
    gap = result.widest_gap()
    assert gap["best_policy"] is None  # only lru is online here


def test_queue_puts_only_its_kind_of_dead_content_first():
    # Hash "a" used by admissions 0 and 1 (reused, then dead), "b" by 0 only (seen once,
    # dead), "c" by 0 and 5 (alive).
    future = FutureUses([[b"a", b"b", b"c"], [b"a"], [], [], [], [b"c"]], [3, 1, 0, 0, 0, 1])
    orders = {}
    for name, kind in DEAD_CONTENT_KINDS.items():
        queue = DeadContentFirstFreeBlockQueue([KVCacheBlock(i) for i in range(5)], future,
                                               kind)
        queue.now = 1
        taken = queue.popleft_n(4)
        for block, block_hash in zip(taken, [b"a", b"b", b"c", None], strict=True):
            block.block_hash = block_hash
        queue.release(taken)
        orders[name] = [b.block_id for b in queue.get_all_free_blocks()]
    # Block 3 holds nothing (head); then the dead content of the kind; then LRU order.
    assert orders["dead-first"] == [3, 4, 0, 1, 2]
    assert orders["dead-once-first"] == [3, 4, 1, 0, 2]
    assert orders["dead-repeat-first"] == [3, 4, 0, 1, 2]
    with pytest.raises(ValueError, match="kind"):
        DeadContentFirstFreeBlockQueue([], future, "some")


def test_replay_accepts_each_diagnostic(prefix_512):
    lru = replay(prefix_512, ReplayConfig(3000, "lru"))
    for name in DIAGNOSTICS:
        result = replay(prefix_512, ReplayConfig(3000, name))
        assert result.policy == name
        assert result.num_admitted_requests == lru.num_admitted_requests
        assert result.hit_rate >= lru.hit_rate
