"""BlockHashToBlockMap and BlockPool mechanism: lookup, touch, new blocks, eviction, caching."""

from __future__ import annotations

import pytest

from prefixcache.core import (
    BlockHasher,
    BlockHashToBlockMap,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheBlock,
    Request,
)
from tests.core.helpers import seq

H1 = b"\x01" * 32
H2 = b"\x02" * 32


# -- BlockHashToBlockMap -----------------------------------------------------------------

def test_map_single_block_insert_get_pop():
    cache = BlockHashToBlockMap()
    b0 = KVCacheBlock(0)
    assert len(cache) == 0
    assert cache.get_one_block(H1) is None
    assert cache.get_all_blocks(H1) == []
    assert cache.insert(H1, b0) is True
    assert len(cache) == 1
    assert H1 in cache and H2 not in cache
    assert cache.get_one_block(H1) is b0
    assert cache.get_all_blocks(H1) == [b0]
    # pop with the wrong id or an unknown hash: no-op
    assert cache.pop(H1, 1) is None
    assert cache.pop(H2, 0) is None
    assert cache.get_one_block(H1) is b0
    assert len(cache) == 1
    assert cache.pop(H1, 0) is b0
    assert len(cache) == 0
    assert H1 not in cache
    assert cache.get_one_block(H1) is None
    assert cache.pop(H1, 0) is None


def test_map_duplicates_in_insertion_order():
    cache = BlockHashToBlockMap()
    b0, b1, b2 = KVCacheBlock(0), KVCacheBlock(1), KVCacheBlock(2)
    assert cache.insert(H1, b1) is True
    assert cache.insert(H1, b0) is False
    assert cache.insert(H1, b2) is False
    assert len(cache) == 1
    assert cache.get_all_blocks(H1) == [b1, b0, b2]
    assert cache.get_one_block(H1) is b1
    assert cache.pop(H1, 7) is None  # wrong id: no-op
    assert cache.get_all_blocks(H1) == [b1, b0, b2]
    assert cache.pop(H1, 1) is b1
    assert cache.get_one_block(H1) is b0
    assert cache.get_all_blocks(H1) == [b0, b2]
    assert cache.pop(H1, 2) is b2
    assert cache.get_all_blocks(H1) == [b0]
    assert cache.get_one_block(H1) is b0
    assert cache.pop(H1, 0) is b0
    assert H1 not in cache
    assert len(cache) == 0


def test_map_two_keys_and_clear():
    cache = BlockHashToBlockMap()
    b0, b1 = KVCacheBlock(0), KVCacheBlock(1)
    cache.insert(H1, b0)
    cache.insert(H2, b1)
    assert sorted(cache.keys()) == [H1, H2]
    cache.pop(H1, 0)
    assert list(cache.keys()) == [H2]
    cache.insert(H1, b0)
    cache.clear()
    assert len(cache) == 0
    assert cache.get_one_block(H2) is None


# -- BlockPool ---------------------------------------------------------------------------

def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def hashed_request(request_id: str, tokens: list[int], block_size: int = 4) -> Request:
    return Request(request_id, tokens, block_hasher=BlockHasher(block_size, "sha256", "s"))


def test_pool_creates_every_block_once():
    pool = BlockPool(5)
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4]
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    assert len(pool.cached_block_hash_to_block) == 0
    first = pool.blocks[0]
    pool.free_blocks(pool.get_new_blocks(5))
    assert pool.blocks[0] is first


def test_get_new_blocks_pops_the_head_with_ref_one():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_ids(pool) == [2, 3, 4]
    assert pool.get_usage() == pytest.approx(0.4)
    assert pool.get_new_blocks(0) == []
    assert free_ids(pool) == [2, 3, 4]


def test_get_new_blocks_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0]


def test_get_new_blocks_rejects_a_negative_count_and_changes_nothing():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="negative"):
        pool.get_new_blocks(-1)
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 3
    assert free_ids(pool) == [0, 1, 2]


def test_freeing_a_block_that_is_already_free_is_an_error_not_a_negative_count():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.touch([blocks[0]])  # block 0: ref 2
    pool.free_blocks([blocks[2]])
    with pytest.raises(ValueError, match="block 2 is already free"):
        pool.free_blocks([blocks[1], blocks[0], blocks[2], blocks[1]])
    # The blocks before it were freed as asked, so the pool stays consistent.
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0, 0]
    assert free_ids(pool) == [3, 2, 1]
    with pytest.raises(ValueError, match="block 1 is already free"):
        pool.free_blocks([blocks[1]])
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0, 0]
    assert free_ids(pool) == [3, 2, 1]


def test_touch_takes_free_blocks_out_of_the_queue():
    pool = BlockPool(4)
    held = pool.get_new_blocks(1)[0]  # block 0, ref 1
    pool.touch([pool.blocks[2], held])
    assert pool.blocks[2].ref_cnt == 1
    assert held.ref_cnt == 2
    assert free_ids(pool) == [1, 3]
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 2
    assert free_ids(pool) == [1, 3]


def test_free_blocks_releases_only_at_zero_in_the_given_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.touch([blocks[1]])
    pool.free_blocks([blocks[3], blocks[2], blocks[1], blocks[0]])
    assert [b.ref_cnt for b in blocks] == [0, 1, 0, 0]
    assert free_ids(pool) == [4, 3, 2, 0]
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [4, 3, 2, 0, 1]
    assert pool.get_usage() == 0.0


def test_cache_full_blocks_then_continue_from_num_cached_blocks():
    pool = BlockPool(6)
    req = hashed_request("r", seq(0, 14))  # three full blocks, one partial
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 2, 4)
    assert [b.block_hash for b in blocks] == [req.block_hashes[0], req.block_hashes[1],
                                              None, None]
    assert len(pool.cached_block_hash_to_block) == 2
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    pool.cache_full_blocks(req, blocks, 2, 3, 4)
    assert blocks[2].block_hash == req.block_hashes[2]
    assert blocks[3].block_hash is None
    assert len(pool.cached_block_hash_to_block) == 3
    assert [pool.get_cached_block(h) for h in req.block_hashes] == blocks[:3]


def test_evicting_one_duplicate_keeps_the_other_then_the_last_removes_the_key():
    pool = BlockPool(3, enable_events=True)
    a = hashed_request("a", seq(0, 4))
    b = hashed_request("b", seq(0, 4))
    h = a.block_hashes[0]
    assert b.block_hashes == [h]
    blocks_a = pool.get_new_blocks(1)  # block 0
    blocks_b = pool.get_new_blocks(1)  # block 1
    pool.cache_full_blocks(a, blocks_a, 0, 1, 4)
    pool.cache_full_blocks(b, blocks_b, 0, 1, 4)
    assert [x.block_id for x in pool.cached_block_hash_to_block.get_all_blocks(h)] == [0, 1]
    # one BlockStored: the hash became findable once
    events = pool.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].block_hashes == [h]
    pool.free_blocks(blocks_a)
    pool.free_blocks(blocks_b)
    assert free_ids(pool) == [2, 0, 1]
    assert [x.block_id for x in pool.get_new_blocks(1)] == [2]
    # evict block 0: block 1 still holds the hash, so no BlockRemoved
    assert [x.block_id for x in pool.get_new_blocks(1)] == [0]
    assert pool.blocks[0].block_hash is None
    assert pool.get_cached_block(h) is pool.blocks[1]
    assert [x.block_id for x in pool.cached_block_hash_to_block.get_all_blocks(h)] == [1]
    assert pool.take_events() == []
    # evict block 1: the key goes, one BlockRemoved
    assert [x.block_id for x in pool.get_new_blocks(1)] == [1]
    assert pool.get_cached_block(h) is None
    assert h not in pool.cached_block_hash_to_block
    assert pool.take_events() == [BlockRemoved(block_hashes=[h], medium="GPU")]


def test_eviction_clears_hash_and_map_entry():
    pool = BlockPool(2)
    req = hashed_request("r", seq(0, 4))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1, 4)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [1, 0]
    assert pool.get_cached_block(req.block_hashes[0]) is pool.blocks[0]
    pool.get_new_blocks(2)
    assert pool.blocks[0].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert len(pool.cached_block_hash_to_block) == 0


def test_pool_reset_prefix_cache():
    pool = BlockPool(3, enable_events=True)
    req = hashed_request("r", seq(0, 8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert len(pool.take_events()) == 1


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0, "3", None])
def test_pool_rejects_bad_sizes(num_blocks):
    with pytest.raises((ValueError, TypeError)):
        BlockPool(num_blocks)


def test_pool_rejects_unknown_eviction_policy():
    with pytest.raises(ValueError, match="lru"):
        BlockPool(3, eviction_policy="fifo")


def test_map_lookup_prefers_a_block_in_use_among_duplicates():
    cache = BlockHashToBlockMap()
    b0, b1, b2 = KVCacheBlock(0), KVCacheBlock(1), KVCacheBlock(2)
    for block in (b0, b1, b2):
        cache.insert(H1, block)
    assert cache.get_one_block(H1) is b0  # none in use: the earliest inserted
    b2.ref_cnt = 1
    assert cache.get_one_block(H1) is b2
    assert cache.get_longest_cached_prefix([H1], 1) == [b2]
    b1.ref_cnt = 1
    assert cache.get_one_block(H1) is b1  # the earliest inserted of those in use
    assert BlockHashToBlockMap.pick_block_to_share([b0, b2]) is b2
    assert BlockHashToBlockMap.pick_block_to_share([b0]) is b0
    assert BlockHashToBlockMap.pick_block_to_share([]) is None


def test_map_longest_cached_prefix_stops_at_the_first_miss_or_the_limit():
    cache = BlockHashToBlockMap()
    b0, b1 = KVCacheBlock(0), KVCacheBlock(1)
    cache.insert(H1, b0)
    cache.insert(H2, b1)
    H3 = b"\x03" * 32
    assert cache.get_longest_cached_prefix([H1, H2, H3], 3) == [b0, b1]
    assert cache.get_longest_cached_prefix([H1, H3, H2], 3) == [b0]
    assert cache.get_longest_cached_prefix([H1, H2], 1) == [b0]
    assert cache.get_longest_cached_prefix([H1, H2], 5) == [b0, b1]
    assert cache.get_longest_cached_prefix([H3, H1], 2) == []
