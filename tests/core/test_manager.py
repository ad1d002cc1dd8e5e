"""KVCacheManager stories mirroring vLLM's test_prefix_caching.py (ids shifted: no null block),
under both free-order policies where the order matters."""

from __future__ import annotations

import pytest

from prefixcache.core import KVCacheManager, Request, get_hash_fn
from tests.core.helpers import (
    blocks_under,
    cached_ids,
    free_ids,
    make_manager,
    ref_cnts,
    schedule_decode,
    schedule_prefill,
    seq,
    snapshot,
)

POLICIES = ["lru", "unhashed-first"]
COMMON = seq(0, 48)  # three blocks of 16


# -- prefill -----------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("policy", POLICIES)
def test_prefill(algo, policy, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    mgr = KVCacheManager(num_blocks=10, block_size=16, hash_algo=algo,
                         eviction_policy=policy)
    # cold prefill: 3 full blocks + 7 tokens
    r0 = Request("0", COMMON + [3] * 7)
    assert mgr.get_computed_blocks(r0) == ([], 0)
    assert len(r0.block_hashes) == 3
    new = mgr.allocate_slots(r0, 55)
    assert [b.block_id for b in new] == [0, 1, 2, 3]
    r0.num_computed_tokens = 55
    hash_fn = get_hash_fn(algo)
    parent = hash_fn("vllm-none-hash")
    for i in range(3):
        parent = hash_fn((parent, tuple(COMMON[16 * i:16 * i + 16]), None))
        block = mgr.block_pool.blocks[i]
        assert block.block_hash == parent == r0.block_hashes[i]
        assert block.ref_cnt == 1
    assert mgr.block_pool.blocks[3].block_hash is None
    assert mgr.block_pool.blocks[3].ref_cnt == 1

    # a second request sharing the 48-token prefix while the first is alive
    r1 = Request("1", COMMON + [4] * 5)
    blocks, num_hit_tokens = mgr.get_computed_blocks(r1)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert num_hit_tokens == 48
    new = mgr.allocate_slots(r1, 5, num_new_computed_tokens=48, new_computed_blocks=blocks)
    assert [b.block_id for b in new] == [4]
    r1.num_computed_tokens = 53
    assert ref_cnts(mgr, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    assert mgr.num_free_blocks == 5

    # both freed: the design appends every block, table reversed; unhashed-first puts the
    # partial blocks (most recently freed first) in front of never-used blocks
    mgr.free(r0)
    mgr.free(r1)
    expected = {"lru": [5, 6, 7, 8, 9, 3, 4, 2, 1, 0],
                "unhashed-first": [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]}[policy]
    assert free_ids(mgr) == expected

    # a hit on free cached blocks; the new tail block comes from the head
    r2 = Request("2", COMMON + [3] * 7)
    assert schedule_prefill(mgr, r2) == (48, [{"lru": 5, "unhashed-first": 4}[policy]])
    assert mgr.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.free_block_queue.get_all_free_blocks())
    mgr.free(r2)
    expected = {"lru": [6, 7, 8, 9, 3, 4, 5, 2, 1, 0],
                "unhashed-first": [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]}[policy]
    assert free_ids(mgr) == expected

    # a large miss needing every block takes them in queue order (the eviction order)
    r3 = Request("3", [99] * 160)
    assert schedule_prefill(mgr, r3) == (0, expected)
    queue = mgr.block_pool.free_block_queue
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head
    # every earlier hash is evicted; only request 3's ten blocks are cached
    assert all(mgr.block_pool.get_cached_block(h) is None for h in r0.block_hashes)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 10
    assert mgr.usage == 1.0


def test_skip_reading_prefix_cache_gets_no_hit_but_writes_duplicates():
    mgr = make_manager(num_blocks=10, block_size=16)
    r0 = Request("0", COMMON + [3] * 7)
    schedule_prefill(mgr, r0)
    plp = Request("plp", COMMON + [3] * 7, skip_reading_prefix_cache=True)
    assert mgr.get_computed_blocks(plp) == ([], 0)
    new = mgr.allocate_slots(plp, 55)
    assert [b.block_id for b in new] == [4, 5, 6, 7]
    assert plp.block_hashes == r0.block_hashes
    for i in range(3):
        assert mgr.block_pool.blocks[4 + i].block_hash == r0.block_hashes[i]
        assert blocks_under(mgr, r0.block_hashes[i]) == [i, 4 + i]
    assert ref_cnts(mgr, range(8)) == [1] * 8
    assert mgr.block_pool.blocks[7].block_hash is None
    # a normal reader still hits (either copy would do)
    blocks, num_hit_tokens = mgr.get_computed_blocks(Request("r", COMMON + [1]))
    assert num_hit_tokens == 48
    assert [b.block_hash for b in blocks] == r0.block_hashes


# -- decode ------------------------------------------------------------------------------

def test_decode():
    mgr = make_manager(num_blocks=10, block_size=16)
    r0 = Request("0", COMMON + [3] * 7)
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2, 3])
    # 4 tokens inside the partial block: nothing allocated, the last block stays unhashed
    assert schedule_decode(mgr, r0, [8] * 4) == []
    assert mgr.get_block_ids("0") == [0, 1, 2, 3]
    assert mgr.block_pool.blocks[3].block_hash is None
    assert len(r0.block_hashes) == 3
    # 19 more: one new block, the previous block becomes hashed, the newest stays unhashed
    assert schedule_decode(mgr, r0, [7] * 19) == [4]
    assert len(r0.block_hashes) == 4
    assert mgr.block_pool.blocks[3].block_hash == r0.block_hashes[3]
    assert mgr.block_pool.get_cached_block(r0.block_hashes[3]) is mgr.block_pool.blocks[3]
    assert mgr.block_pool.blocks[4].block_hash is None


def test_decode_one_token_at_a_time_caches_exactly_when_a_block_fills():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 5))
    assert schedule_prefill(mgr, r) == (0, [0, 1])
    allocated = []
    for t in range(5, 13):
        allocated.append(schedule_decode(mgr, r, t))
        assert cached_ids(mgr) == list(range((t + 1) // 4))
    # tokens 5..12 -> num_tokens 6..13: a new block when the 9th and the 13th token arrive
    assert allocated == [[], [], [], [2], [], [], [], [3]]
    assert mgr.get_block_ids("r") == [0, 1, 2, 3]


def test_multi_token_decode_crossing_several_blocks():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 3))
    schedule_prefill(mgr, r)
    assert schedule_decode(mgr, r, seq(3, 10)) == [1, 2, 3]
    assert cached_ids(mgr) == [0, 1, 2]
    assert [mgr.block_pool.blocks[i].block_hash for i in range(3)] == r.block_hashes


# -- eviction ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_evict(policy):
    mgr = make_manager(num_blocks=10, block_size=16, eviction_policy=policy)
    r0 = Request("0", seq(0, 5 * 16 + 7))
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2, 3, 4, 5])
    r1 = Request("1", seq(87, 48))
    assert schedule_prefill(mgr, r1) == (0, [6, 7, 8])
    mgr.free(r0)
    expected = {"lru": [9, 5, 4, 3, 2, 1, 0],
                "unhashed-first": [5, 9, 4, 3, 2, 1, 0]}[policy]
    assert free_ids(mgr) == expected
    mgr.free(r1)
    assert free_ids(mgr) == expected + [8, 7, 6]
    # a 2-block hit touches blocks 0 and 1 and takes the new block from the head
    r2 = Request("2", seq(0, 2 * 16 + 3))
    blocks, num_hit_tokens = mgr.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert num_hit_tokens == 32
    new = mgr.allocate_slots(r2, 3, num_new_computed_tokens=32, new_computed_blocks=blocks)
    assert [b.block_id for b in new] == [expected[0]]
    assert mgr.num_free_blocks == 7
    assert free_ids(mgr) == [i for i in expected[1:] if i not in (0, 1)] + [8, 7, 6]


def test_cached_block_reused_as_a_new_block_has_its_hash_cleared():
    mgr = make_manager(num_blocks=1, block_size=16)
    r0 = Request("0", seq(0, 16))
    schedule_prefill(mgr, r0)
    assert mgr.block_pool.blocks[0].block_hash == r0.block_hashes[0]
    mgr.free(r0)
    r1 = Request("1", seq(100, 15))
    assert schedule_prefill(mgr, r1) == (0, [0])
    assert mgr.block_pool.blocks[0].block_hash is None
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert mgr.block_pool.get_cached_block(r0.block_hashes[0]) is None


def test_computed_blocks_are_not_evicted_by_their_own_allocation():
    mgr = make_manager(num_blocks=2, block_size=4)
    r0 = Request("0", seq(0, 4))
    r1 = Request("1", seq(100, 4))
    assert schedule_prefill(mgr, r0) == (0, [0])
    assert schedule_prefill(mgr, r1) == (0, [1])
    mgr.free(r0)
    mgr.free(r1)
    assert free_ids(mgr) == [0, 1]  # the hit block 0 is at the head
    r2 = Request("2", seq(0, 4) + seq(200, 4))
    assert schedule_prefill(mgr, r2) == (4, [1])
    assert mgr.get_block_ids("2") == [0, 1]
    assert mgr.block_pool.blocks[0].block_hash == r0.block_hashes[0]
    assert mgr.block_pool.get_cached_block(r1.block_hashes[0]) is None


def test_lru_eviction_prefers_the_least_recently_freed():
    mgr = make_manager(num_blocks=4, block_size=4)
    a, b = Request("a", seq(0, 8)), Request("b", seq(100, 8))
    schedule_prefill(mgr, a)
    schedule_prefill(mgr, b)
    mgr.free(a)  # a's blocks are older in the queue
    mgr.free(b)
    assert free_ids(mgr) == [1, 0, 3, 2]
    # a new 1-block request evicts a's last block first, then a's first
    c = Request("c", seq(200, 4))
    assert schedule_prefill(mgr, c) == (0, [1])
    assert mgr.get_computed_blocks(Request("a2", seq(0, 8) + [1]))[1] == 4
    d = Request("d", seq(300, 4))
    assert schedule_prefill(mgr, d) == (0, [0])
    assert mgr.get_computed_blocks(Request("a3", seq(0, 8) + [1]))[1] == 0
    assert mgr.get_computed_blocks(Request("b2", seq(100, 8) + [1]))[1] == 8


def test_hit_refreshes_recency():
    """A free cached block that is hit and freed again moves to the tail."""
    mgr = make_manager(num_blocks=4, block_size=4)
    a, b = Request("a", seq(0, 4)), Request("b", seq(100, 4))
    schedule_prefill(mgr, a)
    schedule_prefill(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr) == [2, 3, 0, 1]
    a2 = Request("a2", seq(0, 4) + [7])
    assert schedule_prefill(mgr, a2) == (4, [2])
    mgr.free(a2)
    assert free_ids(mgr) == [3, 1, 2, 0]


# -- caching disabled --------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_prefix_caching_disabled(policy):
    mgr = make_manager(num_blocks=4, block_size=4, enable_caching=False,
                       eviction_policy=policy)
    r1 = Request("1", seq(0, 10))
    assert schedule_prefill(mgr, r1) == (0, [0, 1, 2])
    assert cached_ids(mgr) == []
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    mgr.free(r1)
    expected = {"lru": [3, 2, 1, 0], "unhashed-first": [2, 1, 0, 3]}[policy]
    assert free_ids(mgr) == expected
    r2 = Request("2", seq(0, 10))
    assert mgr.get_computed_blocks(r2) == ([], 0)
    assert schedule_prefill(mgr, r2) == (0, expected[:3])
    assert cached_ids(mgr) == []
    r3 = Request("3", seq(0, 7))
    before = snapshot(mgr, ["2", "3"])
    assert schedule_prefill(mgr, r3) == (0, None)
    assert snapshot(mgr, ["2", "3"]) == before
    assert mgr.take_events() == []


# -- the last prompt token is always computed --------------------------------------------

@pytest.mark.parametrize("prompt_len,expected_hit", [
    (1, 0), (3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (14, 12),
])
def test_hit_leaves_at_least_the_last_token(prompt_len, expected_hit):
    mgr = make_manager(num_blocks=10, block_size=4)
    warm = Request("warm", seq(0, 16))
    schedule_prefill(mgr, warm)
    assert cached_ids(mgr) == [0, 1, 2, 3]
    blocks, num_hit_tokens = mgr.get_computed_blocks(Request("r", seq(0, prompt_len)))
    assert num_hit_tokens == expected_hit
    assert [b.block_id for b in blocks] == list(range(expected_hit // 4))


def test_fully_cached_prompt_recomputes_its_last_block_as_a_duplicate():
    mgr = make_manager(num_blocks=10, block_size=4)
    r0 = Request("0", seq(0, 12))
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2])
    r1 = Request("1", seq(0, 12))
    assert schedule_prefill(mgr, r1) == (8, [3])
    assert mgr.get_block_ids("1") == [0, 1, 3]
    # block 3 is full at allocation, so it is cached at once: a duplicate of block 2
    assert blocks_under(mgr, r0.block_hashes[2]) == [2, 3]
    assert ref_cnts(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]


# -- same batch --------------------------------------------------------------------------

def test_blocks_cached_at_allocation_are_shared_within_the_batch():
    mgr = make_manager(num_blocks=10, block_size=4)
    r0 = Request("0", seq(0, 13))
    new = mgr.allocate_slots(r0, 13)  # scheduled, not computed yet
    assert [b.block_id for b in new] == [0, 1, 2, 3]
    assert r0.num_computed_tokens == 0
    assert cached_ids(mgr) == [0, 1, 2]
    r1 = Request("1", seq(0, 13))
    blocks, num_hit_tokens = mgr.get_computed_blocks(r1)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert num_hit_tokens == 12


def test_chunked_prefill_caches_each_chunks_full_blocks():
    mgr = make_manager(num_blocks=10, block_size=4)
    r0 = Request("0", seq(0, 13))
    assert schedule_prefill(mgr, r0, num_tokens=6) == (0, [0, 1])
    assert cached_ids(mgr) == [0]
    assert mgr.get_computed_blocks(Request("x", seq(0, 13)))[1] == 4
    new = mgr.allocate_slots(r0, 7)
    assert [b.block_id for b in new] == [2, 3]
    r0.num_computed_tokens = 13
    assert cached_ids(mgr) == [0, 1, 2]
    assert mgr.get_computed_blocks(Request("y", seq(0, 13)))[1] == 12


def test_lookahead_slots_are_reserved_but_not_cached():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 3))
    new = mgr.allocate_slots(r, 3, num_lookahead_tokens=2)
    assert [b.block_id for b in new] == [0, 1]
    r.num_computed_tokens = 3
    assert cached_ids(mgr) == []
    r2 = Request("r2", seq(0, 3))
    assert [b.block_id for b in mgr.allocate_slots(r2, 3, num_lookahead_tokens=4)] == [2, 3]
    r3 = Request("r3", seq(0, 4))
    assert [b.block_id for b in mgr.allocate_slots(r3, 4, num_lookahead_tokens=4)] == [4, 5]
    assert cached_ids(mgr) == [4]


# -- allocation failure ------------------------------------------------------------------

def _warm_then_hold(num_prompt_tail: int) -> tuple[KVCacheManager, Request]:
    """Cache seq(0, 16) in blocks 0..3 (free), hold 3 blocks with another request."""
    mgr = make_manager(num_blocks=10, block_size=4)
    warm = Request("warm", seq(0, 16) + [99])
    assert schedule_prefill(mgr, warm) == (0, [0, 1, 2, 3, 4])
    mgr.free(warm)
    assert schedule_prefill(mgr, Request("hold", seq(500, 12))) == (0, [5, 6, 7])
    assert free_ids(mgr) == [8, 9, 4, 3, 2, 1, 0]
    return mgr, Request("r", seq(0, 16) + seq(1000, num_prompt_tail))


def test_failed_allocation_with_free_hit_blocks_changes_nothing():
    # 36 tokens: 4 free hit blocks + 5 new > 7 free blocks
    mgr, r = _warm_then_hold(20)
    blocks, num_hit_tokens = mgr.get_computed_blocks(r)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    before = snapshot(mgr, ["hold", "r"])
    assert mgr.allocate_slots(r, 20, num_new_computed_tokens=16,
                              new_computed_blocks=blocks) is None
    assert snapshot(mgr, ["hold", "r"]) == before
    assert ref_cnts(mgr, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert mgr.get_block_ids("r") == []


def test_free_hit_blocks_count_against_capacity_at_the_boundary():
    # 28 tokens: 4 free hit blocks + 3 new = exactly the 7 free blocks
    mgr, r = _warm_then_hold(12)
    assert schedule_prefill(mgr, r) == (16, [8, 9, 4])
    assert mgr.get_block_ids("r") == [0, 1, 2, 3, 8, 9, 4]
    assert mgr.num_free_blocks == 0
    # 29 tokens: one block too many
    mgr, r = _warm_then_hold(13)
    before = snapshot(mgr, ["hold", "r"])
    assert schedule_prefill(mgr, r) == (16, None)
    assert snapshot(mgr, ["hold", "r"]) == before


def test_hit_blocks_in_use_do_not_count_against_capacity():
    mgr = make_manager(num_blocks=10, block_size=4)
    schedule_prefill(mgr, Request("live", seq(0, 16) + [99]))  # holds 0..4
    assert mgr.num_free_blocks == 5
    too_big = Request("big", seq(0, 16) + seq(1000, 24))  # 10 blocks: 4 hits + 6 new
    before = snapshot(mgr, ["live", "big"])
    assert schedule_prefill(mgr, too_big) == (16, None)
    assert snapshot(mgr, ["live", "big"]) == before
    fits = Request("fits", seq(0, 16) + seq(1000, 20))  # 9 blocks: 4 hits + 5 new
    assert schedule_prefill(mgr, fits) == (16, [5, 6, 7, 8, 9])
    assert ref_cnts(mgr, range(5)) == [2, 2, 2, 2, 1]


def test_failed_decode_allocation_changes_nothing():
    mgr = make_manager(num_blocks=2, block_size=4)
    r = Request("r", seq(0, 8))
    assert schedule_prefill(mgr, r) == (0, [0, 1])
    before = snapshot(mgr, ["r"])
    assert schedule_decode(mgr, r, 8) is None
    assert snapshot(mgr, ["r"]) == before
    assert mgr.get_block_ids("r") == [0, 1]


# -- free --------------------------------------------------------------------------------

def test_free_twice_and_free_unknown_are_no_ops():
    mgr = make_manager(num_blocks=10, block_size=4)
    a = Request("a", seq(0, 9))
    b = Request("b", seq(0, 9))
    schedule_prefill(mgr, a)
    schedule_prefill(mgr, b)
    assert ref_cnts(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    mgr.free(a)
    before = snapshot(mgr, ["a", "b"])
    mgr.free(a)
    mgr.free(Request("never-seen", [1, 2, 3]))
    assert snapshot(mgr, ["a", "b"]) == before
    assert ref_cnts(mgr, [0, 1, 2, 3]) == [1, 1, 0, 1]


def test_freed_request_can_be_rescheduled_from_scratch():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 10))
    assert schedule_prefill(mgr, r) == (0, [0, 1, 2])
    mgr.free(r)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    r.num_computed_tokens = 0  # preempted: recompute, hitting its own cached blocks
    assert schedule_prefill(mgr, r) == (8, [3])
    assert mgr.get_block_ids("r") == [0, 1, 3]


# -- reset -------------------------------------------------------------------------------

def test_reset_prefix_cache():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r = Request("r", seq(0, 13))
    schedule_prefill(mgr, r)
    mgr.take_events()
    before = snapshot(mgr, ["r"])
    assert mgr.reset_prefix_cache() is False
    assert snapshot(mgr, ["r"]) == before
    assert mgr.take_events() == []
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    mgr.free(r)
    assert mgr.reset_prefix_cache() is True
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert mgr.num_free_blocks == 10
    assert mgr.get_computed_blocks(Request("again", seq(0, 13))) == ([], 0)
    # a second reset of an empty cache succeeds too
    assert mgr.reset_prefix_cache() is True


def test_reset_refused_while_only_an_unhashed_block_is_held():
    mgr = make_manager(num_blocks=10, block_size=4)
    cached = Request("cached", seq(0, 8))
    schedule_prefill(mgr, cached)
    mgr.free(cached)
    schedule_prefill(mgr, Request("tiny", [5]))
    assert mgr.reset_prefix_cache() is False
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    assert cached_ids(mgr) == [0, 1]


# -- stats and usage ---------------------------------------------------------------------

def test_prefix_cache_stats_count_requests_queries_and_hits_in_tokens():
    mgr = make_manager(num_blocks=10, block_size=4)
    r0_tokens = seq(0, 15)
    schedule_prefill(mgr, Request("0", r0_tokens))
    schedule_prefill(mgr, Request("1", r0_tokens[:10] + [100, 101, 102, 103]))
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 29, 8)
    assert stats.hit_rate == pytest.approx(8 / 29)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert stats.hit_rate == 0.0
    schedule_prefill(mgr, Request("2", r0_tokens))
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 15, 12)


def test_prefix_cache_stats_count_a_request_once_when_it_is_admitted():
    mgr = make_manager(num_blocks=4, block_size=4)
    a = Request("a", seq(0, 13))  # 4 blocks: the whole pool
    schedule_prefill(mgr, a)
    mgr.make_prefix_cache_stats()
    # A scheduler looks a blocked request up again at every step: no admission, no count.
    b = Request("b", seq(0, 14))
    for _ in range(3):
        assert schedule_prefill(mgr, b) == (12, None)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    mgr.free(a)
    assert schedule_prefill(mgr, b, 1) == (12, [3])  # admitted: a chunk of one token
    assert schedule_decode(mgr, b, []) == []  # the rest of the prompt: no new lookup
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 14, 12)
    # Readmitted after preemption, it is looked up again and counted apart.
    mgr.free(b)
    b.num_computed_tokens = 0
    b.num_preemptions = 1  # as the scheduler does
    assert schedule_prefill(mgr, b) == (12, [3])
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) \
        == (1, 14, 12)


def test_prefix_cache_stats_leave_out_requests_that_do_not_read_the_cache():
    for mgr, request in ((make_manager(enable_caching=False), Request("off", seq(0, 9))),
                         (make_manager(), Request("w", seq(0, 9),
                                                  skip_reading_prefix_cache=True))):
        assert schedule_prefill(mgr, request) == (0, [0, 1, 2])
        stats = mgr.make_prefix_cache_stats()
        assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_usage_counts_blocks_held_by_requests():
    mgr = make_manager(num_blocks=10, block_size=4)
    assert mgr.usage == 0.0
    a = Request("a", seq(0, 13))
    schedule_prefill(mgr, a)
    assert mgr.usage == pytest.approx(0.4)
    b = Request("b", seq(0, 13))
    schedule_prefill(mgr, b)  # shares 3 blocks, adds 1
    assert mgr.usage == pytest.approx(0.5)
    mgr.free(a)
    assert mgr.usage == pytest.approx(0.4)
    mgr.free(b)
    assert mgr.usage == 0.0  # cached free blocks count as free
    assert cached_ids(mgr) == [0, 1, 2]


def test_get_computed_blocks_changes_no_state():
    mgr = make_manager(num_blocks=10, block_size=4)
    a = Request("a", seq(0, 13))
    schedule_prefill(mgr, a)
    mgr.free(a)
    before = snapshot(mgr, ["a", "b"])
    blocks, num_hit_tokens = mgr.get_computed_blocks(Request("b", seq(0, 13)))
    assert num_hit_tokens == 12
    assert snapshot(mgr, ["a", "b"]) == before
    assert mgr.get_block_ids("b") == []


def test_unknown_request_has_an_empty_block_table():
    assert make_manager().get_block_ids("nope") == []


# -- duplicates are dropped when their request is freed ----------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_freeing_a_duplicate_uncaches_it_and_keeps_the_original(policy):
    mgr = make_manager(num_blocks=10, block_size=4, eviction_policy=policy,
                       enable_events=True)
    r0 = Request("0", seq(0, 12))
    schedule_prefill(mgr, r0)  # 0, 1, 2 cached
    r1 = Request("1", seq(0, 12))
    assert schedule_prefill(mgr, r1) == (8, [3])  # block 3 duplicates block 2
    mgr.take_events()
    mgr.free(r1)
    h2 = r0.block_hashes[2]
    assert blocks_under(mgr, h2) == [2]
    assert mgr.block_pool.blocks[3].block_hash is None
    assert mgr.take_events() == []  # the hash is still cached: nothing to report
    # block 3 holds nothing reusable now: unhashed-first puts it at the head
    expected = {"lru": [4, 5, 6, 7, 8, 9, 3], "unhashed-first": [3, 4, 5, 6, 7, 8, 9]}[policy]
    assert free_ids(mgr) == expected


@pytest.mark.parametrize("guard", [False, True])
def test_duplicate_of_a_free_cached_block_is_dropped_on_free(guard):
    mgr = make_manager(num_blocks=10, block_size=4, verify_cached_tokens=guard)
    r0 = Request("0", seq(0, 5))
    schedule_prefill(mgr, r0)
    mgr.free(r0)  # block 0 stays cached, free
    w = Request("w", seq(0, 5), skip_reading_prefix_cache=True)
    assert schedule_prefill(mgr, w) == (0, [2, 3])  # block 2 duplicates free block 0
    h = r0.block_hashes[0]
    assert blocks_under(mgr, h) == [0, 2]
    mgr.free(w)
    assert blocks_under(mgr, h) == [0]
    assert mgr.block_pool.blocks[2].block_hash is None
    blocks, num_hit_tokens = mgr.get_computed_blocks(Request("again", seq(0, 5)))
    assert [b.block_id for b in blocks] == [0]
    assert num_hit_tokens == 4


# -- a hit on a hash held by a free block and an in-use duplicate shares the in-use one ----

def _free_copy_and_in_use_duplicate(num_blocks: int, guard: bool):
    """Block 1 (free) and block 3 (held by "dup") both cache the hash of seq(4, 8)."""
    mgr = make_manager(num_blocks=num_blocks, block_size=4, verify_cached_tokens=guard)
    r0 = Request("0", seq(0, 8) + [99])
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2])
    mgr.free(r0)  # blocks 0 and 1 stay cached, free
    dup = Request("dup", seq(0, 8))  # block-aligned: block 1's content is recomputed
    assert schedule_prefill(mgr, dup) == (4, [3])
    assert blocks_under(mgr, r0.block_hashes[1]) == [1, 3]
    assert ref_cnts(mgr, [1, 3]) == [0, 1]
    return mgr, r0.block_hashes[1]


@pytest.mark.parametrize("guard", [False, True])
def test_hit_on_a_hash_with_a_free_and_an_in_use_copy_shares_the_in_use_one(guard):
    mgr, h = _free_copy_and_in_use_duplicate(10, guard)
    assert mgr.block_pool.get_cached_block(h) is mgr.block_pool.blocks[3]
    r = Request("r", seq(0, 8) + [5, 5, 5])
    blocks, num_hit_tokens = mgr.get_computed_blocks(r)
    assert ([b.block_id for b in blocks], num_hit_tokens) == ([0, 3], 8)
    free_before = mgr.num_free_blocks
    assert mgr.allocate_slots(r, 3, num_new_computed_tokens=8,
                              new_computed_blocks=blocks) is not None
    assert mgr.num_free_blocks == free_before - 1  # only the new block: the hit cost none
    assert ref_cnts(mgr, [1, 3]) == [0, 2]


@pytest.mark.parametrize("guard", [False, True])
def test_sharing_the_in_use_duplicate_admits_a_request_that_the_free_copy_would_not(guard):
    # 5 blocks: after "dup", 3 are free (4, 2, 1); r needs 3 new blocks beside its 2 hits
    mgr, _ = _free_copy_and_in_use_duplicate(5, guard)
    assert mgr.num_free_blocks == 3
    r = Request("r", seq(0, 8) + seq(50, 9))
    assert schedule_prefill(mgr, r) == (8, [4, 2, 1])
    assert mgr.get_block_ids("r") == [0, 3, 4, 2, 1]
