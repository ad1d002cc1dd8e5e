"""Scheduler liveness: whatever the admission path (chunked prefill on or off, caching on or
off, ``skip_reading_prefix_cache``), every request finishes within a bounded number of
steps, a request that can never grow is finished with ``FINISHED_LENGTH``, nothing queued
behind it is blocked, and every block is free at the end.

Each story bounds its steps, so a livelock fails it instead of hanging the run.
"""

from __future__ import annotations

import random

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.request import RequestStatus
from prefixcache.core.scheduler import Scheduler, SchedulerConfig
from tests.core.helpers import step


def make_scheduler(num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                   enable_chunked_prefill=True, enable_caching=True):
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching,
                             hash_seed="s")
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    return Scheduler(config, manager)


def run(scheduler: Scheduler, max_tokens: dict[str, int], max_steps: int):
    """Step like the engine (token ``1000 + len(outputs)`` for each sequence that needs
    logits; finish at max_tokens) until nothing is left. Returns every step's output;
    fails if requests are still unfinished after ``max_steps``."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.append(step(scheduler, max_tokens))
    unfinished = {rid: (r.status.value, r.num_tokens) for rid, r in scheduler.requests.items()}
    raise AssertionError(f"unfinished after {max_steps} steps: {unfinished}")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert not manager.req_to_blocks


@pytest.mark.parametrize("enable_caching", [True, False])
def test_without_chunked_prefill_a_preempted_request_past_the_budget_is_recomputed_in_chunks(
        enable_caching):
    # 6 blocks of 4 cannot hold a (7 + 16 tokens) and b (6 + 10) at once: b is preempted
    # with 11 tokens, more than the 8-token budget, and a's growth takes every block, so
    # none of b's stays cached. b can only come back in chunks.
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=8,
                               enable_chunked_prefill=False, enable_caching=enable_caching)
    a = Request("a", list(range(7)))
    b = Request("b", list(range(100, 106)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = run(scheduler, {"a": 16, "b": 10}, max_steps=40)
    b_chunks = [[(s.start_position, s.num_new_tokens, s.num_hit_tokens) for s in output.scheduled
                 if s.request is b] for output in outputs]
    # Prompts are never split: each went in whole.
    assert [(s.request.request_id, s.num_new_tokens) for s in outputs[0].scheduled] == \
        [("a", 7)]
    assert b_chunks[1] == [(0, 6, 0)]
    # ... but b's recomputation (11 tokens, no hit) is, once a has finished.
    last_preemption = max(i for i, output in enumerate(outputs) if output.preempted_request_ids)
    assert outputs[last_preemption].preempted_request_ids == ["b"]
    resumed = [chunk for chunks in b_chunks[last_preemption + 1:] for chunk in chunks]
    assert resumed[:2] == [(0, 8, 0), (8, 3, 0)]
    assert a.num_preemptions == 0
    assert a.output_token_ids == list(range(1000, 1016))
    assert b.output_token_ids == list(range(1000, 1010))  # as if never preempted
    assert not any(output.finished_requests for output in outputs)
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("enable_caching,skip_reading,enable_chunked_prefill", [
    (True, False, True),
    (True, False, False),
    (False, False, True),  # re-admitted from token 0 a chunk at a time
    (False, False, False),
    (True, True, True),  # the same, with the cache on but not read
    (True, True, False),
])
def test_a_request_outgrowing_the_pool_finishes_with_length_and_unblocks_the_queue(
        enable_caching, skip_reading, enable_chunked_prefill):
    # 2 blocks of 4: "a" decodes until its 9th token has no slot. "b" waits behind it
    # (max_num_seqs=1) and must run once "a" is gone.
    scheduler = make_scheduler(
        num_blocks=2, max_num_seqs=1, max_num_batched_tokens=4 if enable_chunked_prefill else 8,
        enable_chunked_prefill=enable_chunked_prefill, enable_caching=enable_caching)
    a = Request("a", list(range(6)), skip_reading_prefix_cache=skip_reading)
    b = Request("b", [7, 8, 9])
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = run(scheduler, {"a": 100, "b": 2}, max_steps=30)
    assert [r for output in outputs for r in output.finished_requests] == [a]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.num_tokens == 9  # 8 slots computed, the 9th token sampled but never computed
    assert a.output_token_ids == list(range(1000, 1003))
    assert a.num_preemptions == 0  # alone, it is finished, not preempted and re-admitted
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [1000, 1001]
    assert_all_blocks_free(scheduler)


def test_a_request_preempted_after_it_outgrew_the_pool_is_finished_from_the_queue():
    # 4 blocks of 2. b hits a's two prompt blocks and fills the other two: after its first
    # token it has 9 tokens, one more than the pool holds. a then needs a block and
    # preempts b, which must leave the queue with FINISHED_LENGTH at once, not hold it up.
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    a = Request("a", [1, 2, 3, 4])
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = run(scheduler, {"a": 3, "b": 100}, max_steps=10)
    assert [(s.request.request_id, s.num_hit_tokens, s.num_new_tokens)
            for s in outputs[0].scheduled] == [("a", 0, 4), ("b", 4, 4)]
    assert outputs[1].preempted_request_ids == ["b"] and b.num_tokens == 9
    assert outputs[2].finished_requests == [b] and b.status == RequestStatus.FINISHED_LENGTH
    assert [s.request.request_id for s in outputs[2].scheduled] == ["a"]
    assert a.output_token_ids == [1000, 1001, 1002]
    assert_all_blocks_free(scheduler)


# -- randomized ---------------------------------------------------------------------------


def test_random_workloads_always_finish_and_free_every_block():
    """Random pools, budgets, ``max_num_seqs``, chunked prefill and caching on or off,
    ``skip_reading_prefix_cache``, arrival steps and output lengths (some far past the
    pool). Every run ends well within its step bound (the longest takes ~40% of it), and
    only requests that really outgrew the pool are finished by the scheduler."""
    rng = random.Random(2024)
    for trial in range(1500):
        block_size = rng.choice([1, 2, 4])
        num_blocks = rng.choice([1, 2, 3, 5, 8, 16])
        enable_chunked_prefill = rng.random() < 0.6
        scheduler = make_scheduler(
            num_blocks, block_size, max_num_seqs=rng.choice([1, 2, 4]),
            max_num_batched_tokens=rng.choice([1, 2, 3, 8, 32]),
            enable_chunked_prefill=enable_chunked_prefill,
            enable_caching=rng.random() < 0.7)
        num_pool_slots = num_blocks * block_size
        max_tokens: dict[str, int] = {}
        arrivals: list[tuple[int, Request]] = []
        for i in range(rng.randrange(1, 9)):
            shared = rng.choice([[1, 2, 3, 4], [5, 6], []])
            prompt = shared + [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
            request = Request(f"r{i}", prompt, skip_reading_prefix_cache=rng.random() < 0.2)
            arrivals.append((rng.randrange(20), request))
            # Some may stop early, some would grow far past the pool.
            max_tokens[request.request_id] = rng.choice([1, 3, 8, 100])
        arrivals.sort(key=lambda arrival: arrival[0])
        admitted = []
        bound = 20 + 200 * len(arrivals)
        for step_index in range(bound):
            while arrivals and arrivals[0][0] <= step_index:
                request = arrivals.pop(0)[1]
                try:
                    scheduler.add_request(request)
                except ValueError:
                    assert request.num_tokens > num_pool_slots or (
                        not enable_chunked_prefill
                        and request.num_tokens > scheduler.config.max_num_batched_tokens)
                    continue
                admitted.append(request)
            if not arrivals and not scheduler.has_unfinished_requests():
                break
            output = scheduler.schedule()
            for request in output.finished_requests:
                assert request.num_tokens == num_pool_slots + 1, (trial, request.request_id)
            for scheduled in output.scheduled:
                request = scheduled.request
                if scheduled.needs_logits:
                    request.append_output_token_ids(rng.randrange(4))
                    if request.num_output_tokens >= max_tokens[request.request_id]:
                        scheduler.finish_request(request.request_id,
                                                 RequestStatus.FINISHED_STOPPED)
        else:
            pytest.fail(f"trial {trial}: unfinished after {bound} steps: "
                        f"{[(r.request_id, r.status.value) for r in scheduler.requests.values()]}")
        for request in admitted:
            assert request.status.is_finished
            # Every admitted request samples at least one token before it can be finished.
            assert request.num_output_tokens >= 1, (trial, request.request_id)
        assert_all_blocks_free(scheduler)
