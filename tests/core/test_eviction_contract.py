"""The eviction room's contract: the registry and its help text, the free-queue factory the
pool is built with, and the hooks the pool calls only on policies that override them."""

from __future__ import annotations

import json

import pytest

from prefixcache.core import (
    DEFAULT_EVICTION_POLICY,
    EVICTION_POLICIES,
    FreeKVCacheBlockQueue,
    KVCacheManager,
    Request,
    cdiv,
    describe_eviction_policies,
)
from prefixcache.core.eviction import LRUFreeBlockQueue, make_free_block_queue
from tests.core.helpers import free_ids, make_manager, schedule_prefill, seq


def test_every_registered_policy_is_a_free_queue_under_its_own_name_with_a_summary():
    assert DEFAULT_EVICTION_POLICY == "lru"
    assert list(EVICTION_POLICIES)[0] == "lru"
    for name, policy in EVICTION_POLICIES.items():
        assert issubclass(policy, FreeKVCacheBlockQueue)
        assert policy.policy_name == name
        assert policy.summary and "\n" not in policy.summary


def test_the_help_text_lists_every_policy_with_its_summary_in_registry_order():
    text = describe_eviction_policies()
    parts = [f"{name} ({policy.summary})" for name, policy in EVICTION_POLICIES.items()]
    assert text == ", ".join(parts)
    assert text.startswith("lru (the design's order), unhashed-first (vLLM 0.33's order)")


def test_a_policy_added_to_the_registry_shows_in_the_help_text(monkeypatch):
    class Fifo(LRUFreeBlockQueue):
        policy_name = "fifo-test"
        summary = "first in, first out"

    monkeypatch.setitem(EVICTION_POLICIES, Fifo.policy_name, Fifo)
    assert describe_eviction_policies().endswith(", fifo-test (first in, first out)")
    assert type(make_free_block_queue("fifo-test", [])) is Fifo


def test_the_pool_builds_its_queue_with_the_factory_it_is_given():
    calls = []

    def factory(blocks, cached):
        calls.append((blocks, cached))
        return LRUFreeBlockQueue(blocks)

    mgr = KVCacheManager(num_blocks=6, block_size=4, eviction_policy="my-oracle",
                         free_queue_factory=factory)
    pool = mgr.block_pool
    assert len(calls) == 1
    blocks, cached = calls[0]
    assert blocks is pool.blocks  # every block, in id order, all free
    assert cached is pool.cached_block_hash_to_block  # the live map, not a copy
    assert type(pool.free_block_queue) is LRUFreeBlockQueue
    assert free_ids(mgr) == [0, 1, 2, 3, 4, 5]
    # The name is only a label then; it need not be registered.
    assert pool.eviction_policy == "my-oracle"
    r = Request("r", seq(0, 9))
    assert schedule_prefill(mgr, r) == (0, [0, 1, 2])
    mgr.free(r)
    assert free_ids(mgr) == [3, 4, 5, 2, 1, 0]
    assert len(cached) == 2  # the factory's map is the one the pool caches into


def test_without_a_factory_an_unknown_name_is_still_rejected():
    with pytest.raises(ValueError, match="unknown eviction policy 'my-oracle'"):
        KVCacheManager(num_blocks=6, block_size=4, eviction_policy="my-oracle")


def test_only_a_policy_that_overrides_note_hit_in_use_is_told_of_hits_in_use():
    seen = []

    class Observing(LRUFreeBlockQueue):
        def note_hit_in_use(self, block):
            seen.append(block.block_id)

    assert not LRUFreeBlockQueue([]).observes_hits_in_use
    assert EVICTION_POLICIES["learned-reuse"]([]).observes_hits_in_use
    assert Observing([]).observes_hits_in_use
    mgr = KVCacheManager(num_blocks=8, block_size=4,
                         free_queue_factory=lambda blocks, cached: Observing(blocks))
    doc = seq(0, 8)
    schedule_prefill(mgr, Request("a", doc + [1]))  # blocks 0, 1, 2
    assert seen == []
    assert schedule_prefill(mgr, Request("b", doc + [2])) == (8, [3])
    assert seen == [0, 1]  # a's two full blocks, hit while a holds them


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_policy_state_is_none_or_a_dict_under_every_policy(policy):
    mgr = make_manager(num_blocks=16, block_size=4, eviction_policy=policy)
    for i in range(3):
        request = Request(str(i), seq(0, 9))
        schedule_prefill(mgr, request)
        request.append_output_token_ids([1, 2])
        mgr.free(request)
    state = mgr.block_pool.free_block_queue.policy_state()
    if policy in ("learned-reuse", "document-liveness", "adaptive"):
        assert isinstance(state, dict) and state
        json.dumps(state)  # reports print it
    else:
        assert state is None


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_candidate_standings_follow_exactly_one_candidate_or_are_empty(policy):
    mgr = make_manager(num_blocks=16, block_size=4, eviction_policy=policy)
    queue = mgr.block_pool.free_block_queue
    for i in range(4):
        request = Request(str(i), seq(0, 9))  # the same prompt: its blocks are hit again
        schedule_prefill(mgr, request)
        mgr.free(request)
    standings = queue.candidate_standings()
    if policy != "adaptive":
        assert standings == []
        return
    assert [standing.followed for standing in standings].count(True) == 1
    assert all(0 <= standing.share <= 1 for standing in standings)
    assert sum(standing.share for standing in standings) == pytest.approx(1)
    assert len({standing.label for standing in standings}) == len(standings)


@pytest.mark.parametrize("a,b,expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2),
                                          (8, 4, 2), (9, 1, 9), (511, 512, 1)])
def test_cdiv_rounds_up(a, b, expected):
    assert cdiv(a, b) == expected
