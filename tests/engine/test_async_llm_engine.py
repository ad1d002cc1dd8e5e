"""AsyncLLM over the real engine on the tiny model: what an aborted stream ends with, and
reusing an aborted id. (The loop's mechanics are tested over a fake engine in
``tests/entrypoints/test_async_llm.py``.)"""

from __future__ import annotations

import asyncio
import random

import pytest

from prefixcache.engine.async_llm import AsyncLLM, NewRequest
from prefixcache.engine.sampling_params import SamplingParams
from tests.engine.helpers import assert_all_blocks_free, random_tokens, run_to_completion

TIMEOUT_S = 30
# The tiny tokenizer only makes printable ASCII, so this never matches; while a request
# runs, its last len(NEVER) - 1 characters are held back in case it is forming.
NEVER = "\x00" * 6


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


@pytest.fixture
def engine(make_engine):
    return make_engine(block_size=4)


@pytest.fixture
def async_llm(engine):
    async_llm = AsyncLLM(engine)
    yield async_llm
    async_llm.shutdown()


@pytest.fixture
def prompt(tiny_model):
    return random_tokens(random.Random(3), 10, tiny_model.arch_config.vocab_size)


def test_an_aborted_stream_ends_with_its_text_and_tokens_including_held_back_text(
        async_llm, engine, prompt):
    async def main():
        stream = await async_llm.add_requests([NewRequest(
            "r", prompt, SamplingParams(temperature=0, max_tokens=400, stop=NEVER))])
        outputs = []
        async with stream:
            async for output in stream:
                outputs.append(output)
                if len(outputs) == 5:
                    await async_llm.reset_prefix_cache(abort_running=True)
        return outputs

    outputs = run(main())
    final, last_running = outputs[-1], outputs[-2]
    assert final.finish_reason == "abort" and last_running.finish_reason is None
    assert final.token_ids == last_running.token_ids and len(final.token_ids) >= 5
    # The running outputs held the tail back; the final one must not lose it.
    assert len(last_running.text) < len(final.text)
    assert final.text == engine.tokenizer.decode(final.token_ids)
    assert "".join(o.new_text for o in outputs) == final.text
    assert final.metrics.first_token_time is not None
    assert_all_blocks_free(engine)


def test_an_aborted_id_reused_at_once_gets_a_fresh_request(async_llm, engine, prompt):
    params = SamplingParams(temperature=0, max_tokens=6)

    async def main():
        first = await async_llm.add_requests([NewRequest(
            "a", prompt, SamplingParams(temperature=0, max_tokens=400))])
        async for output in first:
            if len(output.token_ids) >= 2:
                break
        await first.aclose()
        second = await async_llm.add_requests([NewRequest("a", prompt, params)])
        async with second:
            return [o async for o in second]

    outputs = run(main())
    assert [o.finish_reason for o in outputs] == [None] * 5 + ["length"]
    assert "".join(o.new_text for o in outputs) == outputs[-1].text
    async_llm.shutdown()  # joins the engine loop: nothing of it still runs
    # The aborted request was reported before the re-add was let in, and the re-added one
    # has finished: the loop tracks nothing, the engine holds nothing.
    assert not async_llm._request_id_to_tracked
    assert not engine.has_unfinished_requests()
    engine.add_request("fresh", prompt, params)
    assert outputs[-1].token_ids == run_to_completion(engine)["fresh"].token_ids
    assert_all_blocks_free(engine)
