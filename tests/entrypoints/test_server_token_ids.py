"""``return_token_ids`` (vLLM's extension) on a real server: where the ids go, that they
are the ids the engine ran (prompt ids equal the tokenizer's, generated ids decode to the
text), that streamed ids concatenate to the plain response's, and that a request without
the flag gets exactly the response it got before."""

from __future__ import annotations

import uuid

import pytest

from prefixcache.model.tokenizer import Tokenizer
from tests.entrypoints.conftest import MODEL_NAME

WITH_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_model_dir)


def unique_prompt() -> str:
    return f"{uuid.uuid4().hex[:8]} The quick brown fox jumps over the lazy dog."


def test_completion_returns_the_prompt_and_generated_ids(openai_client, tokenizer):
    prompts = [unique_prompt(), unique_prompt()]
    response = openai_client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, max_tokens=9, temperature=0.0,
        extra_body=WITH_IDS)
    assert len(response.choices) == 4
    for choice in response.choices:
        assert choice.prompt_token_ids == tokenizer.encode(prompts[choice.index // 2])
        assert len(choice.token_ids) == 9
        assert tokenizer.decode(choice.token_ids) == choice.text
    assert response.usage.completion_tokens == 4 * 9


def test_streamed_completion_ids_concatenate_to_the_plain_ones(openai_client):
    prompt = unique_prompt()
    plain = openai_client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0.0, extra_body=WITH_IDS)
    chunks = list(openai_client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0.0, stream=True,
        extra_body=WITH_IDS))
    assert chunks[0].choices[0].prompt_token_ids == plain.choices[0].prompt_token_ids
    assert all(c.choices[0].model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    streamed = [token for c in chunks for token in c.choices[0].token_ids]
    assert streamed == plain.choices[0].token_ids
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text


def test_chat_puts_prompt_ids_on_the_response_and_generated_ids_on_choices(
        openai_client, http, tokenizer):
    messages = [{"role": "user", "content": unique_prompt()}]
    plain = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0.0, extra_body=WITH_IDS)
    rendered = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    assert plain.prompt_token_ids == rendered["tokens"]
    assert tokenizer.decode(plain.choices[0].token_ids) == plain.choices[0].message.content

    chunks = list(openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0.0, stream=True,
        extra_body=WITH_IDS))
    assert chunks[0].prompt_token_ids == rendered["tokens"]
    assert all(c.model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    streamed = [token for c in chunks for token in (c.choices[0].model_extra.get("token_ids")
                                                    or [])]
    assert streamed == plain.choices[0].token_ids


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                              "max_tokens": 3}),
])
def test_without_the_flag_no_ids_are_sent(http, path, body):
    for flag in ({}, {"return_token_ids": False}, {"return_token_ids": None}):
        response = http.post(path, json={"model": MODEL_NAME, **body, **flag})
        assert response.status_code == 200
        payload = response.json()
        assert "prompt_token_ids" not in payload
        assert all("token_ids" not in c and "prompt_token_ids" not in c
                   for c in payload["choices"])


def test_a_non_boolean_flag_is_a_400(http):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                   "return_token_ids": "yes"})
    assert response.status_code == 400
    assert "return_token_ids" in response.json()["error"]["message"]
