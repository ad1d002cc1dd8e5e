"""Scheduler stories: prefill, chunking, hits, preemption, limits — with a fake model that
"samples" a deterministic token per sequence, so every step can be checked exactly."""

from __future__ import annotations

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.request import RequestStatus
from prefixcache.core.scheduler import Scheduler, SchedulerConfig
from tests.core.helpers import step


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                   enable_chunked_prefill=True):
    manager = KVCacheManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    return Scheduler(config, manager)


def test_prefill_then_decode_one_token_per_step():
    scheduler = make_scheduler()
    request = Request("a", list(range(10)))
    scheduler.add_request(request)
    out = step(scheduler, {"a": 3})
    assert [(s.start_position, s.num_new_tokens, s.needs_logits) for s in out.scheduled] == \
        [(0, 10, True)]
    assert out.scheduled[0].token_ids == list(range(10))
    out = step(scheduler, {"a": 3})
    assert [(s.start_position, s.num_new_tokens, s.token_ids) for s in out.scheduled] == \
        [(10, 1, [1000])]
    step(scheduler, {"a": 3})
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [1000, 1001, 1002]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(Request("a", list(range(100))))
    chunks = []
    for _ in range(4):
        out = step(scheduler, {"a": 5})
        chunks += [(s.start_position, s.num_new_tokens, s.needs_logits) for s in out.scheduled]
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]


def test_budget_is_shared_between_decodes_and_a_new_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(Request("a", list(range(8))))
    step(scheduler, {"a": 10, "b": 10})
    scheduler.add_request(Request("b", list(range(100, 140))))
    out = step(scheduler, {"a": 10, "b": 10})
    # a decodes one token; b gets the remaining 15 tokens of budget as its first chunk.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == \
        [("a", 1), ("b", 15)]
    assert out.num_scheduled_tokens == 16


def test_a_cache_hit_spends_budget_only_on_uncached_tokens():
    scheduler = make_scheduler()
    shared = list(range(16))
    scheduler.add_request(Request("a", shared + [50, 51]))
    step(scheduler, {"a": 1, "b": 1})  # a finishes after its first token; blocks stay cached
    scheduler.add_request(Request("b", shared + [60, 61, 62]))
    out = step(scheduler, {"a": 1, "b": 1})
    (scheduled,) = out.scheduled
    assert scheduled.num_hit_tokens == 16
    assert (scheduled.start_position, scheduled.num_new_tokens) == (16, 3)


def test_requests_in_one_batch_share_blocks_cached_at_allocation():
    scheduler = make_scheduler()
    prompt = list(range(12))
    scheduler.add_request(Request("a", prompt + [7]))
    scheduler.add_request(Request("b", prompt + [8]))
    out = scheduler.schedule()
    a, b = out.scheduled
    assert (a.num_hit_tokens, a.num_new_tokens) == (0, 13)
    assert (b.num_hit_tokens, b.num_new_tokens) == (12, 1)
    assert a.block_ids[:3] == b.block_ids[:3]


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(Request(name, [ord(name)] * 5))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_preemption_frees_the_newest_request_and_it_recomputes_with_hits():
    # 6 blocks of 4 tokens; two prompts of 8 tokens (2 blocks each) decoding 8 tokens
    # each cannot both finish without preemption.
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    a = Request("a", list(range(8)))
    b = Request("b", list(range(100, 108)))
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        out = step(scheduler, {"a": 8, "b": 8})
        preempted += out.preempted_request_ids
    assert not scheduler.has_unfinished_requests()
    assert preempted and set(preempted) == {"b"}, "the most recently admitted is preempted"
    assert b.num_preemptions >= 1
    # Outputs are exactly what an unpreempted run produces.
    assert a.output_token_ids == b.output_token_ids == list(range(1000, 1008))
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_preempted_request_hits_its_own_cached_blocks_on_readmission():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(Request("a", list(range(8))))
    scheduler.add_request(Request("b", list(range(100, 108))))
    readmissions = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        out = step(scheduler, {"a": 8, "b": 8})
        readmissions += [s.num_hit_tokens for s in out.scheduled
                         if s.request.request_id == "b" and s.request.num_preemptions]
    assert readmissions and readmissions[0] > 0


def test_a_prompt_that_can_never_fit_is_rejected_alone():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="whole pool holds 4 blocks"):
        scheduler.add_request(Request("big", list(range(17))))
    scheduler.add_request(Request("ok", list(range(16))))
    assert scheduler.num_waiting == 1


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        scheduler.add_request(Request("a", list(range(9))))


def test_a_request_that_outgrows_the_pool_finishes_with_length():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    request = Request("a", list(range(6)))
    scheduler.add_request(request)
    finished = []
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        finished += step(scheduler, {"a": 100}).finished_requests
    assert finished == [request]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 9  # 8 slots filled, the 9th token has nowhere to go
    assert scheduler.kv_cache_manager.num_free_blocks == 2


def test_abort_of_waiting_and_running_requests_frees_everything():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(Request("a", list(range(10))))
    scheduler.add_request(Request("b", list(range(10))))
    scheduler.schedule()
    scheduler.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_duplicate_request_id_and_bad_config_are_clear_errors():
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1]))
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(Request("a", [2]))
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
