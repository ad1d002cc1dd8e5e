"""The 2q policy and the Belady free queue keep the core's invariants; the default is
untouched; learned-reuse gets what it needs from a replay and uses it."""

from __future__ import annotations

import random

import pytest

from prefixcache.core import EVICTION_POLICIES, KVCacheBlock, KVCacheManager, Request
from prefixcache.core.eviction import LRUFreeBlockQueue, TwoQueueFreeBlockQueue
from prefixcache.sim.belady import BeladyFreeBlockQueue, FutureUses
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from prefixcache.sim.trace import Trace, TraceRequest
from tests.sim.reference_belady import PerBlockBeladyQueue


def free_ids(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def check_invariants(mgr: KVCacheManager) -> None:
    pool = mgr.block_pool
    queue = pool.free_block_queue
    free = queue.get_all_free_blocks()
    free_set = {b.block_id for b in free}
    assert len(free) == len(free_set) == queue.num_free_blocks
    for block in pool.blocks:
        assert (block.block_id in free_set) == (block.ref_cnt == 0), block
        assert block.ref_cnt >= 0
        if block.block_hash is not None:
            assert block in pool.cached_block_hash_to_block.get_all_blocks(block.block_hash)
    held = {}
    for blocks in mgr.req_to_blocks.values():
        for block in blocks:
            held[block.block_id] = held.get(block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0)


def random_workload(mgr: KVCacheManager, seed: int, steps: int = 250,
                    on_admit=None) -> None:
    """Requests over a few shared prefixes, random lengths, decode steps and frees."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    live: list[Request] = []
    for step in range(steps):
        if live and (rng.random() < 0.4 or len(live) > 4):
            mgr.free(live.pop(rng.randrange(len(live))))
        elif live and rng.random() < 0.3:
            request = rng.choice(live)
            request.append_output_token_ids(rng.randrange(50))
            num_new = request.num_tokens - request.num_computed_tokens
            if mgr.allocate_slots(request, num_new) is not None:
                request.num_computed_tokens += num_new
        else:
            prompt = rng.choice(prefixes)[:rng.randint(1, 20)] + \
                [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            request = Request(f"r{step}", prompt or [1])
            if on_admit is not None:
                on_admit(step)
            blocks, num_hit_tokens = mgr.get_computed_blocks(request)
            new = mgr.allocate_slots(request, request.num_tokens - num_hit_tokens,
                                     num_hit_tokens, blocks)
            if new is not None:
                request.num_computed_tokens = request.num_tokens
                live.append(request)
        check_invariants(mgr)
    for request in live:
        mgr.free(request)
    check_invariants(mgr)
    assert mgr.num_free_blocks == mgr.num_blocks  # nothing leaked


def test_2q_is_registered_and_lru_stays_the_default():
    assert EVICTION_POLICIES["2q"] is TwoQueueFreeBlockQueue
    assert type(KVCacheManager(10, 4).block_pool.free_block_queue) is LRUFreeBlockQueue


@pytest.mark.parametrize("seed", range(8))
def test_2q_keeps_the_core_invariants(seed):
    random_workload(KVCacheManager(12, 4, eviction_policy="2q"), seed)


@pytest.mark.parametrize("seed", range(4))
def test_belady_queue_keeps_the_core_invariants(seed):
    # Any oracle must leave the invariants intact; a made-up one exercises re-keying.
    future = FutureUses([], [])
    mgr = KVCacheManager(12, 4)
    queue = BeladyFreeBlockQueue(mgr.block_pool.blocks, future)
    mgr.block_pool.free_block_queue = queue

    def on_admit(step):
        queue.now = step

    random_workload(mgr, seed, on_admit=on_admit)


def test_belady_queue_refuses_a_negative_count_and_changes_nothing():
    mgr = KVCacheManager(4, 4)
    queue = BeladyFreeBlockQueue(mgr.block_pool.blocks, FutureUses([], []))
    with pytest.raises(ValueError, match="negative"):
        queue.popleft_n(-1)
    assert queue.num_free_blocks == 4
    assert queue.popleft_n(0) == []
    assert len(queue.popleft_n(4)) == 4


def _design_example(mgr: KVCacheManager) -> list[list[int]]:
    """The design's ten-block example (time 1 to 6); the allocated block ids per step."""
    tokens = list(range(15))
    steps = []
    r0 = Request("0", tokens)
    steps.append([b.block_id for b in mgr.allocate_slots(r0, 15)])
    r0.num_computed_tokens = 15
    r0.append_output_token_ids(15)
    steps.append([b.block_id for b in mgr.allocate_slots(r0, 1)])
    r0.num_computed_tokens = 16
    r0.append_output_token_ids(16)
    steps.append([b.block_id for b in mgr.allocate_slots(r0, 1)])
    r0.num_computed_tokens = 17
    r1 = Request("1", tokens[:10] + [100, 101, 102, 103])
    hit, num_hit = mgr.get_computed_blocks(r1)
    steps.append([b.block_id for b in hit] + [b.block_id for b in mgr.allocate_slots(
        r1, 14 - num_hit, num_hit, hit)])
    mgr.free(r0)
    mgr.free(r1)
    r2 = Request("2", tokens[:12] + list(range(200, 217)))
    hit, num_hit = mgr.get_computed_blocks(r2)
    steps.append([b.block_id for b in hit] + [b.block_id for b in mgr.allocate_slots(
        r2, 29 - num_hit, num_hit, hit)])
    return steps


def test_worked_example_unchanged_by_default_and_with_2q_registered():
    steps = _design_example(KVCacheManager(10, 4))
    # Time 6 of the design: hits 0, 1, 2, then 7, 8, 9, 4, 3 (evicted) from the queue.
    assert steps == [[0, 1, 2, 3], [], [4], [0, 1, 5, 6], [0, 1, 2, 7, 8, 9, 4, 3]]
    # 2q serves the same hits in the example; only the choice of new blocks may differ.
    with_2q = _design_example(KVCacheManager(10, 4, eviction_policy="2q"))
    assert [s[:3] for s in with_2q] == [s[:3] for s in steps]


def test_2q_protects_reused_content_and_puts_empty_blocks_first():
    queue = TwoQueueFreeBlockQueue([KVCacheBlock(i) for i in range(6)])
    taken = queue.popleft_n(4)
    for block, h in zip(taken, [b"a", b"b", b"c", None], strict=True):
        block.block_hash = h
    queue.release(list(reversed(taken)))  # block 3 holds nothing
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3, 4, 5, 2, 1, 0]
    queue.remove(taken[0])  # a hit on a free block: its content is reused
    taken[0].ref_cnt = 1
    queue.release([taken[0]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3, 4, 5, 2, 1, 0]
    assert queue.in_upper[0] == 1 and queue.upper.num_free_blocks == 1
    # Taking blocks drains probation before protected.
    assert [b.block_id for b in queue.popleft_n(5)] == [3, 4, 5, 2, 1]
    assert queue.num_free_blocks == 1


def test_2q_ghost_protects_content_recomputed_after_eviction():
    mgr = KVCacheManager(4, 4, eviction_policy="2q")
    doc = list(range(8))
    for i, prompt in enumerate([doc + [90], list(range(50, 58)) + [91], doc + [92]]):
        request = Request(str(i), prompt)
        hit, num_hit = mgr.get_computed_blocks(request)
        assert mgr.allocate_slots(request, 9 - num_hit, num_hit, hit) is not None
        mgr.free(request)
    queue = mgr.block_pool.free_block_queue
    # The third request recomputed the evicted document: it comes back protected.
    protected = {b.block_hash for b in queue.upper.get_all_free_blocks()}
    assert protected == set(Request("x", doc, block_hasher=mgr.block_hasher).block_hashes)


def test_2q_demotes_beyond_its_protected_share():
    queue = TwoQueueFreeBlockQueue([KVCacheBlock(i) for i in range(10)])
    assert queue.max_protected == 9
    taken = queue.popleft_n(10)
    for block in taken:
        block.block_hash = bytes([block.block_id])
        queue.is_reused[block.block_id] = 1
    queue.release(taken)
    assert queue.upper.num_free_blocks == 9 and queue.num_lower == 1
    assert [b.block_id for b in queue.get_all_free_blocks()] == list(range(10))


def _documents_and_one_offs(num_rounds: int = 40) -> Trace:
    """Each round: a new document (4 blocks) asked with a short answer, two one-off prompts
    with long generations, and a second question on the document of two rounds before."""
    requests, next_id = [], 0
    documents = []

    def add(hash_ids, output_length):
        requests.append(TraceRequest(len(requests) + 1, 512 * len(hash_ids) - 100,
                                     output_length, None, hash_ids=tuple(hash_ids)))

    for k in range(num_rounds):
        documents.append(list(range(next_id, next_id + 4)))
        next_id += 4
        add(documents[k], 8)
        for _ in range(2):
            add(list(range(next_id, next_id + 4)), 400)
            next_id += 4
        if k >= 2:
            add(documents[k - 2], 8)
    return Trace("documents", requests)


def test_replay_frees_requests_that_report_their_output_length(monkeypatch):
    seen = []

    class RecordingQueue(LRUFreeBlockQueue):
        policy_name = "recording-test"

        def release(self, blocks, request=None):
            seen.append((request.request_id, request.num_output_tokens))
            super().release(blocks, request)

    monkeypatch.setitem(EVICTION_POLICIES, "recording-test", RecordingQueue)
    prepared = prepare_trace(_documents_and_one_offs(3), TraceExpander(512))
    replay(prepared, ReplayConfig(40, "recording-test"))
    expected = [(str(i), request.output_length) for i, request in enumerate(prepared.requests)]
    assert sorted(seen, key=lambda item: int(item[0])) == expected


def test_learned_reuse_keeps_documents_that_lru_loses_to_one_off_prompts():
    prepared = prepare_trace(_documents_and_one_offs(), TraceExpander(512))
    lru = replay(prepared, ReplayConfig(24, "lru"))
    learned = replay(prepared, ReplayConfig(24, "learned-reuse"))
    belady = replay(prepared, ReplayConfig(24, "belady"))
    assert lru.num_hit_tokens == 0  # every document is evicted before its second question
    assert belady.hit_rate >= learned.hit_rate > lru.hit_rate + 0.1


@pytest.mark.parametrize("seed", range(10))
def test_belady_queue_takes_blocks_in_the_plain_per_block_order(seed):
    """Blocks handed in in any order (not only a release's, deepest first), some taken
    back out by hits, against the definition with one heap entry per block."""
    rng = random.Random(seed)
    # Chains over 12 hashes; the later chains reuse prefixes of the earlier ones.
    hashes = [bytes([i]) * 32 for i in range(12)]
    chains = [hashes[:4], hashes[4:9], hashes[:2] + hashes[9:11], hashes[:4] + [hashes[11]],
              hashes[4:7]]
    chains += [rng.choice(chains)[:rng.randint(1, 4)] for _ in range(25)]
    future = FutureUses(chains, [rng.randint(0, len(chain)) for chain in chains])
    queues = []
    for queue_class in (BeladyFreeBlockQueue, PerBlockBeladyQueue):
        blocks = [KVCacheBlock(i) for i in range(16)]
        queues.append((queue_class(blocks, future), blocks))
    outside: list[int] = []  # ids of the blocks out of the queues
    for now in range(len(chains)):
        for queue, _ in queues:
            queue.now = now
        action = rng.random()
        if action < 0.45 and len(outside) < 16:
            count = min(rng.randint(1, 4), queues[0][0].num_free_blocks)
            taken = [[block.block_id for block in queue.popleft_n(count)]
                     for queue, _ in queues]
            assert taken[0] == taken[1]
            outside += taken[0]
            # Each taken block gets some hash (or none), the same in both pools.
            for block_id in taken[0]:
                content = rng.choice([None, *hashes])
                for _, blocks in queues:
                    blocks[block_id].block_hash = content
        elif action < 0.8 and outside:
            rng.shuffle(outside)
            handed = outside[:rng.randint(1, len(outside))]
            outside = outside[len(handed):]
            for queue, blocks in queues:
                queue.append_n([blocks[block_id] for block_id in handed])
        else:
            free = [block.block_id for block in queues[1][0].get_all_free_blocks()]
            if free:
                block_id = rng.choice(free)
                for queue, blocks in queues:
                    queue.remove(blocks[block_id])
                outside.append(block_id)
        orders = [[block.block_id for block in queue.get_all_free_blocks()]
                  for queue, _ in queues]
        assert sorted(orders[0]) == sorted(orders[1])
    rest = [[block.block_id for block in queue.popleft_n(queue.num_free_blocks)]
            for queue, _ in queues]
    assert rest[0] == rest[1]
