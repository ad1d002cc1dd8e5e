"""The design document's worked examples, reproduced step by step with the default config."""

from __future__ import annotations

import pytest

from prefixcache.core import KVCacheManager, Request
from tests.core.helpers import (
    blocks_under,
    cached_ids,
    free_ids,
    make_manager,
    ref_cnts,
    schedule_decode,
    schedule_prefill,
    seq,
)


def test_default_configuration_is_the_designs():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    assert mgr.enable_caching is True
    assert mgr.hash_algo == "sha256"
    assert mgr.block_pool.eviction_policy == "lru"
    assert free_ids(mgr) == list(range(10))


def test_ten_block_example_every_time_step():
    """The "Example" section: 10 blocks of 4 tokens, requests 0, 1 and 2."""
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    r0_tokens = seq(0, 15)

    # Time 1: 4 blocks, 3 full and cached, the fourth holds 3 of 4 tokens.
    r0 = Request("0", r0_tokens)
    assert schedule_prefill(mgr, r0) == (0, [0, 1, 2, 3])
    assert mgr.get_block_ids("0") == [0, 1, 2, 3]
    assert cached_ids(mgr) == [0, 1, 2]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9]
    assert ref_cnts(mgr, range(10)) == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    r0_block3_hash_expected = None

    # Time 2: request 0 fills block 3 (cached) and asks for a new block (block 4).
    assert schedule_decode(mgr, r0, 15) == []
    assert cached_ids(mgr) == [0, 1, 2, 3]
    r0_block3_hash_expected = r0.block_hashes[3]
    assert mgr.block_pool.blocks[3].block_hash == r0_block3_hash_expected
    assert schedule_decode(mgr, r0, 16) == [4]
    assert mgr.get_block_ids("0") == [0, 1, 2, 3, 4]
    assert cached_ids(mgr) == [0, 1, 2, 3]
    assert free_ids(mgr) == [5, 6, 7, 8, 9]

    # Time 3: request 1, 14 prompt tokens, the first 10 equal to request 0's: only the
    # first 2 blocks hit (the 3rd matches only 2 of 4 tokens).
    r1 = Request("1", r0_tokens[:10] + [100, 101, 102, 103])
    blocks, num_hit_tokens = mgr.get_computed_blocks(r1)
    assert [b.block_id for b in blocks] == [0, 1]
    assert num_hit_tokens == 8
    assert ref_cnts(mgr, [0, 1]) == [1, 1]  # a lookup changes nothing
    new = mgr.allocate_slots(r1, 6, num_new_computed_tokens=8, new_computed_blocks=blocks)
    assert [b.block_id for b in new] == [5, 6]
    r1.num_computed_tokens = 14
    assert mgr.get_block_ids("1") == [0, 1, 5, 6]
    assert ref_cnts(mgr, range(7)) == [2, 2, 1, 1, 1, 1, 1]
    assert cached_ids(mgr) == [0, 1, 2, 3, 5]
    assert free_ids(mgr) == [7, 8, 9]

    # Time 4: request 0 is freed: blocks 2, 3, 4 join the queue in reverse order; 0 and 1
    # stay with request 1; blocks 2 and 3 are still cached.
    mgr.free(r0)
    assert free_ids(mgr) == [7, 8, 9, 4, 3, 2]
    assert ref_cnts(mgr, range(7)) == [1, 1, 0, 0, 0, 1, 1]
    assert cached_ids(mgr) == [0, 1, 2, 3, 5]
    assert mgr.get_block_ids("0") == []

    # Time 5: request 1 is freed.
    mgr.free(r1)
    assert free_ids(mgr) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    assert ref_cnts(mgr, range(10)) == [0] * 10
    assert mgr.usage == 0.0

    # Time 6: request 2, 29 prompt tokens, the first 12 equal to request 0's. The hits
    # 0, 1, 2 are touched out of the queue first (7-8-9-4-3-6-5), then 5 blocks are popped:
    # 7, 8, 9, 4 and 3 (evicted).
    r2 = Request("2", r0_tokens[:12] + seq(200, 17))
    blocks, num_hit_tokens = mgr.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert num_hit_tokens == 12
    assert free_ids(mgr) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    new = mgr.allocate_slots(r2, 17, num_new_computed_tokens=12, new_computed_blocks=blocks)
    assert [b.block_id for b in new] == [7, 8, 9, 4, 3]
    assert mgr.get_block_ids("2") == [0, 1, 2, 7, 8, 9, 4, 3]
    assert free_ids(mgr) == [6, 5]
    # block 3 was evicted: request 0's block-3 hash is gone; it now holds 1 token, unhashed
    assert mgr.block_pool.get_cached_block(r0_block3_hash_expected) is None
    assert mgr.block_pool.blocks[3].block_hash is None
    # request 2's 7 full blocks are cached where they live, and request 1's block 5 survives
    assert cached_ids(mgr) == [0, 1, 2, 4, 5, 7, 8, 9]
    assert [mgr.block_pool.get_cached_block(h).block_id for h in r2.block_hashes] == \
        [0, 1, 2, 7, 8, 9, 4]
    assert mgr.block_pool.get_cached_block(r1.block_hashes[2]).block_id == 5
    assert mgr.usage == pytest.approx(0.8)


def test_ten_block_example_under_unhashed_first():
    """The same story under vLLM 0.33's order: partial tails are reused first, so the
    cached block 3 survives."""
    mgr = make_manager(num_blocks=10, eviction_policy="unhashed-first")
    r0_tokens = seq(0, 15)
    r0 = Request("0", r0_tokens)
    schedule_prefill(mgr, r0)
    schedule_decode(mgr, r0, 15)
    schedule_decode(mgr, r0, 16)
    r1 = Request("1", r0_tokens[:10] + [100, 101, 102, 103])
    assert schedule_prefill(mgr, r1) == (8, [5, 6])
    mgr.free(r0)
    assert free_ids(mgr) == [4, 7, 8, 9, 3, 2]
    mgr.free(r1)
    assert free_ids(mgr) == [6, 4, 7, 8, 9, 3, 2, 5, 1, 0]
    r2 = Request("2", r0_tokens[:12] + seq(200, 17))
    assert schedule_prefill(mgr, r2) == (12, [6, 4, 7, 8, 9])
    assert mgr.get_block_ids("2") == [0, 1, 2, 6, 4, 7, 8, 9]
    assert free_ids(mgr) == [3, 5]
    assert mgr.block_pool.get_cached_block(r0.block_hashes[3]) is mgr.block_pool.blocks[3]


def test_free_section_example_tail_receives_the_table_reversed():
    """"We free request 1 and block 2, 3, 4, 8 ... the tail receives 8, 4, 3, 2"."""
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    schedule_prefill(mgr, Request("a", seq(0, 8)))
    r1 = Request("1", seq(100, 12))
    assert schedule_prefill(mgr, r1) == (0, [2, 3, 4])
    schedule_prefill(mgr, Request("b", seq(200, 12)))
    assert schedule_decode(mgr, r1, 112) == [8]
    assert mgr.get_block_ids("1") == [2, 3, 4, 8]
    assert free_ids(mgr) == [9]
    mgr.free(r1)
    assert free_ids(mgr) == [9, 8, 4, 3, 2]


def _duplicated_blocks_story():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    A, B, C, D, E, F, G, H, I = range(1, 10)  # noqa: N806 - the design's token names
    prompt = [A, B, C, D, E, F]

    r1 = Request("1", prompt)
    assert schedule_prefill(mgr, r1) == (0, [0, 1])
    # Time 0: [A..G], table [0 (ABCD), 1 (EFG)], cached: 0
    assert schedule_decode(mgr, r1, G) == []
    assert mgr.get_block_ids("1") == [0, 1]
    assert cached_ids(mgr) == [0]
    # Time 1: [A..H], table [0, 1 (EFGH)], cached: 0, 1
    assert schedule_decode(mgr, r1, H) == []
    assert cached_ids(mgr) == [0, 1]
    # Time 2: [A..I], table [0, 1, 2 (I)], cached: 0, 1
    assert schedule_decode(mgr, r1, I) == [2]
    assert mgr.get_block_ids("1") == [0, 1, 2]
    assert cached_ids(mgr) == [0, 1]

    # Request 2: the same prompt, the same (greedy) outputs.
    r2 = Request("2", prompt)
    assert schedule_prefill(mgr, r2) == (4, [3])
    # Time 0: table [0 (ABCD), 3 (EFG)], cached: 0, 1
    assert schedule_decode(mgr, r2, G) == []
    assert mgr.get_block_ids("2") == [0, 3]
    assert cached_ids(mgr) == [0, 1]
    # Time 1: table [0, 3 (EFGH)], cached: 0, 1, 3 — block 3 duplicates block 1
    assert schedule_decode(mgr, r2, H) == []
    assert mgr.get_block_ids("2") == [0, 3]  # append-only: not rewritten to [0, 1]
    assert cached_ids(mgr) == [0, 1, 3]
    efgh = r1.block_hashes[1]
    assert r2.block_hashes[1] == efgh
    assert mgr.block_pool.blocks[1].block_hash == efgh
    assert mgr.block_pool.blocks[3].block_hash == efgh
    assert blocks_under(mgr, efgh) == [1, 3]
    assert ref_cnts(mgr, [0, 1, 2, 3]) == [2, 1, 1, 1]
    return mgr, r1, r2, efgh


def test_duplicated_blocks_example():
    _duplicated_blocks_story()


def test_duplicated_blocks_are_still_hit_while_duplicated():
    mgr, r1, r2, efgh = _duplicated_blocks_story()
    r3 = Request("3", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks, num_hit_tokens = mgr.get_computed_blocks(r3)
    assert num_hit_tokens == 8
    assert blocks[0].block_id == 0
    assert blocks[1].block_id in (1, 3)
    assert blocks[1].block_hash == efgh


def test_duplication_is_eliminated_when_the_request_is_freed():
    """"This duplication will be eliminated when the request is freed." Freeing request 2
    leaves hash E-H on one block only: block 1, which request 1 still uses."""
    mgr, r1, r2, efgh = _duplicated_blocks_story()
    mgr.free(r2)
    assert mgr.get_block_ids("2") == []
    assert blocks_under(mgr, efgh) == [1]
    assert mgr.block_pool.blocks[3].block_hash is None
    assert ref_cnts(mgr, [0, 1, 2, 3]) == [1, 1, 1, 0]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 3]
    # a third copy of the request still hits blocks 0 and 1
    r3 = Request("3", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks, num_hit_tokens = mgr.get_computed_blocks(r3)
    assert [b.block_id for b in blocks] == [0, 1]
    assert num_hit_tokens == 8


def test_duplication_is_gone_once_both_requests_are_freed():
    mgr, r1, r2, efgh = _duplicated_blocks_story()
    mgr.free(r1)
    mgr.free(r2)
    assert len(blocks_under(mgr, efgh)) == 1
    assert sum(b.block_hash == efgh for b in mgr.block_pool.blocks) == 1
    assert mgr.usage == 0.0
