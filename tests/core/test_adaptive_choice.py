"""How ``adaptive`` chooses and changes the order it follows: the lead a candidate needs,
the decay of the shadows' counts, and what a switch does to the segments at once.

The shadows are replaced by stand-ins whose hits each test sets, so the rule is checked
apart from what the traffic would make real shadows count."""

from __future__ import annotations

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.eviction.adaptive import CANDIDATES, AdaptiveFreeBlockQueue, Candidate

BLOCK_SIZE = 4


class StandInShadow:
    """Counts, for each access, the hits the test set in ``next_hits``."""

    def __init__(self) -> None:
        self.num_hits = 0.0
        self.next_hits = 0

    def access(self, hashes, low_reuse_hashes=None) -> int:
        self.num_hits += self.next_hits
        return self.next_hits

    def forget(self) -> None:
        pass


def queue_with_stand_ins(num_blocks: int = 64) -> AdaptiveFreeBlockQueue:
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, eviction_policy="adaptive")
    queue = manager.block_pool.free_block_queue
    assert queue.sample_threshold == 256  # a small pool: every hash is sampled
    queue.shadows = [StandInShadow() for _ in queue.candidates]
    return queue


def observe(queue: AdaptiveFreeBlockQueue, hits: list[int], num_hashes: int = 1) -> None:
    """One finished request of ``num_hashes`` sampled hashes; shadow ``i`` hits
    ``hits[i]`` of them."""
    for shadow, count in zip(queue.shadows, hits, strict=True):
        shadow.next_hits = count
    queue._observe([bytes([k]) * 32 for k in range(num_hashes)], None)


def test_a_candidate_takes_the_lead_only_when_ahead_by_more_than_the_margin():
    queue = queue_with_stand_ins()
    margin = queue.switch_margin
    assert queue.leader == 0
    observe(queue, [100] + [0] * (len(CANDIDATES) - 1))
    # Candidate 1 draws level, then leads by exactly the margin: no switch.
    observe(queue, [0, 100] + [0] * (len(CANDIDATES) - 2))
    assert queue.leader == 0
    observe(queue, [0, round(100 * margin)] + [0] * (len(CANDIDATES) - 2))
    assert queue.shadows[1].num_hits == 100 + round(100 * margin)
    assert queue.leader == 0
    # Any more and it leads; the queue then follows its order.
    observe(queue, [0, 1] + [0] * (len(CANDIDATES) - 2))
    assert queue.leader == 1
    assert queue.current_candidate == CANDIDATES[1]
    assert queue.max_protected == int(CANDIDATES[1].protected_fraction * 64)


def test_among_candidates_with_equal_counts_the_first_listed_takes_the_lead():
    queue = queue_with_stand_ins()
    hits = [0] * len(CANDIDATES)
    hits[3] = hits[-1] = 50
    observe(queue, hits)
    assert queue.leader == 3


def test_the_counts_halve_each_time_the_shadows_have_seen_decay_factor_capacities():
    queue = queue_with_stand_ins()
    hits = list(range(1, len(CANDIDATES) + 1))
    # Requests of 8 sampled hashes: the counts halve once 8 x requests reach decay_every.
    per_request = 8
    requests_per_decay = -(-queue.decay_every // per_request)
    for _ in range(requests_per_decay - 1):
        observe(queue, hits, per_request)
    before = [shadow.num_hits for shadow in queue.shadows]
    assert before == [count * (requests_per_decay - 1) for count in hits]
    observe(queue, hits, per_request)
    assert [shadow.num_hits for shadow in queue.shadows] == [
        (count * requests_per_decay) / 2 for count in hits]


def allocate(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> Request:
    """Look up and allocate one prompt, computed; the caller frees it."""
    request = Request(request_id, token_ids, block_hasher=manager.block_hasher)
    blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(token_ids) - num_hit_tokens, num_hit_tokens,
                                  blocks) is not None
    request.num_computed_tokens = len(token_ids)
    return request


def test_a_switch_to_a_smaller_protected_share_demotes_the_overflow_at_once():
    manager = KVCacheManager(40, BLOCK_SIZE, eviction_policy="adaptive")
    queue = manager.block_pool.free_block_queue
    queue._follow(Candidate(0.9, False))
    document = list(range(32))  # 8 full blocks; each ask adds a partial one
    manager.free(allocate(manager, "first", document + [1]))
    manager.free(allocate(manager, "again", document + [2]))  # 8 hits: protected
    assert queue.upper.num_free_blocks == 8
    protected_order = queue.upper.get_all_free_blocks()
    queue._follow(Candidate(0.1, False))  # at most 4 of 40 protected
    assert queue.upper.num_free_blocks == 4
    # The least recently released go, in their order, to probation's tail.
    assert queue.upper.get_all_free_blocks() == protected_order[4:]
    assert queue._segment_blocks()[-8:-4] == protected_order[:4]


def test_empty_blocks_are_evicted_before_low_reuse_content():
    """The first segment holds empty blocks at its head and low-reuse content at its
    tail: a block released holding nothing goes before content already there."""
    manager = KVCacheManager(40, BLOCK_SIZE, eviction_policy="adaptive")
    queue = manager.block_pool.free_block_queue
    queue._follow(Candidate(0.0, True))
    request = allocate(manager, "partial", list(range(6)))  # a full block, a partial one
    partial_id = manager.get_block_ids("partial")[-1]
    low_reuse = manager.block_pool.blocks[30:33]  # placed there by hand
    for block in low_reuse:
        queue._take_from_segments(block)
    queue._place_first(low_reuse, at_head=False)
    manager.free(request)
    first = queue.first.get_all_free_blocks()
    assert first[1:] == low_reuse
    assert first[0].block_id == partial_id and first[0].block_hash is None


def test_while_the_liveness_order_leads_the_segments_keep_the_best_other_order():
    queue = queue_with_stand_ins()
    liveness = next(i for i, c in enumerate(CANDIDATES) if c.liveness)
    runner_up = next(i for i, c in enumerate(CANDIDATES)
                     if not c.liveness and i != 0 and c.protected_fraction > 0)
    hits = [0] * len(CANDIDATES)
    hits[liveness], hits[runner_up] = 100, 60
    observe(queue, hits)
    assert queue.leader == liveness and queue.follows_liveness
    assert queue.segments_candidate == CANDIDATES[runner_up]
    assert queue.current_protected_fraction == CANDIDATES[runner_up].protected_fraction
