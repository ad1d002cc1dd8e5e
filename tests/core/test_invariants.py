"""Hypothesis stateful tests: the manager's invariants hold under any sequence of operations.

A small pool (8 blocks of 4 tokens) makes allocations fail often; prompts are drawn from a
few shared prefixes with small-alphabet suffixes, so hits, duplicates and evictions are
common. The machine plays the scheduler (each request's computed tokens catch up with its
tokens, in chunks) and keeps an independent model of what every full block holds, so a hit
is checked against the tokens actually stored, not just against a hash.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.core import (
    EVICTION_POLICIES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    Request,
    cdiv,
)
from prefixcache.core.eviction.scored import (
    GroupedScoredFreeBlockQueue,
    ScoredFreeBlockQueue,
)
from prefixcache.core.eviction.segmented import TwoSegmentFreeBlockQueue
from prefixcache.core.request import RequestStatus
from tests.core.helpers import snapshot

BLOCK_SIZE = 4
NUM_BLOCKS = 8
PREFIXES = [
    list(range(0, 12)),
    list(range(0, 6)) + list(range(50, 56)),
    list(range(100, 109)),
    [7],
]
SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def assert_links_agree(queue, expected_order) -> None:
    """Walking ``queue``'s list backwards from its tail sentinel gives ``expected_order``
    reversed, and ends at its head sentinel."""
    node = queue.fake_free_list_tail
    backward = []
    while node.prev_free_block is not None:
        node = node.prev_free_block
        backward.append(node)
    assert node is queue.fake_free_list_head
    assert backward[:-1] == list(reversed(expected_order))


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"
    guard = False
    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                  enable_caching=self.caching, eviction_policy=self.policy,
                                  verify_cached_tokens=self.guard, enable_events=True,
                                  hash_seed="machine")
        self.running: dict[str, Request] = {}
        # block id -> (salt, every token up to the end of that block) once it is full
        self.content: dict[int, tuple] = {}
        self.index: set[bytes] = set()  # a router's view, built from the events
        self.expected_stats = [0, 0, 0]
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------

    def ids(self) -> list[str]:
        return sorted(self.running)

    def snap(self) -> tuple:
        return snapshot(self.mgr, self.ids())

    def record_content(self, req: Request) -> None:
        table = self.mgr.get_block_ids(req.request_id)
        tokens = req.all_token_ids
        for i in range(req.num_computed_tokens // BLOCK_SIZE):
            key = (req.cache_salt, tuple(tokens[:(i + 1) * BLOCK_SIZE]))
            self.content[table[i]] = key

    def allocate(self, req: Request, num_tokens: int, hit_blocks: list, num_hit: int) -> bool:
        before = self.snap()
        free_before = self.mgr.num_free_blocks
        free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        have = len(self.mgr.get_block_ids(req.request_id)) + len(hit_blocks)
        needed = cdiv(req.num_computed_tokens + num_hit + num_tokens, BLOCK_SIZE) - have
        new = self.mgr.allocate_slots(req, num_tokens, num_new_computed_tokens=num_hit,
                                      new_computed_blocks=hit_blocks)
        fits = needed <= free_before - free_hits
        if new is None:
            assert not fits, "allocation refused although it fits"
            assert self.snap() == before, "a failed allocation changed the state"
            return False
        assert fits, "allocation succeeded although it does not fit"
        assert len(new) == max(needed, 0)
        req.num_computed_tokens += num_hit + num_tokens
        self.running[req.request_id] = req
        self.record_content(req)
        return True

    # -- rules -----------------------------------------------------------------------

    @rule(prefix=st.sampled_from(range(len(PREFIXES))),
          suffix=st.lists(st.integers(0, 2), max_size=20),
          salt=st.sampled_from([None, None, "s"]),
          chunk=st.one_of(st.none(), st.integers(1, 9)),
          skip_read=st.sampled_from([False, False, False, True]))
    def new_request(self, prefix, suffix, salt, chunk, skip_read):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = PREFIXES[prefix] + suffix
        req = Request(rid, prompt, cache_salt=salt, skip_reading_prefix_cache=skip_read)
        blocks, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit == len(blocks) * BLOCK_SIZE
        assert num_hit <= len(prompt) - 1
        if not self.caching or skip_read:
            assert num_hit == 0
        cache = self.mgr.block_pool.cached_block_hash_to_block
        for i, block in enumerate(blocks):
            assert block.block_hash == req.block_hashes[i]
            assert block in cache.get_all_blocks(block.block_hash)
            # the block really holds this request's prefix (and salt)
            assert self.content[block.block_id] == (salt, tuple(prompt[:(i + 1) * BLOCK_SIZE]))
        if self.caching and not skip_read:
            max_blocks = min((len(prompt) - 1) // BLOCK_SIZE, len(req.block_hashes))
            if len(blocks) < max_blocks:  # the hit is the longest cached prefix
                assert req.block_hashes[len(blocks)] not in cache
        remaining = len(prompt) - num_hit
        num_tokens = remaining if chunk is None else min(chunk, remaining)
        if self.allocate(req, num_tokens, blocks, num_hit) and self.caching and not skip_read:
            # Counted once admitted; a lookup alone is no admission.
            self.expected_stats[0] += 1
            self.expected_stats[1] += len(prompt)
            self.expected_stats[2] += num_hit

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 9),
          new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def step(self, data, chunk, new_tokens):
        """One scheduling step: the rest of a chunked prefill, or a decode step."""
        req = self.running[data.draw(st.sampled_from(self.ids()))]
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids(new_tokens if len(new_tokens) > 1 else new_tokens[0])
        remaining = req.num_tokens - req.num_computed_tokens
        self.allocate(req, min(chunk, remaining), [], 0)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        req = self.running.pop(data.draw(st.sampled_from(self.ids())))
        # Finished or preempted: a policy may treat the two differently (learned-reuse).
        req.status = data.draw(st.sampled_from(
            [RequestStatus.FINISHED_STOPPED, RequestStatus.PREEMPTED]))
        self.mgr.free(req)
        assert self.mgr.get_block_ids(req.request_id) == []

    @rule()
    def free_unknown(self):
        before = self.snap()
        self.mgr.free(Request("ghost", [1]))
        assert self.snap() == before

    @rule()
    def reset_prefix_cache(self):
        before = self.snap()
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert len(self.mgr.block_pool.cached_block_hash_to_block) == 0
            assert all(b.block_hash is None for b in self.mgr.block_pool.blocks)
        else:
            assert self.snap() == before

    @rule()
    def read_stats(self):
        stats = self.mgr.make_prefix_cache_stats()
        assert [stats.requests, stats.queries, stats.hits] == self.expected_stats
        self.expected_stats = [0, 0, 0]

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def free_queue_is_exactly_the_unreferenced_blocks(self):
        pool = self.mgr.block_pool
        queue = pool.free_block_queue
        free = queue.get_all_free_blocks()
        assert len(free) == queue.num_free_blocks
        assert len({b.block_id for b in free}) == len(free)
        free_ids = {b.block_id for b in free}
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
            if block.ref_cnt:
                assert block.prev_free_block is None and block.next_free_block is None
        assert math.isclose(self.mgr.usage, (NUM_BLOCKS - len(free)) / NUM_BLOCKS)
        if isinstance(queue, TwoSegmentFreeBlockQueue):
            # Two linked lists, lower then upper, each consistent both ways; adaptive's
            # first segment, a third list, comes before them.
            first_segment = getattr(queue, "first", None)
            num_first = first_segment.num_free_blocks if first_segment is not None else 0
            first_ids = {block.block_id for block in free[:num_first]}
            if first_segment is not None:
                assert_links_agree(first_segment, free[:num_first])
                free = free[num_first:]
            lower = free[:queue.num_lower]
            upper = free[queue.num_lower:]
            assert len(upper) == queue.upper.num_free_blocks
            assert_links_agree(queue, lower)
            assert_links_agree(queue.upper, upper)
            for block in pool.blocks:
                expected = 2 if block.block_id in first_ids else int(block in upper)
                assert queue.in_upper[block.block_id] == expected
        elif isinstance(queue, (ScoredFreeBlockQueue, GroupedScoredFreeBlockQueue)):
            # A heap: only free blocks carry the "in the queue" (odd) version.
            for block in pool.blocks:
                in_queue = queue.version(block.block_id) % 2 == 1
                assert in_queue == (block.block_id in free_ids)
            if isinstance(queue, GroupedScoredFreeBlockQueue):
                # Empty blocks (no key) all come before any cached one.
                keys = queue.free_block_keys()
                assert sorted(keys) == sorted(free_ids)
                empty = [keys[b.block_id] is None for b in free]
                assert empty == sorted(empty, reverse=True)
                assert all((b.block_hash is None) == (keys[b.block_id] is None)
                           for b in free)
                groups = queue._live_groups.values()
                assert sum(group.num_live for group in groups) == len(free) - sum(empty)
        else:
            assert_links_agree(queue, free)

    @invariant()
    def ref_counts_equal_table_membership(self):
        pool = self.mgr.block_pool
        holders = [0] * NUM_BLOCKS
        for rid, req in self.running.items():
            table = self.mgr.get_block_ids(rid)
            assert len(table) == len(set(table)), f"block twice in {rid}'s table"
            assert len(table) == cdiv(req.num_computed_tokens, BLOCK_SIZE)
            for block_id in table:
                holders[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders

    @invariant()
    def cache_map_and_block_hashes_agree(self):
        pool = self.mgr.block_pool
        cache = pool.cached_block_hash_to_block
        seen = set()
        for block_hash in list(cache.keys()):
            blocks = cache.get_all_blocks(block_hash)
            assert blocks, "empty map entry"
            for block in blocks:
                assert block.block_hash == block_hash
                assert block.block_id not in seen
                seen.add(block.block_id)
        for block in pool.blocks:
            if block.block_hash is not None:
                assert block in cache.get_all_blocks(block.block_hash)
                assert block.block_id in seen
        if not self.caching:
            assert len(cache) == 0

    @invariant()
    def duplicates_do_not_outlive_their_requests(self):
        """"This duplication will be eliminated when the request is freed": of the blocks
        holding one hash, at most one is free."""
        cache = self.mgr.block_pool.cached_block_hash_to_block
        for block_hash in list(cache.keys()):
            blocks = cache.get_all_blocks(block_hash)
            assert sum(1 for b in blocks if b.ref_cnt == 0) <= 1

    @invariant()
    def running_requests_full_blocks_are_cached_under_their_hashes(self):
        if not self.caching:
            return
        pool = self.mgr.block_pool
        for rid, req in self.running.items():
            table = self.mgr.get_block_ids(rid)
            for i in range(req.num_computed_tokens // BLOCK_SIZE):
                assert pool.blocks[table[i]].block_hash == req.block_hashes[i]

    @invariant()
    def events_rebuild_the_set_of_cached_hashes(self):
        for event in self.mgr.take_events():
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
                for h in event.block_hashes:
                    assert h not in self.index, "stored twice without removal"
                    self.index.add(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.index.remove(h)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.index.clear()
        assert self.index == set(self.mgr.block_pool.cached_block_hash_to_block.keys())

    def teardown(self):
        for req in list(self.running.values()):
            self.mgr.free(req)
        self.running.clear()
        pool = self.mgr.block_pool
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.free_block_queue.num_free_blocks == NUM_BLOCKS
        assert len(pool.free_block_queue.get_all_free_blocks()) == NUM_BLOCKS
        assert self.mgr.usage == 0.0
        assert self.mgr.reset_prefix_cache() is True
        assert len(pool.cached_block_hash_to_block) == 0


class LRUMachine(ManagerMachine):
    policy = "lru"


class UnhashedFirstMachine(ManagerMachine):
    policy = "unhashed-first"


class GuardedLRUMachine(ManagerMachine):
    policy = "lru"
    guard = True


class GuardedUnhashedFirstMachine(ManagerMachine):
    policy = "unhashed-first"
    guard = True


class CachingDisabledMachine(ManagerMachine):
    caching = False


TestLRU = LRUMachine.TestCase
TestUnhashedFirst = UnhashedFirstMachine.TestCase
TestGuardedLRU = GuardedLRUMachine.TestCase
TestGuardedUnhashedFirst = GuardedUnhashedFirstMachine.TestCase
TestCachingDisabled = CachingDisabledMachine.TestCase
for _case in (TestLRU, TestUnhashedFirst, TestGuardedLRU, TestGuardedUnhashedFirst,
              TestCachingDisabled):
    _case.settings = SETTINGS
del _case

# Every other registered policy (the seam for new ones) must keep the same contract, with
# and without the collision guard.
for _name in sorted(set(EVICTION_POLICIES) - {"lru", "unhashed-first"}):
    for _guard in (False, True):
        _label = ("Guarded" if _guard else "") + _name.replace("-", "_")
        _machine = type(f"Policy_{_label}_Machine", (ManagerMachine,),
                        {"policy": _name, "guard": _guard})
        _test = _machine.TestCase
        _test.settings = SETTINGS
        globals()[f"TestPolicy_{_label}"] = _test
        del _machine, _test, _label
del _guard
