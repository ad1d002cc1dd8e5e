"""Bounded load: 32 concurrent streaming clients against one server.

Zero errors; every output the same tokens as the same prompt sent alone (greedy); the
engine really batched them (far fewer engine steps than tokens); and afterwards no block is
held (usage 0, and a reset of the prefix cache, which needs every block free, succeeds).

"The same tokens" allows one thing (see tests/near_ties.py): an output that differs from
its solo run must differ first at a near-tie of the model's two best logits, checked
against transformers on the solo run's context, where batching's float noise may decide.
"""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, scrape, wait_for_idle
from tests.near_ties import assert_same_or_split_at_a_near_tie, load_reference_model

NUM_CLIENTS = 32
NUM_REQUESTS = 64
MAX_TOKENS = 12
LOAD_TIMEOUT_S = 120


def make_prompts() -> list[str]:
    # Four families sharing a long prefix (and so cache blocks) plus unique tails; the run
    # id makes the cache cold for this test whatever ran before.
    run_id = uuid.uuid4().hex[:8]
    prefixes = [f"{run_id} You are a helpful assistant number {family}. Answer briefly:"
                for family in range(4)]
    return [f"{prefixes[i % 4]} question {i}?" for i in range(NUM_REQUESTS)]


async def stream_one(client: openai.AsyncOpenAI, prompt: str
                     ) -> tuple[list[int], str, int, list[int], str]:
    """(generated ids, finish reason, usage's completion tokens, prompt ids, text)."""
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    token_ids, text, finish_reason, completion_tokens, prompt_token_ids = [], [], None, None, []
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            token_ids += choice.token_ids
            text.append(choice.text)
            prompt_token_ids = choice.model_extra.get("prompt_token_ids") or prompt_token_ids
            finish_reason = choice.finish_reason or finish_reason
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return token_ids, finish_reason, completion_tokens, prompt_token_ids, "".join(text)


async def run_concurrently(url: str, prompts: list[str]) -> tuple[dict, list]:
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    results: dict[int, tuple[str, str, int]] = {}
    errors: list[BaseException] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:

        async def worker() -> None:
            while not queue.empty():
                index, prompt = queue.get_nowait()
                try:
                    results[index] = await stream_one(client, prompt)
                except Exception as exc:  # noqa: BLE001 - counted and reported below
                    errors.append(exc)

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(NUM_CLIENTS))),
                               LOAD_TIMEOUT_S)
    return results, errors


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    return load_reference_model(tiny_model_dir)


def test_concurrent_streams_match_sequential_and_free_every_block(server, http,
                                                                  openai_client,
                                                                  reference_model):
    prompts = make_prompts()
    before = wait_for_idle(http)
    results, errors = asyncio.run(run_concurrently(server.url, prompts))
    after_load = wait_for_idle(http)

    assert errors == []
    assert sorted(results) == list(range(NUM_REQUESTS))
    assert {r[1] for r in results.values()} == {"length"}
    assert {r[2] for r in results.values()} == {MAX_TOKENS}

    for index, prompt in enumerate(prompts):
        solo = openai_client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"return_token_ids": True}).choices[0]
        batched_ids, _, _, batched_prompt_ids, batched_text = results[index]
        assert batched_prompt_ids == solo.prompt_token_ids
        assert_same_or_split_at_a_near_tie(reference_model, solo.prompt_token_ids,
                                           solo.token_ids, batched_ids)
        if batched_ids == solo.token_ids:
            assert batched_text == solo.text

    # Batched: one at a time would need at least one step per generated token.
    steps = after_load["prefixcache:engine_steps_total"] - before["prefixcache:engine_steps_total"]
    assert steps < NUM_REQUESTS * MAX_TOKENS / 4
    # Shared prefixes were served from the cache under load.
    assert after_load["prefixcache:prefix_cache_hits_total"] \
        > before["prefixcache:prefix_cache_hits_total"]

    final = wait_for_idle(http)
    assert final["prefixcache:kv_cache_usage_perc"] == 0
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert scrape(http)["prefixcache:num_requests_running"] == 0
