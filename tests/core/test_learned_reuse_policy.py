"""The learned-reuse eviction policy: what it learns, where it puts blocks, and that it
keeps the core's invariants while its low-reuse segment is in use."""

from __future__ import annotations

import random

import pytest

from prefixcache.core import EVICTION_POLICIES, KVCacheBlock, Request
from prefixcache.core.eviction import LearnedReuseFreeBlockQueue, output_length_signature
from prefixcache.core.request import RequestStatus
from tests.core.helpers import free_ids, make_manager, schedule_prefill, seq

SHORT = 1  # generated tokens of the requests whose documents come back: signature 1
LONG = 40  # of the one-off requests: signature 6


def run_request(mgr, request_id: str, prompt: list[int], num_output_tokens: int) -> Request:
    """Prefill, generate ``num_output_tokens`` (their slots allocated), finish, free."""
    request = Request(request_id, prompt)
    _, new_ids = schedule_prefill(mgr, request)
    assert new_ids is not None
    finish(mgr, request, num_output_tokens)
    return request


def finish(mgr, request: Request, num_output_tokens: int) -> None:
    """Generate ``num_output_tokens`` for a prefilled request, finish it and free it."""
    request.append_output_token_ids([7] * num_output_tokens)
    assert mgr.allocate_slots(request, num_output_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.FINISHED_STOPPED
    mgr.free(request)


def queue_of(mgr) -> LearnedReuseFreeBlockQueue:
    queue = mgr.block_pool.free_block_queue
    assert isinstance(queue, LearnedReuseFreeBlockQueue)
    return queue


def teach(mgr, rounds: int) -> None:
    """Documents asked twice by short-answer requests; one-off long generations between."""
    for i in range(rounds):
        doc = seq(1000 * (i + 1), 8)  # two full blocks
        run_request(mgr, f"q{i}a", doc + [1], SHORT)
        run_request(mgr, f"once{i}", seq(500_000 + 100 * i, 8) + [2], LONG)
        run_request(mgr, f"q{i}b", doc + [3], SHORT)


def test_registered_and_the_signature_is_the_bit_length_of_the_output():
    assert EVICTION_POLICIES["learned-reuse"] is LearnedReuseFreeBlockQueue
    request = Request("r", [1, 2, 3])
    assert output_length_signature(request) == 0
    request.append_output_token_ids([5] * 300)
    assert output_length_signature(request) == 9  # 256 <= 300 < 512


def test_without_history_it_frees_like_unhashed_first():
    orders = []
    for policy in ("unhashed-first", "learned-reuse"):
        mgr = make_manager(num_blocks=10, block_size=4, eviction_policy=policy)
        run_request(mgr, "r", seq(0, 22), 2)  # 5 full blocks, a partial and decode slots
        orders.append(free_ids(mgr))
    assert orders[0] == orders[1]


def test_it_learns_which_signatures_leave_reusable_content():
    mgr = make_manager(num_blocks=64, block_size=4, eviction_policy="learned-reuse")
    teach(mgr, 6)
    estimates = queue_of(mgr).reuse_estimates()
    short, long = estimates[SHORT.bit_length()], estimates[LONG.bit_length()]
    assert short["reused"] == 12  # both blocks of each document, hit while free
    assert long["reused"] == 0
    assert short["inserted"] == 12
    # A long generation's own full blocks are cached too (and never reused): 12 a request.
    assert long["inserted"] == 6 * 12
    assert short["estimated_reuse_rate"] > long["estimated_reuse_rate"]
    assert long["evicted_first"] and not short["evicted_first"]


def test_new_low_reuse_content_is_evicted_before_older_reusable_content():
    mgr = make_manager(num_blocks=64, block_size=4, eviction_policy="learned-reuse")
    teach(mgr, 6)
    doc = run_request(mgr, "doc", seq(90_000, 8) + [1], SHORT)
    one_off = run_request(mgr, "one-off", seq(80_000, 8) + [1], LONG)
    order = [b.block_hash for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    one_off_positions = [order.index(h) for h in one_off.block_hashes[:2]]
    doc_positions = [order.index(h) for h in doc.block_hashes[:2]]
    # Released last, yet evicted first; under LRU it would be the last cached content to go.
    assert max(one_off_positions) < min(doc_positions)
    lru = make_manager(num_blocks=64, block_size=4, eviction_policy="lru")
    teach(lru, 6)
    run_request(lru, "doc", seq(90_000, 8) + [1], SHORT)
    run_request(lru, "one-off", seq(80_000, 8) + [1], LONG)
    lru_order = [b.block_hash for b in lru.block_pool.free_block_queue.get_all_free_blocks()]
    assert min(lru_order.index(h) for h in one_off.block_hashes[:2]) > max(
        lru_order.index(h) for h in doc.block_hashes[:2])


def test_a_hit_on_a_free_block_is_counted_once():
    mgr = make_manager(num_blocks=16, block_size=4, eviction_policy="learned-reuse")
    doc = seq(0, 8)
    run_request(mgr, "a", doc + [1], SHORT)
    for i in range(3):
        run_request(mgr, f"again{i}", doc + [2 + i], SHORT)
    estimates = queue_of(mgr).reuse_estimates()[SHORT.bit_length()]
    assert estimates["inserted"] == 2 and estimates["reused"] == 2


@pytest.mark.parametrize("first_to_finish", ["filler", "sharer"])
def test_content_hit_while_its_filler_still_holds_it_is_counted_as_reused(first_to_finish):
    mgr = make_manager(num_blocks=16, block_size=4, eviction_policy="learned-reuse")
    doc = seq(0, 8)
    filler, sharer = Request("filler", doc + [1]), Request("sharer", doc + [2])
    schedule_prefill(mgr, filler)
    num_hit_tokens, _ = schedule_prefill(mgr, sharer)
    assert num_hit_tokens == 8  # both document blocks, held by the filler
    order = [filler, sharer] if first_to_finish == "filler" else [sharer, filler]
    for request in order:
        finish(mgr, request, SHORT)
    estimates = queue_of(mgr).reuse_estimates()[SHORT.bit_length()]
    assert estimates["inserted"] == 2  # the tails are partial blocks, never cached
    assert estimates["reused"] == 2
    upper = {b.block_hash for b in queue_of(mgr).upper.get_all_free_blocks()}
    assert set(filler.block_hashes[:2]) <= upper
    # Proven reused: nothing is pending for it, so a later hit does not count it again.
    run_request(mgr, "later", doc + [3], SHORT)
    assert queue_of(mgr).reuse_estimates()[SHORT.bit_length()]["reused"] == 2


def test_a_policy_that_does_not_observe_hits_in_use_is_not_told_of_them():
    mgr = make_manager(num_blocks=16, block_size=4, eviction_policy="lru")
    queue = mgr.block_pool.free_block_queue
    assert not queue.observes_hits_in_use
    seen = []
    queue.note_hit_in_use = seen.append
    doc = seq(0, 8)
    schedule_prefill(mgr, Request("a", doc + [1]))
    schedule_prefill(mgr, Request("b", doc + [2]))
    assert seen == []


def test_content_recomputed_after_eviction_is_credited_through_the_ghost():
    mgr = make_manager(num_blocks=4, block_size=4, eviction_policy="learned-reuse")
    doc = seq(0, 8)
    run_request(mgr, "a", doc + [1], SHORT)
    run_request(mgr, "b", seq(100, 8) + [1], SHORT)  # evicts the document
    assert queue_of(mgr).reuse_estimates()[SHORT.bit_length()]["reused"] == 0
    again = run_request(mgr, "c", doc + [1], SHORT)
    queue = queue_of(mgr)
    assert queue.reuse_estimates()[SHORT.bit_length()]["reused"] == 2
    # Returning content is not new: it is not counted as inserted again, and goes upper.
    assert queue.reuse_estimates()[SHORT.bit_length()]["inserted"] == 4
    upper = {b.block_hash for b in queue.upper.get_all_free_blocks()}
    assert set(again.block_hashes[:2]) <= upper


def test_a_preempted_request_teaches_nothing_and_its_blocks_are_kept_longest():
    mgr = make_manager(num_blocks=64, block_size=4, eviction_policy="learned-reuse")
    teach(mgr, 6)
    before = queue_of(mgr).reuse_estimates()
    request = Request("p", seq(70_000, 8) + [1])
    schedule_prefill(mgr, request)
    request.append_output_token_ids([7] * LONG)  # a low-reuse signature if it had finished
    assert mgr.allocate_slots(request, LONG) is not None
    request.status = RequestStatus.PREEMPTED
    mgr.free(request)
    queue = queue_of(mgr)
    assert queue.reuse_estimates() == before
    upper = {b.block_hash for b in queue.upper.get_all_free_blocks()}
    assert set(request.block_hashes[:2]) <= upper


def test_counts_are_halved_once_the_memory_is_full():
    queue = LearnedReuseFreeBlockQueue([KVCacheBlock(i) for i in range(2)])
    assert queue.memory == 16
    for _ in range(8):
        queue._insert(3, 2)
    assert queue.num_inserted[3] == 16 and queue.total_inserted == 16
    queue._insert(3, 2)
    assert queue.num_inserted[3] == 9 and queue.total_inserted == 9


def test_releases_without_a_request_are_plain_lru():
    queue = LearnedReuseFreeBlockQueue([KVCacheBlock(i) for i in range(6)])
    taken = queue.popleft_n(4)
    for block, block_hash in zip(taken, [b"a", b"b", None, b"d"], strict=True):
        block.block_hash = block_hash
    queue.release(list(reversed(taken)))
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 4, 5, 3, 1, 0]
    assert queue.reuse_estimates() == {}


@pytest.mark.parametrize("seed", range(6))
def test_invariants_hold_while_low_reuse_content_is_evicted_first(seed):
    rng = random.Random(seed)
    mgr = make_manager(num_blocks=24, block_size=4, eviction_policy="learned-reuse")
    docs = [seq(1000 * d, 12) for d in range(5)]
    live: list[Request] = []
    num_lower_releases = 0
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 3):
            request = live.pop(rng.randrange(len(live)))
            num_output = rng.choice([1, 2, 3]) if request.prompt_token_ids[0] < 10_000 \
                else rng.choice([200, 300])
            request.append_output_token_ids([7] * num_output)
            if rng.random() < 0.1:
                request.status = RequestStatus.PREEMPTED
            queue = queue_of(mgr)
            lower_before = queue.num_lower
            mgr.free(request)
            if queue.num_lower > lower_before and request.status != RequestStatus.PREEMPTED \
                    and num_output >= 200:
                num_lower_releases += 1
        else:
            if rng.random() < 0.5:
                prompt = rng.choice(docs)[:rng.randint(4, 12)] + [rng.randrange(50)]
            else:
                prompt = seq(10_000 + 50 * step, rng.randint(4, 12))
            request = Request(f"r{step}", prompt)
            if schedule_prefill(mgr, request)[1] is not None:
                live.append(request)
        check_invariants(mgr)
    for request in live:
        mgr.free(request)
    check_invariants(mgr)
    assert mgr.num_free_blocks == mgr.num_blocks
    assert num_lower_releases > 0  # the low-reuse segment was exercised


def check_invariants(mgr) -> None:
    pool = mgr.block_pool
    queue = pool.free_block_queue
    free = queue.get_all_free_blocks()
    free_ids_set = {block.block_id for block in free}
    assert len(free) == len(free_ids_set) == queue.num_free_blocks
    assert queue.num_lower + queue.upper.num_free_blocks == queue.num_free_blocks
    for block in pool.blocks:
        assert (block.block_id in free_ids_set) == (block.ref_cnt == 0)
        assert bool(queue.in_upper[block.block_id]) == (
            block.block_id in {b.block_id for b in queue.upper.get_all_free_blocks()})
        if block.block_hash is not None:
            assert block in pool.cached_block_hash_to_block.get_all_blocks(block.block_hash)


def test_a_preempted_request_is_judged_when_it_finally_finishes():
    mgr = make_manager(num_blocks=64, block_size=4, eviction_policy="learned-reuse")
    teach(mgr, 6)
    long_signature = LONG.bit_length()
    inserted_before = queue_of(mgr).reuse_estimates()[long_signature]["inserted"]
    request = Request("p", seq(70_000, 8) + [1])
    schedule_prefill(mgr, request)
    request.status = RequestStatus.PREEMPTED
    mgr.free(request)
    # It comes back, hits its own blocks, generates, finishes.
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    num_hit, _ = schedule_prefill(mgr, request)
    assert num_hit == 8
    request.append_output_token_ids([7] * LONG)
    assert mgr.allocate_slots(request, LONG) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.FINISHED_LENGTH
    mgr.free(request)
    queue = queue_of(mgr)
    # Its prompt blocks were new content all along: counted now, and evicted first.
    assert queue.reuse_estimates()[long_signature]["inserted"] > inserted_before
    lower = {b.block_hash for b in queue.get_all_free_blocks()[:queue.num_lower]}
    assert set(request.block_hashes[:2]) <= lower


def preempt(mgr, request: Request) -> None:
    """Preempt ``request`` (free its blocks), then queue it again as the scheduler does."""
    request.status = RequestStatus.PREEMPTED
    mgr.free(request)
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0


@pytest.mark.parametrize("hitter_name,hitter_preempted,expected_reused", [
    ("another", False, 2),
    ("another", True, 2),  # the hitter is preempted in turn, comes back and finishes
    ("filler", False, 0),  # the preempted request comes back for its own content
])
def test_a_hit_on_a_preempted_requests_content_is_a_reuse_unless_it_is_its_own(
        hitter_name, hitter_preempted, expected_reused):
    mgr = make_manager(num_blocks=16, block_size=4, eviction_policy="learned-reuse")
    doc = seq(0, 8)
    filler = Request("filler", doc + [1])
    schedule_prefill(mgr, filler)
    preempt(mgr, filler)  # both document blocks free, their content still new
    hitter = filler if hitter_name == "filler" else Request(hitter_name, doc + [2])
    assert schedule_prefill(mgr, hitter)[0] == 8
    if hitter_preempted:
        preempt(mgr, hitter)
        assert schedule_prefill(mgr, hitter)[0] == 8
    finish(mgr, hitter, SHORT)
    estimates = queue_of(mgr).reuse_estimates()[SHORT.bit_length()]
    assert (estimates["inserted"], estimates["reused"]) == (2, expected_reused)


def test_a_reuse_is_credited_with_the_weight_its_insertion_has_left():
    queue = LearnedReuseFreeBlockQueue([KVCacheBlock(i) for i in range(2)])  # memory 16
    taken = queue.popleft_n(2)
    for block in taken:
        block.block_hash = b"h%d" % block.block_id
    request = Request("r", [1])
    request.status = RequestStatus.FINISHED_STOPPED
    queue.release(taken, request)  # signature 0, 2 insertions
    for _ in range(8):
        queue._insert(5, 2)  # passes the memory: every count halves once
    assert queue.num_halvings == 1 and queue.num_inserted[0] == 1.0
    queue.remove(taken[0])
    queue.remove(taken[1])
    # Two hits on content inserted before the halving count as one insertion's worth.
    assert queue.num_reused[0] == 1.0 <= queue.num_inserted[0]


def test_a_reset_forgets_cached_content_but_keeps_what_was_learned():
    mgr = make_manager(num_blocks=4, block_size=4, eviction_policy="learned-reuse")
    run_request(mgr, "a", seq(0, 8) + [1], SHORT)
    run_request(mgr, "b", seq(100, 8) + [1], SHORT)  # evicts "a"'s document: in the ghost
    queue = queue_of(mgr)
    learned = queue.reuse_estimates()
    assert queue.ghost and any(s is not None for s in queue.block_signature)
    assert mgr.reset_prefix_cache()
    assert not queue.ghost and all(s is None for s in queue.block_signature)
    assert queue.reuse_estimates() == learned
    # Asked for again after the reset: new content, not a reuse of the forgotten copy.
    run_request(mgr, "c", seq(0, 8) + [1], SHORT)
    assert queue.reuse_estimates()[SHORT.bit_length()]["reused"] == 0


def test_the_ghost_of_unreused_content_keeps_the_latest_ghost_factor_pool_fulls():
    mgr = make_manager(num_blocks=6, block_size=4, eviction_policy="learned-reuse")
    queue = queue_of(mgr)
    evicted = []
    for i in range(40):  # 2 new full blocks each, never reused: 80 blocks through 6
        request = run_request(mgr, f"r{i}", seq(1000 * i, 8) + [1], 1)
        evicted += request.block_hashes[:2]
    assert len(queue.ghost) == queue.max_ghost == 4 * 6
    # The latest evicted (in request order; a request's two blocks go in either order).
    cached = {b.block_hash for b in mgr.block_pool.blocks if b.block_hash is not None}
    gone = [block_hash for block_hash in evicted if block_hash not in cached]
    assert set(queue.ghost) <= set(gone[-26:])
