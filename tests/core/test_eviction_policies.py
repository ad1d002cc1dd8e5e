"""Free-order policies: "lru" (the design, default) and "unhashed-first" (vLLM 0.33), and
what the two-segment ones ("2q" and its kin) keep across a reset and in their marks."""

from __future__ import annotations

import pytest

from prefixcache.core import (
    DEFAULT_EVICTION_POLICY,
    EVICTION_POLICIES,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    Request,
)
from tests.core.helpers import free_ids, make_manager, schedule_prefill, seq


def make_queue(policy: str, n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return EVICTION_POLICIES[policy](blocks), blocks


def queue_ids(queue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_registry_and_default():
    assert DEFAULT_EVICTION_POLICY == "lru"
    assert set(EVICTION_POLICIES) >= {"lru", "unhashed-first"}
    for cls in EVICTION_POLICIES.values():
        assert issubclass(cls, FreeKVCacheBlockQueue)
    assert make_manager().block_pool.eviction_policy == "lru"


def test_lru_release_appends_everything_in_the_given_order():
    queue, blocks = make_queue("lru", 8)
    taken = queue.popleft_n(5)
    taken[1].block_hash = b"h1"
    taken[3].block_hash = b"h3"
    queue.release([taken[4], taken[3], taken[2], taken[1], taken[0]])
    assert queue_ids(queue) == [5, 6, 7, 4, 3, 2, 1, 0]


def test_unhashed_first_release_prepends_unhashed_and_appends_hashed():
    queue, blocks = make_queue("unhashed-first", 8)
    taken = queue.popleft_n(5)
    taken[1].block_hash = b"h1"
    taken[3].block_hash = b"h3"
    queue.release([taken[4], taken[3], taken[2], taken[1], taken[0]])
    # unhashed 4, 2, 0 go to the head in release order; hashed 3, 1 to the tail
    assert queue_ids(queue) == [4, 2, 0, 5, 6, 7, 3, 1]
    assert queue.num_free_blocks == 8
    # a later release's unhashed blocks go in front of the earlier ones
    more = queue.popleft_n(2)
    assert [b.block_id for b in more] == [4, 2]
    queue.release(more)
    assert queue_ids(queue) == [4, 2, 0, 5, 6, 7, 3, 1]


def test_unhashed_first_all_hashed_is_plain_append():
    queue, blocks = make_queue("unhashed-first", 4)
    taken = queue.popleft_n(2)
    for b in taken:
        b.block_hash = b"x%d" % b.block_id
    queue.release(list(reversed(taken)))
    assert queue_ids(queue) == [2, 3, 1, 0]


@pytest.mark.parametrize("policy,expected", [
    ("lru", [6, 7, 8, 9, 5, 4, 3, 2, 1, 0]),
    ("unhashed-first", [5, 6, 7, 8, 9, 4, 3, 2, 1, 0]),
])
def test_manager_free_order_per_policy(policy, expected):
    mgr = make_manager(num_blocks=10, block_size=4, eviction_policy=policy)
    r = Request("r", seq(0, 22))  # 5 full blocks and a partial one
    assert schedule_prefill(mgr, r) == (0, [0, 1, 2, 3, 4, 5])
    mgr.free(r)
    assert free_ids(mgr) == expected


@pytest.mark.parametrize("policy", ["lru", "unhashed-first"])
def test_policies_serve_the_same_hits(policy):
    mgr = make_manager(num_blocks=10, block_size=4, eviction_policy=policy)
    r = Request("r", seq(0, 22))
    schedule_prefill(mgr, r)
    mgr.free(r)
    assert schedule_prefill(mgr, Request("s", seq(0, 21)))[0] == 20


def test_unhashed_first_keeps_cached_blocks_longer():
    """A freed partial block is reused before an older cached block is evicted."""
    lru = make_manager(num_blocks=3, block_size=4)
    uf = make_manager(num_blocks=3, block_size=4, eviction_policy="unhashed-first")
    for mgr in (lru, uf):
        r0 = Request("0", seq(0, 4))  # block 0, cached
        schedule_prefill(mgr, r0)
        mgr.free(r0)
        r1 = Request("1", seq(100, 6))  # blocks 1 (cached) and 2 (partial)
        assert schedule_prefill(mgr, r1) == (0, [1, 2])
        mgr.free(r1)
    assert free_ids(lru) == [0, 2, 1]
    assert free_ids(uf) == [2, 0, 1]
    assert schedule_prefill(lru, Request("x", [7])) == (0, [0])  # evicts r0's block
    assert schedule_prefill(uf, Request("x", [7])) == (0, [2])  # reuses the partial block
    assert lru.get_computed_blocks(Request("q", seq(0, 5)))[1] == 0
    assert uf.get_computed_blocks(Request("q", seq(0, 5)))[1] == 4
    assert lru.get_computed_blocks(Request("p", seq(100, 5)))[1] == 4
    assert uf.get_computed_blocks(Request("p", seq(100, 5)))[1] == 4


def test_a_new_policy_plugs_into_the_registry(monkeypatch):
    released_by = []

    class FifoFreeBlockQueue(FreeKVCacheBlockQueue):
        """Released blocks join the tail in table order (prefix first)."""

        policy_name = "fifo-test"

        def release(self, blocks, request=None):
            released_by.append(request)
            self.append_n(list(reversed(blocks)))

    monkeypatch.setitem(EVICTION_POLICIES, "fifo-test", FifoFreeBlockQueue)
    mgr = make_manager(num_blocks=6, block_size=4, eviction_policy="fifo-test")
    r = Request("r", seq(0, 10))
    schedule_prefill(mgr, r)
    mgr.free(r)
    assert free_ids(mgr) == [3, 4, 5, 0, 1, 2]
    assert released_by == [r]  # the policy is told whose blocks it gets


def test_unknown_policy_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError) as excinfo:
        make_manager(eviction_policy="random")
    assert "lru" in str(excinfo.value)
    assert "unhashed-first" in str(excinfo.value)


# -- a prefix-cache reset empties the protected segment of the two-segment policies -------

def _admit_and_free(mgr, request_id: str, prompt: list[int]) -> tuple[int, list[int]]:
    request = Request(request_id, prompt)
    num_hit_tokens, new_ids = schedule_prefill(mgr, request)
    assert new_ids is not None
    mgr.free(request)
    return num_hit_tokens, new_ids


def _protect_a_document_then_reset(policy: str):
    mgr = make_manager(num_blocks=10, block_size=4, eviction_policy=policy)
    for i in range(3):  # asked again and again: the two-segment policies keep it upper
        _admit_and_free(mgr, f"doc{i}", seq(0, 33))  # 8 full blocks and a partial one
    return mgr


@pytest.mark.parametrize("policy", ["2q", "learned-reuse"])
def test_a_reset_moves_the_upper_segment_to_the_head_of_the_lower_one(policy):
    mgr = _protect_a_document_then_reset(policy)
    queue = mgr.block_pool.free_block_queue
    upper = [b.block_id for b in queue.upper.get_all_free_blocks()]
    lower = free_ids(mgr)[:queue.num_lower]
    assert len(upper) == 8
    assert mgr.reset_prefix_cache()
    # They hold nothing now: taken first, like any other unhashed block.
    assert free_ids(mgr) == upper + lower
    assert (queue.num_lower, queue.upper.num_free_blocks, queue.num_free_blocks) == (10, 0, 10)
    assert not any(queue.in_upper)


@pytest.mark.parametrize("policy", ["2q", "learned-reuse", "document-liveness"])
def test_after_a_reset_empty_blocks_are_taken_before_new_content_is_evicted(policy):
    outcomes = {}
    for name in (policy, "unhashed-first"):
        mgr = _protect_a_document_then_reset(name)
        assert mgr.reset_prefix_cache()
        empty_first = free_ids(mgr)[:3]
        prompt = seq(100, 9)  # 2 full blocks and a partial one
        assert _admit_and_free(mgr, "p", prompt) == (0, empty_first)
        _admit_and_free(mgr, "x", seq(200, 5))  # 2 blocks: 7 empty ones are free
        outcomes[name] = (mgr.block_pool.num_evictions,
                          mgr.get_computed_blocks(Request("p again", prompt))[1])
    assert outcomes[policy] == outcomes["unhashed-first"] == (0, 8)


# -- 2q's marks of content referenced again ---------------------------------------------

def test_2q_new_content_in_a_block_that_held_protected_content_starts_in_probation():
    mgr = make_manager(num_blocks=8, block_size=4, eviction_policy="2q")
    queue = mgr.block_pool.free_block_queue
    _admit_and_free(mgr, "a", seq(0, 9))  # 2 full blocks and a partial one
    _admit_and_free(mgr, "a again", seq(0, 9))  # its 2 full blocks hit: protected
    assert queue.upper.num_free_blocks == 2
    _admit_and_free(mgr, "b", seq(100, 32))  # 8 new blocks: every block, a's included
    assert queue.upper.num_free_blocks == 0  # referenced once: all in probation


@pytest.mark.parametrize("reset", [False, True])
def test_2q_protects_a_recomputation_through_the_ghost_unless_the_cache_was_reset(reset):
    mgr = make_manager(num_blocks=8, block_size=4, eviction_policy="2q")
    _admit_and_free(mgr, "a", seq(0, 9))
    _admit_and_free(mgr, "b", seq(100, 32))  # evicts a's blocks: their hashes join the ghost
    if reset:
        assert mgr.reset_prefix_cache()
    assert _admit_and_free(mgr, "a again", seq(0, 9))[0] == 0  # computed again
    assert mgr.block_pool.free_block_queue.upper.num_free_blocks == (0 if reset else 2)
