"""KV events: BlockStored / BlockRemoved / AllBlocksCleared, with the per-hash semantics of
block_pool.py: a hash is stored when it becomes findable and removed when no block holds it."""

from __future__ import annotations

from prefixcache.core import AllBlocksCleared, BlockRemoved, BlockStored, Request
from tests.core.helpers import (
    free_ids,
    make_manager,
    schedule_decode,
    schedule_prefill,
    seq,
)


def test_fresh_allocation_emits_one_block_stored_for_all_full_blocks():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r = Request("r", seq(0, 10))
    schedule_prefill(mgr, r)
    events = mgr.take_events()
    assert events == [BlockStored(
        block_hashes=r.block_hashes[:2], parent_block_hash=None, token_ids=seq(0, 8),
        block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=None)]
    stored = events[0]
    assert len(stored.token_ids) == stored.block_size * len(stored.block_hashes)
    assert mgr.take_events() == []  # drained


def test_decode_filling_a_block_emits_it_with_its_parent():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r = Request("r", seq(0, 10))
    schedule_prefill(mgr, r)
    mgr.take_events()
    assert schedule_decode(mgr, r, 10) == []
    assert mgr.take_events() == []  # block 2 not full yet
    schedule_decode(mgr, r, 11)
    assert mgr.take_events() == [BlockStored(
        block_hashes=[r.block_hashes[2]], parent_block_hash=r.block_hashes[1],
        token_ids=[8, 9, 10, 11], block_size=4, lora_id=None, medium="GPU")]


def test_hit_then_new_blocks_store_only_the_new_ones():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    schedule_prefill(mgr, Request("a", seq(0, 9)))
    mgr.take_events()
    b = Request("b", seq(0, 8) + seq(100, 9))
    assert schedule_prefill(mgr, b) == (8, [3, 4, 5])
    assert mgr.take_events() == [BlockStored(
        block_hashes=b.block_hashes[2:4], parent_block_hash=b.block_hashes[1],
        token_ids=seq(100, 8), block_size=4)]


def test_eviction_emits_one_block_removed_per_allocation_then_block_stored():
    """vLLM emits one BlockRemoved per evicted block; we list every hash one allocation
    evicts in a single event, in eviction order (same meaning on the wire, far cheaper)."""
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r0 = Request("0", seq(0, 12))
    schedule_prefill(mgr, r0)
    mgr.free(r0)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    mgr.take_events()
    r1 = Request("1", seq(100, 40))
    schedule_prefill(mgr, r1)
    h0, h1, h2 = r0.block_hashes
    assert mgr.take_events() == [
        BlockRemoved(block_hashes=[h2, h1, h0], medium="GPU"),
        BlockStored(block_hashes=r1.block_hashes, parent_block_hash=None,
                    token_ids=seq(100, 40), block_size=4),
    ]


def test_reset_emits_all_blocks_cleared():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r = Request("r", seq(0, 8))
    schedule_prefill(mgr, r)
    mgr.take_events()
    assert mgr.reset_prefix_cache() is False
    assert mgr.take_events() == []
    mgr.free(r)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]


def test_no_events_when_disabled():
    mgr = make_manager(num_blocks=4, block_size=4)
    r0 = Request("0", seq(0, 12))
    schedule_prefill(mgr, r0)
    mgr.free(r0)
    schedule_prefill(mgr, Request("1", seq(100, 16)))  # evicts
    mgr.free(Request("1", [0]))
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == []


def test_no_events_when_caching_disabled():
    mgr = make_manager(num_blocks=4, block_size=4, enable_caching=False, enable_events=True)
    r0 = Request("0", seq(0, 12))
    schedule_prefill(mgr, r0)
    mgr.free(r0)
    assert mgr.take_events() == []


def test_lora_fields():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    lora = Request("l", seq(0, 8), lora_name="sql", lora_path="/sql", lora_id=7)
    schedule_prefill(mgr, lora)
    key = ("lora", "sql", "/sql")
    assert mgr.take_events() == [BlockStored(
        block_hashes=lora.block_hashes, parent_block_hash=None, token_ids=seq(0, 8),
        block_size=4, lora_id=7, medium="GPU", lora_name="sql", extra_keys=[(key,), (key,)])]
    plain = Request("p", seq(0, 8))
    schedule_prefill(mgr, plain)
    (stored,) = mgr.take_events()
    assert stored.lora_id is None and stored.lora_name is None


def test_extra_keys_per_stored_block():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r = Request("r", seq(0, 12), cache_salt="t")
    schedule_prefill(mgr, r)
    (stored,) = mgr.take_events()
    assert stored.extra_keys == [(("cache_salt", "t"),), None, None]


# -- per-hash semantics for duplicates (block_pool.py's docstring) ------------------------

def test_duplicate_blocks_emit_no_second_block_stored():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r0 = Request("0", seq(0, 9))
    schedule_prefill(mgr, r0)
    mgr.take_events()
    dup = Request("dup", seq(0, 9), skip_reading_prefix_cache=True)
    assert schedule_prefill(mgr, dup) == (0, [3, 4, 5])
    assert mgr.take_events() == []


def test_duplicates_then_a_new_hash_store_only_the_new_hash():
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    schedule_prefill(mgr, Request("0", seq(0, 9)))
    mgr.take_events()
    r = Request("r", seq(0, 8) + seq(50, 5), skip_reading_prefix_cache=True)
    assert schedule_prefill(mgr, r) == (0, [3, 4, 5, 6])
    assert mgr.take_events() == [BlockStored(
        block_hashes=[r.block_hashes[2]], parent_block_hash=r.block_hashes[1],
        token_ids=seq(50, 4), block_size=4)]


def test_evicting_a_duplicate_emits_no_block_removed():
    mgr = make_manager(num_blocks=12, block_size=4, enable_events=True)
    r0 = Request("0", seq(0, 12) + [1])
    schedule_prefill(mgr, r0)  # blocks 0..3
    h2 = r0.block_hashes[2]
    mgr.take_events()
    # a skip-reading writer of the same prompt duplicates 0, 1, 2: nothing new is stored
    w = Request("w", seq(0, 12) + [1], skip_reading_prefix_cache=True)
    assert schedule_prefill(mgr, w) == (0, [4, 5, 6, 7])
    assert mgr.take_events() == []
    mgr.free(r0)
    filler = Request("f", seq(500, 16))
    assert schedule_prefill(mgr, filler)[1] == [8, 9, 10, 11]
    assert [type(e) for e in mgr.take_events()] == [BlockStored]
    assert free_ids(mgr) == [3, 2, 1, 0]
    # taking blocks 3 (unhashed) and 2 (same hash as w's block 6): nothing is removed
    schedule_prefill(mgr, Request("t", seq(900, 8)))
    assert not any(isinstance(e, BlockRemoved) for e in mgr.take_events())
    assert mgr.block_pool.get_cached_block(h2) is mgr.block_pool.blocks[6]


def test_last_holder_evicted_emits_block_removed():
    mgr = make_manager(num_blocks=6, block_size=4, enable_events=True)
    a = Request("a", seq(0, 4))
    schedule_prefill(mgr, a)  # block 0
    h = a.block_hashes[0]
    mgr.free(a)
    assert free_ids(mgr) == [1, 2, 3, 4, 5, 0]
    b = Request("b", seq(0, 4), skip_reading_prefix_cache=True)
    assert schedule_prefill(mgr, b) == (0, [1])  # same hash as the free block 0
    assert [type(e) for e in mgr.take_events()] == [BlockStored]
    x = Request("x", seq(100, 20))
    assert schedule_prefill(mgr, x) == (0, [2, 3, 4, 5, 0])  # evicts block 0
    events = mgr.take_events()
    assert not any(isinstance(e, BlockRemoved) for e in events)  # block 1 still holds h
    assert mgr.block_pool.get_cached_block(h) is mgr.block_pool.blocks[1]
    mgr.free(b)
    assert schedule_prefill(mgr, Request("y", seq(200, 4))) == (0, [1])
    assert mgr.take_events()[0] == BlockRemoved(block_hashes=[h], medium="GPU")
    assert mgr.block_pool.get_cached_block(h) is None


def test_router_index_built_from_events_matches_the_cache():
    """Replaying the events into a set of hashes gives exactly the cached hashes."""
    mgr = make_manager(num_blocks=6, block_size=4, enable_events=True)
    index: set[bytes] = set()

    def replay():
        for event in mgr.take_events():
            if isinstance(event, BlockStored):
                index.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    index.remove(h)
            else:
                index.clear()
        assert index == set(mgr.block_pool.cached_block_hash_to_block.keys())

    reqs = [
        Request("a", seq(0, 9)),
        Request("b", seq(0, 9), skip_reading_prefix_cache=True),
        Request("c", seq(0, 4) + seq(40, 6)),
    ]
    for r in reqs[:2]:
        schedule_prefill(mgr, r)
        replay()
    mgr.free(reqs[0])
    replay()
    schedule_prefill(mgr, reqs[2])
    replay()
    mgr.free(reqs[1])
    mgr.free(reqs[2])
    schedule_prefill(mgr, Request("d", seq(300, 24)))
    replay()
    mgr.free(Request("d", [0]))
    assert mgr.reset_prefix_cache()
    replay()
    assert index == set()


def test_uncaching_a_failed_steps_blocks_removes_only_those_past_what_was_written():
    """A prefill chunk of 6 tokens after 6 computed ones fails: blocks 1 (half written
    before) and 2 were cached when scheduled and are dropped; block 0, written before, is
    kept; a later lookup hits block 0 only. Not counted as evictions."""
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    r = Request("r", seq(0, 13))
    schedule_prefill(mgr, r, num_tokens=6)
    mgr.take_events()
    assert mgr.allocate_slots(r, 6) is not None  # the failed step: tokens 6..11
    r.num_computed_tokens += 6
    assert mgr.take_events()[0].block_hashes == r.block_hashes[1:3]
    mgr.uncache_uncomputed(r, 6)
    assert mgr.take_events() == [BlockRemoved(block_hashes=r.block_hashes[1:3], medium="GPU")]
    mgr.free(r)
    blocks, num_hit_tokens = mgr.get_computed_blocks(Request("again", seq(0, 13)))
    assert num_hit_tokens == 4
    assert mgr.block_pool.num_evictions == 0
    assert set(mgr.block_pool.cached_block_hash_to_block.keys()) == {r.block_hashes[0]}


def test_uncaching_keeps_a_duplicate_that_was_written():
    """The hash of a failed block is still held by an earlier, written copy: no event, and
    the written copy stays findable."""
    mgr = make_manager(num_blocks=10, block_size=4, enable_events=True)
    first = Request("first", seq(0, 9))
    schedule_prefill(mgr, first)
    second = Request("second", seq(0, 9), skip_reading_prefix_cache=True)  # recomputes
    schedule_prefill(mgr, second)
    mgr.take_events()
    mgr.uncache_uncomputed(second, 0)
    assert mgr.take_events() == []
    mgr.free(second)
    mgr.free(first)
    assert mgr.get_computed_blocks(Request("again", seq(0, 9)))[1] == 8
