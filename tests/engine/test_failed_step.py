"""A model step that fails: its requests end with "error", and nothing it was to compute is
left in the prefix cache — blocks are cached when scheduled, before the model writes them."""

from __future__ import annotations

import random

import pytest

from prefixcache.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.engine.sampling_params import SamplingParams
from tests.engine.helpers import assert_all_blocks_free, random_tokens, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def fail_next_execute(engine) -> None:
    """Make the engine's next model call raise, as a CPU out-of-memory would."""
    execute = engine.runner.execute

    def fail_once(sequences):
        engine.runner.execute = execute
        raise RuntimeError("simulated: could not allocate memory")

    engine.runner.execute = fail_once


def cached_hashes_from_events(events) -> set:
    cached: set = set()
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()
    return cached


@pytest.fixture
def prompts(tiny_model):
    rng = random.Random(5)
    vocab_size = tiny_model.arch_config.vocab_size
    system = random_tokens(rng, 12, vocab_size)  # three blocks of 4
    return system, system + random_tokens(rng, 25, vocab_size)


def test_a_failed_step_leaves_no_unwritten_block_in_the_cache(make_engine, prompts):
    system, long_prompt = prompts
    reference = make_engine(block_size=4, enable_prefix_caching=False)
    reference.add_request("ref", long_prompt, GREEDY)
    expected = run_to_completion(reference)["ref"].token_ids

    engine = make_engine(block_size=4, enable_kv_events=True)
    engine.add_request("warm", system + [7], GREEDY)  # caches the system prompt's blocks
    run_to_completion(engine)
    fail_next_execute(engine)
    engine.add_request("doomed", long_prompt, GREEDY)
    (failed,) = engine.step()
    assert failed.finish_reason == "error" and "could not allocate" in failed.error
    assert_all_blocks_free(engine)

    engine.add_request("again", long_prompt, GREEDY)
    again = run_to_completion(engine)["again"]
    # Only the system prompt's blocks, written by "warm", are hit; the failed step's are not.
    assert again.num_cached_tokens == len(system)
    assert again.token_ids == expected

    pool = engine.kv_cache_manager.block_pool
    assert cached_hashes_from_events(engine.take_kv_events()) == set(
        pool.cached_block_hash_to_block.keys())
    assert pool.num_evictions == 0  # dropping the unwritten hashes is not an eviction


def test_a_request_sharing_the_failed_steps_blocks_in_that_step_fails_with_it(
        make_engine, prompts):
    _, long_prompt = prompts
    engine = make_engine(block_size=4)
    fail_next_execute(engine)
    engine.add_request("first", long_prompt, GREEDY)
    engine.add_request("second", long_prompt, GREEDY)  # hits first's blocks in that step
    assert {o.finish_reason for o in engine.step()} == {"error"}
    engine.add_request("third", long_prompt, GREEDY)
    assert run_to_completion(engine)["third"].num_cached_tokens == 0
