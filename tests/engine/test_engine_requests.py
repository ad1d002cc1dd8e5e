"""Requests through the engine: finish reasons, text, aborts, errors, leaks, stats."""

from __future__ import annotations

import random

import pytest

from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.adaptive import CANDIDATES
from prefixcache.engine.errors import InvalidRequestError
from prefixcache.engine.sampling_params import SamplingParams
from tests.engine.helpers import assert_all_blocks_free, random_tokens, run_to_completion


@pytest.fixture
def engine(make_engine):
    return make_engine(block_size=4)


@pytest.fixture
def prompt(tiny_model):
    return random_tokens(random.Random(11), 10, tiny_model.arch_config.vocab_size)


def generate(engine, prompt, **params):
    engine.add_request("r", prompt, SamplingParams(**params))
    return run_to_completion(engine)["r"]


def test_max_tokens_finishes_with_length(engine, prompt):
    output = generate(engine, prompt, temperature=0, max_tokens=7)
    assert len(output.token_ids) == 7
    assert output.finish_reason == "length" and output.finished
    assert output.text == engine.tokenizer.decode(output.token_ids)
    assert output.metrics.time_to_first_token >= 0
    assert output.metrics.finished_time >= output.metrics.first_token_time


def test_stop_token_id_finishes_with_stop_and_is_not_rendered(engine, prompt):
    full = generate(engine, prompt, temperature=0, max_tokens=20)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    output = generate(engine, prompt, temperature=0, max_tokens=20, stop_token_ids=[stop_id])
    assert output.finish_reason == "stop"
    assert output.token_ids == full.token_ids[:first + 1]
    assert output.text == engine.tokenizer.decode(full.token_ids[:first])


def test_eos_stops_unless_ignored(engine, prompt):
    full = generate(engine, prompt, temperature=0, max_tokens=20)
    eos_id = full.token_ids[4]
    first = full.token_ids.index(eos_id)
    engine.eos_token_ids = (eos_id,)  # pretend the model ends its answers with this token
    output = generate(engine, prompt, temperature=0, max_tokens=20)
    assert output.finish_reason == "stop"
    assert output.token_ids == full.token_ids[:first + 1]
    ignored = generate(engine, prompt, temperature=0, max_tokens=20, ignore_eos=True)
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == full.token_ids


def test_stop_string_is_trimmed_from_the_text(engine, prompt):
    full = generate(engine, prompt, temperature=0, max_tokens=30)
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    output = generate(engine, prompt, temperature=0, max_tokens=30, stop=["\x00never", stop])
    assert output.finish_reason == "stop"
    assert output.text == text[:cut]
    # It stopped at the token that completed the stop string.
    assert engine.tokenizer.decode(output.token_ids).startswith(text[:cut] + stop)
    assert len(output.token_ids) < len(full.token_ids)


def test_stop_string_is_held_back_while_it_may_be_forming(engine, prompt):
    full = generate(engine, prompt, temperature=0, max_tokens=30)
    stop = full.text[14:20]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop))
    streamed = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed += output.new_text
            # No emitted prefix of the text may contain the stop string, ever.
            assert stop not in streamed
    assert streamed == full.text[:full.text.index(stop)]


def test_abort_mid_generation_frees_everything(make_engine, tiny_model):
    engine = make_engine(block_size=4, max_num_seqs=2)
    rng = random.Random(5)
    vocab_size = tiny_model.arch_config.vocab_size
    shared = random_tokens(rng, 12, vocab_size)
    for i in range(4):
        engine.add_request(str(i), shared + random_tokens(rng, 3 + i, vocab_size),
                           SamplingParams(temperature=0, max_tokens=20))
    earlier = [output for _ in range(3) for output in engine.step()]
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    engine.abort_request(["0", "3", "no-such-id"])  # one running, one waiting, one unknown
    finals = run_to_completion(engine, earlier)
    assert finals["0"].finish_reason == "abort" and len(finals["0"].token_ids) == 3
    assert finals["3"].finish_reason == "abort" and finals["3"].token_ids == []
    assert finals["1"].finish_reason == finals["2"].finish_reason == "length"
    engine.abort_request("1")  # already finished: ignored
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_abort_is_delivered_even_when_nothing_else_runs(engine, prompt):
    engine.add_request("r", prompt, SamplingParams(max_tokens=5))
    engine.abort_request("r")
    assert engine.has_unfinished_requests()
    (output,) = engine.step()
    assert output.finished and output.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_an_aborted_id_is_refused_until_its_final_output_is_delivered(engine, prompt):
    params = SamplingParams(temperature=0, max_tokens=5)
    engine.add_request("r", prompt, params)
    engine.step()
    engine.abort_request("r")
    # Accepting it now would put the old request's end and the new one's first token
    # under one id in the same step.
    with pytest.raises(InvalidRequestError,
                       match="^request 'r': the request id is still in use: it was aborted"):
        engine.add_request("r", prompt, params)
    (aborted,) = engine.step()
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 1
    engine.add_request("r", prompt, params)  # free once its end was delivered
    final = run_to_completion(engine)["r"]
    assert final.finish_reason == "length" and len(final.token_ids) == 5
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("eviction_policy", list(EVICTION_POLICIES))
def test_no_leaks_after_a_mixed_workload(make_engine, tiny_model, eviction_policy):
    engine = make_engine(block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                         eviction_policy=eviction_policy)
    block_pool = engine.kv_cache_manager.block_pool
    assert type(block_pool.free_block_queue) is EVICTION_POLICIES[eviction_policy]
    rng = random.Random(9)
    vocab_size = tiny_model.arch_config.vocab_size
    for i in range(10):
        engine.add_request(str(i), random_tokens(rng, rng.randrange(1, 30), vocab_size),
                           SamplingParams(temperature=rng.choice([0, 1.0]), seed=i,
                                          max_tokens=rng.randrange(1, 20)))
    finals = run_to_completion(engine)
    assert len(finals) == 10
    assert engine.get_stats().num_preemptions > 0
    assert block_pool.num_evictions > 0
    assert_all_blocks_free(engine)


def test_the_stats_name_the_cache_settings_and_the_adaptive_policys_candidates(
        make_engine, tiny_model):
    engine = make_engine(block_size=4, num_kv_blocks=24, eviction_policy="adaptive")
    settings = dict(engine.get_stats().cache_config_info)
    assert settings == {"block_size": "4", "num_gpu_blocks": "24",
                        "enable_prefix_caching": "True",
                        "prefix_caching_hash_algo": engine.cache_config.hash_algo,
                        "eviction_policy": "adaptive"}
    standings = engine.get_stats().eviction_candidates
    assert [s.label for s in standings] == [c.label for c in CANDIDATES]
    assert [s.followed for s in standings] == [True] + [False] * (len(CANDIDATES) - 1)
    assert {s.share for s in standings} == {0.0}  # nothing seen yet
    # Requests sharing a prefix: the shadows (which sample every hash of so small a
    # pool) hit it, and the shares are of those hits.
    rng = random.Random(3)
    vocab_size = tiny_model.arch_config.vocab_size
    shared = random_tokens(rng, 16, vocab_size)
    for i in range(6):
        engine.add_request(str(i), shared + random_tokens(rng, 6, vocab_size),
                           SamplingParams(max_tokens=2))
        run_to_completion(engine)
    standings = engine.get_stats().eviction_candidates
    queue = engine.kv_cache_manager.block_pool.free_block_queue
    assert sum(s.share for s in standings) == pytest.approx(1)
    assert [s.followed for s in standings].count(True) == 1
    followed = next(s for s in standings if s.followed)
    assert followed.label == queue.current_candidate.label
    # The switches counter is the queue's count (none yet here: still the first order).
    assert engine.get_stats().eviction_policy_switches == queue.num_switches == 0
    queue.num_switches = 3
    assert engine.get_stats().eviction_policy_switches == 3
    lru_stats = make_engine(block_size=4, num_kv_blocks=24).get_stats()
    assert lru_stats.eviction_candidates == () and lru_stats.eviction_policy_switches == 0


@pytest.mark.parametrize("eviction_policy,expected_free_block_ids", [
    # The design's order: the released table, reversed, joins the tail.
    ("lru", [3, 4, 5, 6, 7, 2, 1, 0]),
    # vLLM 0.33's: the uncached partial block 2 is reused before anything else.
    ("unhashed-first", [2, 3, 4, 5, 6, 7, 1, 0]),
])
def test_the_eviction_policy_orders_a_finished_requests_blocks(
        make_engine, prompt, eviction_policy, expected_free_block_ids):
    engine = make_engine(block_size=4, num_kv_blocks=8, eviction_policy=eviction_policy)
    generate(engine, prompt, temperature=0, max_tokens=1)  # 10 tokens: blocks 0, 1, 2 (half)
    free_blocks = engine.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
    assert [block.block_id for block in free_blocks] == expected_free_block_ids
    assert [block.block_id for block in free_blocks if block.block_hash is not None] == [1, 0]


@pytest.mark.parametrize("case,match,param", [
    ("empty", "empty", "prompt"),
    ("too_long", "max_model_len", "prompt"),
    ("out_of_vocab", "not a token id", "prompt"),
    ("duplicate", "already in use", "request_id"),
    ("bad_params", "top_p", None),
    ("never_fits", "pool", "prompt"),
])
def test_invalid_requests_are_typed_errors_and_queue_nothing(make_engine, prompt, case, match,
                                                             param):
    engine = make_engine(block_size=4, num_kv_blocks=8)  # 32 token slots
    engine.add_request("dup", prompt, SamplingParams(max_tokens=2))
    request = {"request_id": "x", "prompt_token_ids": prompt,
               "sampling_params": SamplingParams(max_tokens=2)}
    if case == "empty":
        request["prompt_token_ids"] = []
    elif case == "too_long":
        request["sampling_params"] = SamplingParams(max_tokens=engine.max_model_len)
    elif case == "out_of_vocab":
        request["prompt_token_ids"] = [1, engine.vocab_size]
    elif case == "duplicate":
        request["request_id"] = "dup"
    elif case == "bad_params":
        request["sampling_params"] = SamplingParams(top_p=2.0)
    elif case == "never_fits":
        request["prompt_token_ids"] = prompt * 4  # 40 tokens > 32 slots
    with pytest.raises(InvalidRequestError, match=match) as excinfo:
        engine.add_request(**request)
    error = excinfo.value
    assert (error.request_id, error.param) == (request["request_id"], param)
    assert str(error) == f"request {error.request_id!r}: {error.message}"
    assert "request '" not in error.message  # the id is a field, not in the message
    assert engine.num_unfinished_requests == 1
    assert set(run_to_completion(engine)) == {"dup"}
    assert_all_blocks_free(engine)


def test_num_cached_tokens_counts_whole_blocks_of_the_shared_prefix(make_engine, tiny_model):
    engine = make_engine(block_size=4)
    rng = random.Random(1)
    vocab_size = tiny_model.arch_config.vocab_size
    shared = random_tokens(rng, 14, vocab_size)
    engine.add_request("a", shared + random_tokens(rng, 5, vocab_size),
                       SamplingParams(temperature=0, max_tokens=3))
    run_to_completion(engine)
    params = SamplingParams(temperature=0, max_tokens=3)
    # 14 shared tokens: three whole blocks of 4 are cached.
    engine.add_request("b", shared + random_tokens(rng, 7, vocab_size), params)
    # The prompt ends inside the shared prefix: never its last token, so 8 of 10.
    engine.add_request("c", shared[:10], params)
    finals = run_to_completion(engine)
    assert finals["b"].num_cached_tokens == 12
    assert finals["c"].num_cached_tokens == 8
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == 20
    assert stats.prefix_cache_queries == 19 + 21 + 10
    assert stats.prompt_tokens == 50 and stats.generation_tokens == 9


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_engine, prompt, tiny_model):
    params = SamplingParams(temperature=1.0, top_k=40, seed=42, max_tokens=15)
    alone = make_engine(block_size=4, seed=1)
    alone.add_request("s", prompt, params)
    expected = run_to_completion(alone)["s"].token_ids

    crowded = make_engine(block_size=4, seed=2)
    rng = random.Random(2)
    vocab_size = tiny_model.arch_config.vocab_size
    crowded.add_request("x", random_tokens(rng, 20, vocab_size),
                        SamplingParams(temperature=1.0, max_tokens=15))
    earlier = crowded.step()
    crowded.add_request("s", prompt, params)
    crowded.add_request("y", prompt, SamplingParams(temperature=0.5, seed=7, max_tokens=15))
    finals = run_to_completion(crowded, earlier)
    assert finals["s"].token_ids == expected
    greedy = make_engine(block_size=4)
    greedy.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=15))
    assert run_to_completion(greedy)["g"].token_ids != expected  # it really sampled


def test_reset_prefix_cache_and_kv_events(make_engine, prompt):
    engine = make_engine(block_size=4, enable_kv_events=True)
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    earlier = engine.step()
    assert engine.reset_prefix_cache() is False  # blocks are in use
    run_to_completion(engine, earlier)
    events = engine.take_kv_events()
    assert events and engine.take_kv_events() == []
    assert engine.reset_prefix_cache() is True
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=2))
    assert run_to_completion(engine)["b"].num_cached_tokens == 0


@pytest.mark.parametrize("options", [
    {},
    # Re-admitted from token 0 a chunk at a time, it used to be preempted for ever.
    {"enable_prefix_caching": False, "max_num_batched_tokens": 4},
    {"enable_prefix_caching": False, "enable_chunked_prefill": False},
])
def test_a_request_outgrowing_the_pool_ends_with_length(make_engine, prompt, options):
    # 16 token slots, a prompt of 10; max_tokens is not checked against the pool, since
    # the request could stop at EOS first. The request behind it must still run.
    engine = make_engine(block_size=4, num_kv_blocks=4, max_num_seqs=1, **options)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("next", prompt[:3], SamplingParams(temperature=0, max_tokens=2))
    finals = run_to_completion(engine, max_steps=100)
    output = finals["r"]
    assert output.finish_reason == "length" and output.error is None
    # Slots for 16 tokens: the 10 prompt tokens plus outputs, the last one never computed.
    assert len(output.token_ids) == 16 - len(prompt) + 1
    assert finals["next"].finish_reason == "length" and len(finals["next"].token_ids) == 2
    assert engine.get_stats().num_preemptions == 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_without_chunked_prefill_a_preempted_request_resumes_past_the_budget(
        make_engine, tiny_model, enable_prefix_caching):
    # 6 blocks of 4 cannot hold a (7 + 16 tokens) and b (6 + 10) at once: b is preempted,
    # by then longer than the 8-token budget, and a's growth takes every block, so none of
    # b's stays cached. b must be recomputed (in chunks) and produce what it does alone.
    rng = random.Random(3)
    vocab_size = tiny_model.arch_config.vocab_size
    prompts = {"a": random_tokens(rng, 7, vocab_size), "b": random_tokens(rng, 6, vocab_size)}
    params = {"a": SamplingParams(temperature=0, max_tokens=16),
              "b": SamplingParams(temperature=0, max_tokens=10)}
    expected = {}
    for request_id, prompt in prompts.items():
        alone = make_engine(block_size=4)
        alone.add_request(request_id, prompt, params[request_id])
        expected[request_id] = run_to_completion(alone)[request_id].token_ids
    engine = make_engine(block_size=4, num_kv_blocks=6, max_num_batched_tokens=8,
                         enable_chunked_prefill=False,
                         enable_prefix_caching=enable_prefix_caching)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params[request_id])
    finals = run_to_completion(engine, max_steps=100)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    # Each prompt is counted once as a query; readmissions (prompt plus what b had
    # generated) are counted apart, and every block of b was gone by then.
    if enable_prefix_caching:
        assert stats.prefix_cache_queries == 7 + 6
        assert stats.prefix_cache_preempted_queries > 6 * stats.num_preemptions
        assert stats.prefix_cache_preempted_hits == 0
    else:
        assert stats.prefix_cache_queries == stats.prefix_cache_preempted_queries == 0
    assert {rid: output.token_ids for rid, output in finals.items()} == expected
    assert all(output.finish_reason == "length" for output in finals.values())
    assert_all_blocks_free(engine)
