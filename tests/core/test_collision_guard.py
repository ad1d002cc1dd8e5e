"""The collision guard (verify_cached_tokens=True): a hit must hold the very tokens (and extra
keys) of the request, so even a colliding hash never serves another prefix's KV.

Collisions are forced by giving a request the block hashes of different content (as a weak
hash function would), or by filing a cached block under a foreign hash."""

from __future__ import annotations

import pytest

from prefixcache.core import KVCacheManager, Request
from tests.core.helpers import make_manager, ref_cnts, schedule_prefill, seq, snapshot


def colliding_request(mgr: KVCacheManager, request_id: str, tokens: list[int],
                      forced: dict[int, bytes], **kwargs) -> Request:
    """A request whose block ``i`` claims hash ``forced[i]`` whatever it holds."""
    req = Request(request_id, tokens, block_hasher=mgr.block_hasher, **kwargs)
    for i, block_hash in forced.items():
        req.block_hashes[i] = block_hash
    return req


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_guard_refuses_a_colliding_block_that_the_unguarded_manager_serves(algo):
    results = {}
    for guard in (False, True):
        mgr = make_manager(num_blocks=10, block_size=4, hash_algo=algo, hash_seed="s",
                           verify_cached_tokens=guard)
        a = Request("a", seq(0, 9))
        schedule_prefill(mgr, a)
        b = colliding_request(mgr, "b", seq(100, 9), {0: a.block_hashes[0],
                                                      1: a.block_hashes[1]})
        blocks, num_hit_tokens = mgr.get_computed_blocks(b)
        results[guard] = ([blk.block_id for blk in blocks], num_hit_tokens,
                          mgr.num_hash_collisions)
    assert results[False] == ([0, 1], 8, 0)  # wrong KV served without the guard
    assert results[True] == ([], 0, 1)


def test_guard_stops_at_the_first_colliding_block():
    mgr = make_manager(num_blocks=10, block_size=4, verify_cached_tokens=True)
    a = Request("a", seq(0, 13))
    schedule_prefill(mgr, a)
    # block 0 genuinely shared, block 1 collides, block 2 would "match" a's hash too
    b = colliding_request(mgr, "b", seq(0, 4) + seq(200, 9),
                          {1: a.block_hashes[1], 2: a.block_hashes[2]})
    blocks, num_hit_tokens = mgr.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0]
    assert num_hit_tokens == 4
    assert mgr.num_hash_collisions == 1
    # and the request then computes its own blocks
    new = mgr.allocate_slots(b, 9, num_new_computed_tokens=4, new_computed_blocks=blocks)
    assert [blk.block_id for blk in new] == [4, 5, 6]
    assert mgr.get_block_ids("b") == [0, 4, 5, 6]


def test_guard_compares_extra_keys_too():
    mgr = make_manager(num_blocks=10, block_size=4, verify_cached_tokens=True)
    a = Request("a", seq(0, 9), cache_salt="tenant-a")
    schedule_prefill(mgr, a)
    b = colliding_request(mgr, "b", seq(0, 9), {0: a.block_hashes[0], 1: a.block_hashes[1]},
                          cache_salt="tenant-b")
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.num_hash_collisions == 1
    c = colliding_request(mgr, "c", seq(0, 9), {0: a.block_hashes[0], 1: a.block_hashes[1]},
                          lora_name="x")
    assert mgr.get_computed_blocks(c) == ([], 0)
    assert mgr.num_hash_collisions == 2


@pytest.mark.parametrize("policy", ["lru", "unhashed-first"])
def test_guard_keeps_every_genuine_hit(policy):
    plain = make_manager(num_blocks=12, block_size=4, eviction_policy=policy)
    guarded = make_manager(num_blocks=12, block_size=4, eviction_policy=policy,
                           verify_cached_tokens=True)
    prompts = [seq(0, 13), seq(0, 10) + [77, 78], seq(0, 13) + [5], seq(0, 4), seq(0, 9)]

    def run(mgr: KVCacheManager) -> list:
        outcomes = []
        for i, prompt in enumerate(prompts):
            r = Request(str(i), prompt, cache_salt="s" if i == 4 else None)
            outcomes.append(schedule_prefill(mgr, r))
            if i % 2:
                mgr.free(r)
        return outcomes

    plain_outcomes, guarded_outcomes = run(plain), run(guarded)
    assert guarded_outcomes == plain_outcomes
    assert [hit for hit, _ in guarded_outcomes] == [0, 8, 12, 0, 0]
    assert guarded.num_hash_collisions == 0


def test_guard_picks_the_duplicate_that_holds_the_right_content():
    mgr = make_manager(num_blocks=10, block_size=4, verify_cached_tokens=True)
    a = Request("a", seq(0, 5))
    assert schedule_prefill(mgr, a) == (0, [0, 1])  # block 0 holds seq(0, 4) under h
    h = a.block_hashes[0]
    # w computes other content whose (weak) hash is also h: block 2 is filed under h too
    w = colliding_request(mgr, "w", seq(100, 5), {0: h}, skip_reading_prefix_cache=True)
    assert schedule_prefill(mgr, w) == (0, [2, 3])
    assert [b.block_id for b in mgr.block_pool.cached_block_hash_to_block.get_all_blocks(h)] \
        == [0, 2]
    c = colliding_request(mgr, "c", seq(100, 5), {0: h})
    blocks, num_hit_tokens = mgr.get_computed_blocks(c)
    assert [b.block_id for b in blocks] == [2]
    assert num_hit_tokens == 4
    d = Request("d", seq(0, 5))
    blocks, num_hit_tokens = mgr.get_computed_blocks(d)
    assert [b.block_id for b in blocks] == [0]


def test_guard_refuses_a_block_filed_under_a_foreign_hash():
    for guard, expected in ((False, 4), (True, 0)):
        mgr = make_manager(num_blocks=10, block_size=4, verify_cached_tokens=guard)
        a = Request("a", seq(0, 5))
        schedule_prefill(mgr, a)
        b = Request("b", seq(50, 5))
        mgr.get_computed_blocks(b)  # attaches b's real hashes; a miss
        # corrupt the map: block 0 (holding a's tokens) also answers to b's hash
        mgr.block_pool.cached_block_hash_to_block.insert(b.block_hashes[0],
                                                         mgr.block_pool.blocks[0])
        assert mgr.get_computed_blocks(b)[1] == expected


def test_failed_guard_lookup_changes_no_ref_counts():
    mgr = make_manager(num_blocks=10, block_size=4, verify_cached_tokens=True)
    a = Request("a", seq(0, 9))
    schedule_prefill(mgr, a)
    mgr.free(a)
    b = colliding_request(mgr, "b", seq(100, 9), {0: a.block_hashes[0]})
    before = snapshot(mgr, ["a", "b"])
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert snapshot(mgr, ["a", "b"]) == before
    assert ref_cnts(mgr, [0, 1]) == [0, 0]


def test_guard_forgets_evicted_content():
    """A block evicted and refilled is verified against its new content, not the old."""
    mgr = make_manager(num_blocks=2, block_size=4, verify_cached_tokens=True)
    a = Request("a", seq(0, 4))
    schedule_prefill(mgr, a)
    mgr.free(a)
    b = Request("b", seq(10, 8))
    assert schedule_prefill(mgr, b) == (0, [1, 0])  # block 0 evicted, refilled with b's
    mgr.free(b)
    assert mgr.get_computed_blocks(Request("b2", seq(10, 8) + [1]))[1] == 8
    assert mgr.get_computed_blocks(Request("a2", seq(0, 5)))[1] == 0
    assert mgr.num_hash_collisions == 0
