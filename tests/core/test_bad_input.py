"""Bad input gets a clear error (or a documented no-op / None), never a corrupted pool."""

from __future__ import annotations

import sys

import pytest

from prefixcache.core import KVCacheManager, MultiModalFeature, Request
from tests.core.helpers import (
    free_ids,
    make_manager,
    ref_cnts,
    schedule_decode,
    schedule_prefill,
    seq,
    snapshot,
)


def test_unknown_hash_algorithm():
    with pytest.raises(ValueError, match="sha256"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="md5")


def test_unknown_hash_algorithm_even_with_caching_disabled():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="md5", enable_caching=False)


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_block_size_below_one(block_size):
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=block_size)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_block_count_below_one(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=num_blocks, block_size=4)


@pytest.mark.parametrize("value", [4.0, "4", None, 2.5])
def test_non_integer_sizes(value):
    with pytest.raises((ValueError, TypeError)):
        KVCacheManager(num_blocks=value, block_size=4)
    with pytest.raises((ValueError, TypeError)):
        KVCacheManager(num_blocks=4, block_size=value)


def test_negative_num_new_tokens_changes_nothing():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 6))
    schedule_prefill(mgr, r)
    before = snapshot(mgr, ["r"])
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, -1)
    assert snapshot(mgr, ["r"]) == before
    fresh = Request("fresh", seq(0, 6))
    with pytest.raises(ValueError):
        mgr.allocate_slots(fresh, -3)
    assert snapshot(mgr, ["r"]) == before
    assert mgr.get_block_ids("fresh") == []


def test_negative_computed_or_lookahead_tokens():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 6))
    before = snapshot(mgr, ["r"])
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 6, num_new_computed_tokens=-4)
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 6, num_lookahead_tokens=-1)
    assert snapshot(mgr, ["r"]) == before


def test_freeing_an_unknown_request_is_a_no_op():
    mgr = make_manager(num_blocks=10, block_size=4)
    held = Request("held", seq(0, 9))
    schedule_prefill(mgr, held)
    before = snapshot(mgr, ["held", "ghost"])
    mgr.free(Request("ghost", [1, 2, 3]))
    assert snapshot(mgr, ["held", "ghost"]) == before
    mgr.free(held)
    mgr.free(held)  # already freed: no-op, ref counts never go negative
    assert ref_cnts(mgr, range(10)) == [0] * 10
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


@pytest.mark.parametrize("policy", ["lru", "unhashed-first"])
@pytest.mark.parametrize("caching", [True, False])
def test_prompt_longer_than_the_pool_returns_none_and_changes_nothing(policy, caching):
    mgr = make_manager(num_blocks=4, block_size=4, eviction_policy=policy,
                       enable_caching=caching)
    warm = Request("warm", seq(0, 6))
    schedule_prefill(mgr, warm)
    mgr.free(warm)
    before = snapshot(mgr, ["warm", "huge"])
    huge = Request("huge", seq(0, 17))
    assert schedule_prefill(mgr, huge) == (4 if caching else 0, None)
    assert snapshot(mgr, ["warm", "huge"]) == before
    assert mgr.get_block_ids("huge") == []
    # the pool still works: exactly the whole pool fits
    assert schedule_prefill(mgr, Request("full", seq(500, 16)))[1] is not None
    assert mgr.num_free_blocks == 0


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        Request("r", [])


def test_bad_mm_feature_and_salt():
    with pytest.raises(ValueError):
        MultiModalFeature("img", -2, 3)
    with pytest.raises(ValueError):
        MultiModalFeature("img", 0, 0)
    with pytest.raises(TypeError):
        Request("r", [1], cache_salt=b"bytes")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_missing(algo, monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ImportError, match="xxhash"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo=algo, hash_seed="s")
    # the default algorithm is unaffected
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert schedule_prefill(mgr, Request("r", seq(0, 5))) == (0, [0, 1])


def test_request_bound_to_another_manager_is_rejected():
    a = make_manager(num_blocks=4, block_size=4)
    b = make_manager(num_blocks=4, block_size=8)
    r = Request("r", seq(0, 9))
    a.get_computed_blocks(r)
    with pytest.raises(ValueError):
        b.get_computed_blocks(r)


@pytest.mark.parametrize("bad_token", [1.5, "x", 2**64])
def test_unhashable_tokens_fail_before_anything_changes(bad_token):
    mgr = make_manager(num_blocks=10, block_size=4)
    held = Request("held", seq(0, 6))
    schedule_prefill(mgr, held)
    before = snapshot(mgr, ["held", "bad"])
    bad = Request("bad", [1, 2, bad_token, 4, 5, 6])
    with pytest.raises(ValueError, match="integers"):
        mgr.get_computed_blocks(bad)
    assert bad.block_hasher is None and bad.block_hashes == []
    # allocating it anyway fails the same way, before any block is taken
    with pytest.raises(ValueError, match="integers"):
        mgr.allocate_slots(bad, bad.num_tokens)
    assert snapshot(mgr, ["held", "bad"]) == before
    assert mgr.make_prefix_cache_stats().requests == 1  # only "held" was admitted
    assert schedule_prefill(mgr, Request("good", seq(0, 6))) == (4, [2])


def test_hit_blocks_for_a_request_that_already_holds_blocks_are_refused():
    mgr = make_manager(num_blocks=10, block_size=4)
    first = Request("first", seq(0, 9))
    schedule_prefill(mgr, first)
    again = Request("again", seq(0, 9))
    schedule_prefill(mgr, again)
    blocks, num_hit_tokens = mgr.get_computed_blocks(again)
    assert num_hit_tokens == 8
    before = snapshot(mgr, ["first", "again"])
    with pytest.raises(ValueError, match="already holds blocks"):
        mgr.allocate_slots(again, 0, num_hit_tokens, blocks)
    assert snapshot(mgr, ["first", "again"]) == before
    assert mgr.get_block_ids("again") == [0, 1, 3]


def test_hit_token_count_must_match_the_hit_blocks():
    mgr = make_manager(num_blocks=10, block_size=4)
    schedule_prefill(mgr, Request("first", seq(0, 9)))
    r = Request("r", seq(0, 9))
    blocks, num_hit_tokens = mgr.get_computed_blocks(r)
    before = snapshot(mgr, ["first", "r"])
    for tokens, hit_blocks in ((0, blocks), (num_hit_tokens - 1, blocks), (4, blocks[:2]),
                               (num_hit_tokens, None)):
        with pytest.raises(ValueError, match="num_new_computed_tokens"):
            mgr.allocate_slots(r, 1, tokens, hit_blocks)
        assert snapshot(mgr, ["first", "r"]) == before
    assert mgr.allocate_slots(r, 1, num_hit_tokens, blocks) is not None


def test_unhashable_output_tokens_are_taken_back_and_change_no_block():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 3))
    schedule_prefill(mgr, r)
    before = snapshot(mgr, ["r"])
    with pytest.raises(ValueError, match="integers"):
        r.append_output_token_ids([4.5, 6, 7])  # completes block 0 with a float in it
    assert r.all_token_ids == seq(0, 3) and r.block_hashes == []
    assert snapshot(mgr, ["r"]) == before
    # the request carries on as if the bad call never happened
    assert schedule_decode(mgr, r, [3, 4]) == [1]
    assert mgr.block_pool.blocks[0].block_hash == r.block_hashes[0]


def test_tokens_appended_behind_the_hashers_back_are_refused_before_allocating():
    mgr = make_manager(num_blocks=10, block_size=4)
    r = Request("r", seq(0, 3))
    schedule_prefill(mgr, r)
    r.all_token_ids.extend([3, 4])  # not through append_output_token_ids: block 0 unhashed
    before = snapshot(mgr, ["r"])
    with pytest.raises(ValueError, match="append_output_token_ids"):
        mgr.allocate_slots(r, 2)
    assert snapshot(mgr, ["r"]) == before
