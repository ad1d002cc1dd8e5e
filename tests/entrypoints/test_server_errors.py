"""Bad input never crashes the server or leaks blocks, and gets OpenAI's error JSON with
the right status."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.conftest import MODEL_NAME, ServerProcess, assert_clean_exit, wait_for_idle

CONTEXT = 512  # tiny_model.MAX_POSITION_EMBEDDINGS
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **fields}


def without(body, field):
    return {k: v for k, v in body.items() if k != field}


def error_of(response) -> dict:
    """The error of ``response``, checked to be written as every error of the server is:
    compact JSON (no spaces after separators, non-ASCII as is)."""
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert response.content == json.dumps(body, ensure_ascii=False,
                                          separators=(",", ":")).encode("utf-8")
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


BAD_REQUESTS = [
    # (id, path, body, status, param)
    ("missing-prompt", COMPLETIONS, without(completion(), "prompt"), 400, "prompt"),
    ("missing-messages", CHAT, without(chat(), "messages"), 400, "messages"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("empty-token-list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("empty-prompt-in-batch", COMPLETIONS, completion(prompt=["a", ""]), 400, "prompt"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown-model", COMPLETIONS, completion(model="gpt-9"), 404, "model"),
    ("unknown-model-chat", CHAT, chat(model="gpt-9"), 404, "model"),
    ("max-tokens-zero", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    ("max-tokens-beyond-context", COMPLETIONS, completion(max_tokens=CONTEXT), 400,
     "max_tokens"),
    ("max-completion-tokens-beyond-context", CHAT,
     without(chat(max_completion_tokens=10_000), "max_tokens"), 400, "max_tokens"),
    ("max-tokens-disagree", CHAT, chat(max_completion_tokens=5), 400, None),
    ("prompt-beyond-context", COMPLETIONS, completion(prompt=[5] * (CONTEXT + 1)), 400,
     "prompt"),
    ("prompt-fills-context", COMPLETIONS, completion(prompt=[5] * CONTEXT), 400, "prompt"),
    ("temperature-negative", COMPLETIONS, completion(temperature=-0.1), 400, "temperature"),
    ("top-p-zero", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.01), 400, "top_p"),
    ("n-zero", COMPLETIONS, completion(n=0), 400, "n"),
    ("n-too-many", COMPLETIONS, completion(n=1000), 400, "n"),
    ("max-tokens-string", COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature-bool", COMPLETIONS, completion(temperature=True), 400, "temperature"),
    ("n-float", COMPLETIONS, completion(n=2.0), 400, "n"),
    ("stream-string", COMPLETIONS, completion(stream="yes"), 400, "stream"),
    ("prompt-number", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    ("prompt-mixed-list", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    ("messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    ("message-without-role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages"),
    ("message-unknown-role", CHAT, chat(messages=[{"role": "boss", "content": "x"}]), 400,
     "messages"),
    ("image-content", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400,
     "messages"),
    ("stop-number", COMPLETIONS, completion(stop=5), 400, "stop"),
    ("stop-empty", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("seed-string", COMPLETIONS, completion(seed="1"), 400, "seed"),
    ("token-outside-vocab", COMPLETIONS, completion(prompt=[1, 10**6]), 400, "prompt"),
    ("token-outside-vocab-in-batch", COMPLETIONS, completion(prompt=[[1], [2, 10**6]]), 400,
     "prompt"),
    ("negative-token", COMPLETIONS, completion(prompt=[1, -2]), 400, "prompt"),
    ("salt-empty", COMPLETIONS, completion(cache_salt=""), 400, "cache_salt"),
    ("salt-too-long", COMPLETIONS, completion(cache_salt="s" * 129), 400, "cache_salt"),
    ("salt-newline", CHAT, chat(cache_salt="a\nb"), 400, "cache_salt"),
    ("salt-nul", COMPLETIONS, completion(cache_salt="a\x00"), 400, "cache_salt"),
    ("salt-number", COMPLETIONS, completion(cache_salt=7), 400, "cache_salt"),
    ("logprobs", COMPLETIONS, completion(logprobs=5), 400, None),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), 400, None),
    ("stream-options-without-stream", COMPLETIONS,
     completion(stream_options={"include_usage": True}), 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:  # the field, or a path inside it (messages.0.role)
        assert error["param"].split(".")[0] == param, error


# Lone UTF-16 surrogates: valid JSON escapes that decode to no Unicode text. Sent with
# json.dumps (ASCII escapes), as httpx's own encoder cannot write them.
LONE_SURROGATES = [
    # (id, path, body, param)
    ("prompt", COMPLETIONS, completion(prompt="a\ud800b"), "prompt"),
    ("prompt-low-half", COMPLETIONS, completion(prompt="\udc00"), "prompt"),
    ("prompt-in-batch", COMPLETIONS, completion(prompt=["fine", "x\ud83d"]), "prompt"),
    ("message-content", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}]),
     "messages"),
    ("content-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}]}]), "messages"),
    ("system-message", CHAT, chat(messages=[{"role": "system", "content": "be \ud800"},
                                            {"role": "user", "content": "hi"}]), "messages"),
    ("stop", COMPLETIONS, completion(stop="\ud800"), "stop"),
    ("stop-in-list", CHAT, chat(stop=["x", "\ud800"]), "stop"),
    ("model", CHAT, chat(model="\ud800"), "model"),
    ("cache-salt", COMPLETIONS, completion(cache_salt="s\ud800"), "cache_salt"),
]


@pytest.mark.parametrize(("path", "body", "param"), [case[1:] for case in LONE_SURROGATES],
                         ids=[case[0] for case in LONE_SURROGATES])
def test_lone_surrogate_is_400_naming_the_field(server, http, path, body, param):
    num_log_lines = len(server.log)
    response = http.post(path, content=json.dumps(body),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"].split(".")[0] == param, error
    assert "lone UTF-16 surrogate" in error["message"], error
    assert "Traceback" not in "".join(server.log[num_log_lines:])


@pytest.mark.parametrize("text", ["pair \ud83d\ude00 here", "raw 🙂 emoji", "nul \u0000 in"],
                         ids=["surrogate-pair", "emoji", "nul"])
def test_valid_unicode_text_is_served(http, text):
    # json.dumps writes the pair as two escapes, which the server decodes to one U+1F600.
    bodies = [(COMPLETIONS, completion(prompt=[text, "plain"], stop=text, max_tokens=2)),
              (CHAT, chat(messages=[{"role": "system", "content": text},
                                    {"role": "user", "content": [{"type": "text", "text": text}]}],
                          stop=[text], max_tokens=2))]
    for path, body in bodies:
        response = http.post(path, content=json.dumps(body),
                             headers={"Content-Type": "application/json"})
        assert response.status_code == 200, response.text


def test_engine_errors_name_the_prompt_not_internal_request_ids(http):
    # One prompt: the message is the engine's, without the internal request id.
    response = http.post(COMPLETIONS, json=completion(prompt=[1, 10**6]))
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "1000000" in message
    assert "cmpl-" not in message and not message.startswith("request ")
    # Several prompts: it says which one.
    response = http.post(COMPLETIONS, json=completion(prompt=[[1, 2], [1, 10**6]], n=2))
    message = response.json()["error"]["message"]
    assert response.status_code == 400
    assert message.startswith("prompt 1: ") and "cmpl-" not in message
    assert response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'"text"',
                                 b'{"prompt": "a", "temperature": NaN}', b"\xff\xfe"],
                         ids=["syntax", "empty", "array", "string", "nan", "not-utf8"])
def test_malformed_json_is_400(http, raw):
    response = http.post(COMPLETIONS, content=raw,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_oversized_body_is_413_declared_or_streamed(http):
    big = completion(prompt="x " * 40_000)  # > 64 KiB, the server's limit here
    response = http.post(COMPLETIONS, json=big)
    assert response.status_code == 413
    # Refused by the middleware before any route runs, yet written like every error.
    error = error_of(response)
    assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: the server must count as it reads
        for _ in range(100):
            yield b"x" * 1024

    response = http.post(COMPLETIONS, content=chunks(),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert error_of(response)["code"] == "body_too_large"


def test_unknown_route_and_wrong_method_are_json_errors(http):
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and error_of(response)["message"]
    response = http.get(COMPLETIONS)
    assert response.status_code == 405 and error_of(response)["message"]


def test_openai_client_raises_typed_errors(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError) as excinfo:
        openai_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert excinfo.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=MODEL_NAME, prompt="hi",
                                         extra_body={"cache_salt": "x" * 200})


def test_after_all_bad_input_the_server_is_healthy_and_holds_no_blocks(http, openai_client):
    # Runs after the cases above (file order): nothing crashed, nothing leaked.
    assert http.get("/health").status_code == 200
    wait_for_idle(http)
    response = openai_client.completions.create(model=MODEL_NAME, prompt="still fine",
                                                max_tokens=3)
    assert response.usage.completion_tokens == 3


@pytest.fixture(scope="module")
def small_pool_server(tiny_model_dir):
    # 8 blocks of 4 tokens: a 40-token prompt fits the context (512) but not the pool.
    process = ServerProcess(tiny_model_dir, "--block-size", "4", "--num-kv-blocks", "8")
    yield process
    assert_clean_exit(process)


def test_prompt_larger_than_the_kv_pool_is_400(small_pool_server):
    import httpx

    with httpx.Client(base_url=small_pool_server.url, timeout=60) as client:
        response = client.post(COMPLETIONS, json=completion(prompt=[5] * 40))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "prompt" and "KV cache" in error["message"]
        # A prompt that fits still runs, its generation bounded by the pool.
        response = client.post(COMPLETIONS, json=completion(prompt=[5] * 20, max_tokens=30))
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
        wait_for_idle(client)


def test_preemptions_and_evictions_are_counted(small_pool_server):
    import httpx

    with httpx.Client(base_url=small_pool_server.url, timeout=60) as client:
        before = wait_for_idle(client)
        # One request, two prompts: admitted in the same step. Each grows to 7 of the 8
        # blocks, so one is preempted until the other finishes, and the blocks it then
        # takes were cached by the other: evictions.
        body = completion(prompt=[[5 + i] * 12 for i in range(2)], max_tokens=16,
                          temperature=0)
        response = client.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["length", "length"]
        after = wait_for_idle(client)
    for name in ("prefixcache:num_preemptions_total", "prefixcache:num_evictions_total"):
        assert after[name] > before[name], name
