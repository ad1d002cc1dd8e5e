"""The server end to end: a real ``prefixcache serve`` process on loopback, driven by the
official ``openai`` client (and httpx where the client cannot express the request)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from prefixcache.model.tokenizer import Tokenizer
from tests.entrypoints.conftest import MODEL_NAME, scrape, wait_for_idle

BLOCK_SIZE = 4  # conftest.SERVER_ARGS


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_model_dir)


def unique_prompt(words: str = "The quick brown fox jumps over the lazy dog.") -> str:
    # A fresh first block per call, so no other test's cache entries can be hit.
    return f"{uuid.uuid4().hex[:8]} {words}"


def complete(client, prompt, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0.0)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kwargs)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_models_and_health(openai_client, http):
    assert [m.id for m in openai_client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200


def test_completion_counts_tokens_and_hits_the_cache_on_repeat(openai_client, tokenizer):
    prompt = unique_prompt()
    num_prompt_tokens = len(tokenizer.encode(prompt))
    first = complete(openai_client, prompt, max_tokens=12)
    second = complete(openai_client, prompt, max_tokens=12)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens == num_prompt_tokens
    assert first.usage.completion_tokens == 12
    assert first.usage.total_tokens == num_prompt_tokens + 12
    assert cached(first) == 0
    # Every full block but the one holding the last prompt token (it must be recomputed
    # to produce logits) comes from the cache.
    assert cached(second) == (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_shared_prefix_hits_only_the_shared_blocks(openai_client, tokenizer):
    shared = unique_prompt("You are a helpful assistant. Answer the question below.")
    complete(openai_client, shared + " First question?")
    response = complete(openai_client, shared + " Second question?")
    num_shared_tokens = len(tokenizer.encode(shared))
    assert 0 < cached(response) <= num_shared_tokens + BLOCK_SIZE
    assert cached(response) >= num_shared_tokens // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE


def test_chat_completion(openai_client, tokenizer):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": unique_prompt()}]
    response = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert response.usage.prompt_tokens == len(expected)
    assert response.usage.completion_tokens == 6
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_streamed_completion_equals_the_plain_one(openai_client):
    prompt = unique_prompt()
    plain = complete(openai_client, prompt, max_tokens=10)
    chunks = list(complete(openai_client, prompt, max_tokens=10, stream=True,
                           stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == plain.usage.prompt_tokens
    assert cached(usage_chunk) > 0  # the plain request cached the prompt


def test_streamed_chat_equals_the_plain_one_and_usage_is_opt_in(openai_client):
    messages = [{"role": "user", "content": unique_prompt()}]
    plain = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0.0)
    chunks = list(openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0.0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) \
        == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage, no usage chunk


def test_n_choices_with_a_seed_are_reproducible(openai_client):
    prompt = unique_prompt()
    kwargs = {"n": 3, "temperature": 2.0, "top_p": 0.9, "seed": 1234, "max_tokens": 6}
    first = complete(openai_client, prompt, **kwargs)
    second = complete(openai_client, prompt, **kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 18
    assert first.usage.prompt_tokens == second.usage.prompt_tokens  # counted once, not x3
    assert cached(second) > 0


def test_batch_of_prompts_indexes_choices_per_prompt(openai_client):
    prompts = [unique_prompt(), unique_prompt("A gentle breeze stirred the leaves.")]
    batch = complete(openai_client, prompts, n=2, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [complete(openai_client, p, max_tokens=4).choices[0].text for p in prompts]
    assert [c.text for c in batch.choices] == [singles[0]] * 2 + [singles[1]] * 2


def test_stop_string_ends_the_text_before_it(openai_client):
    prompt = unique_prompt()
    text = complete(openai_client, prompt, max_tokens=24).choices[0].text
    # A stop string from the middle of the greedy text: generation must end right before
    # its first occurrence.
    stop = next((text[i:i + 2] for i in range(3, len(text) - 1)
                 if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
    assert stop is not None, f"no printable pair in {text!r}"
    stopped = complete(openai_client, prompt, max_tokens=24, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_cache_salt_isolates_and_same_salt_shares(openai_client):
    prompt = unique_prompt()

    def run(salt):
        extra = None if salt is None else {"cache_salt": salt}
        return cached(complete(openai_client, prompt, max_tokens=2, extra_body=extra))

    assert run(None) == 0
    assert run(None) > 0
    assert run("team-1") == 0  # salted requests never read unsalted blocks
    assert run("team-1") > 0
    assert run("team-2") == 0
    assert run("team-1") > 0
    chat = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=2,
        extra_body={"cache_salt": "team-3"})
    assert cached(chat) == 0


def test_metrics_counters_match_the_responses(openai_client, http):
    before = wait_for_idle(http)
    prompt = unique_prompt()
    responses = [complete(openai_client, prompt, max_tokens=5) for _ in range(2)]
    responses.append(openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=3,
        temperature=0.0))
    after = scrape(http)

    def delta(name):
        return after[name] - before[name]

    prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    assert delta("prefixcache:prompt_tokens_total") == prompt_tokens
    assert delta("prefixcache:prefix_cache_queries_total") == prompt_tokens
    assert delta("prefixcache:prefix_cache_hits_total") == sum(cached(r) for r in responses)
    assert delta("prefixcache:prefix_cache_hits_total") > 0
    assert delta("prefixcache:generation_tokens_total") == \
        sum(r.usage.completion_tokens for r in responses)
    assert delta('prefixcache:request_success_total{finished_reason="length"}') == 3
    assert delta("prefixcache:time_to_first_token_seconds_count") == 3
    assert delta("prefixcache:e2e_request_latency_seconds_count") == 3
    assert after["prefixcache:num_kv_blocks"] == 512
    assert after["prefixcache:kv_cache_usage_perc"] == 0


def test_metrics_describe_the_kv_cache_as_vllms_cache_config_info(http):
    values = scrape(http)
    (info,) = [name for name in values if name.startswith("prefixcache:cache_config_info{")]
    assert values[info] == 1
    for label in ('block_size="4"', 'num_gpu_blocks="512"', 'enable_prefix_caching="True"',
                  'eviction_policy="lru"'):
        assert label in info
    # lru follows one order: no candidate series.
    assert not [name for name in values if "eviction_candidate" in name]


def test_reset_prefix_cache_when_idle(openai_client, http):
    prompt = unique_prompt()
    complete(openai_client, prompt)
    assert cached(complete(openai_client, prompt)) > 0
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert cached(complete(openai_client, prompt)) == 0


def _start_long_stream(server_url: str, max_tokens: int = 480) -> tuple[threading.Thread, dict]:
    """A streamed request running in a thread; ``result`` gets its finish reason."""
    result: dict = {}

    def consume():
        body = {"model": MODEL_NAME, "prompt": unique_prompt(), "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True}
        with httpx.stream("POST", server_url + "/v1/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    result["started"] = True
                    finish_reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                    if finish_reason is not None:
                        result["finish_reason"] = finish_reason
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while "started" not in result and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "started" in result
    return thread, result


def test_reset_refuses_while_running_unless_told_to_abort_or_wait(server, http):
    wait_for_idle(http)
    thread, result = _start_long_stream(server.url)
    assert http.post("/reset_prefix_cache").json() == {"success": False}
    response = http.post("/reset_prefix_cache", params={"abort_running": "true"})
    assert response.json() == {"success": True}
    thread.join(30)
    assert result["finish_reason"] == "abort"

    thread, result = _start_long_stream(server.url, max_tokens=200)
    response = http.post("/reset_prefix_cache", params={"wait": "true"})
    assert response.json() == {"success": True}
    thread.join(30)
    assert result["finish_reason"] == "length"  # waited for, not aborted
    bad = http.post("/reset_prefix_cache", params={"wait": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "wait"


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, http):
    before = wait_for_idle(http)
    body = {"model": MODEL_NAME, "prompt": unique_prompt(), "max_tokens": 480,
            "temperature": 0.0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(3), strict=False)]
    assert any(line.startswith("data: {") for line in received)
    after = wait_for_idle(http)
    aborted = 'prefixcache:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 1
    # Its first token was streamed before the client left, so it was timed.
    ttft_count = "prefixcache:time_to_first_token_seconds_count"
    assert after[ttft_count] - before[ttft_count] == 1
    generated = after["prefixcache:generation_tokens_total"] \
        - before["prefixcache:generation_tokens_total"]
    assert generated < 480


def test_client_disconnect_while_waiting_for_a_plain_response_aborts(server, http):
    before = wait_for_idle(http)
    # 8 choices of 480 tokens: far more work than the client waits for.
    body = {"model": MODEL_NAME, "prompt": unique_prompt(), "max_tokens": 480, "n": 8,
            "temperature": 0.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(
            60, read=0.1))
    after = wait_for_idle(http)
    aborted = 'prefixcache:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 8
    generated = after["prefixcache:generation_tokens_total"] \
        - before["prefixcache:generation_tokens_total"]
    assert generated < 8 * 480  # stopped early, not run to max_tokens


def test_streamed_chat_with_n_choices_opens_and_finishes_each(openai_client):
    messages = [{"role": "user", "content": unique_prompt()}]
    kwargs = {"model": MODEL_NAME, "messages": messages, "max_tokens": 5, "n": 2,
              "temperature": 0.0}
    plain = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert "".join(c.delta.content or "" for c in mine) \
            == plain.choices[index].message.content
