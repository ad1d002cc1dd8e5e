"""``/tokenize``, ``/detokenize`` and the ``/render`` endpoints give generation's own ids."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import (
    MODEL_NAME,
    SERVER_ARGS,
    ServerProcess,
    assert_clean_exit,
)

TEXT = "Prefix caching reuses the key and value blocks of prompts that share a prefix."
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": TEXT}]


def _prompt_tokens(response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_completion_ids_match_generation(http):
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXT}).json()
    rendered = http.post("/v1/completions/render",
                         json={"model": MODEL_NAME, "prompt": TEXT, "max_tokens": 2}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 5
    assert tokenized["max_model_len"] == 512
    assert [r["token_ids"] for r in rendered] == [tokenized["tokens"]]
    assert rendered[0]["model"] == MODEL_NAME
    assert rendered[0]["sampling_params"]["max_tokens"] == 2
    # The ids generation runs on: sending them as the prompt gives the same text's answer.
    by_text = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": TEXT, "max_tokens": 4, "temperature": 0})
    by_ids = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": tokenized["tokens"], "max_tokens": 4, "temperature": 0})
    assert _prompt_tokens(by_text) == _prompt_tokens(by_ids) == tokenized["count"]
    assert by_text.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    detokenized = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detokenized == {"prompt": TEXT}


def test_chat_ids_match_generation(http):
    tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    rendered = http.post("/v1/chat/completions/render",
                         json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text.endswith(f"{TEXT}\nassistant\n")  # the generation prompt is opened
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0})
    assert _prompt_tokens(chat) == tokenized["count"]


def test_chat_template_options_apply_to_generation_too(http):
    without = http.post("/tokenize", json={"messages": MESSAGES,
                                           "add_generation_prompt": False}).json()
    with_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert with_prompt["tokens"][:without["count"]] == without["tokens"]
    assert without["count"] < with_prompt["count"]
    chat = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "add_generation_prompt": False, "max_tokens": 1})
    assert _prompt_tokens(chat) == without["count"]

    continued = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    rendered = http.post("/v1/chat/completions/render", json={
        "messages": continued, "add_generation_prompt": False,
        "continue_final_message": True}).json()
    text = http.post("/detokenize", json={"tokens": rendered["token_ids"]}).json()["prompt"]
    assert text.endswith("assistant\nThe answer is")  # the turn is left open


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/v1/completions/render", {"prompt": TEXT, "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions/render", {"prompt": TEXT, "echo": True}, None),
    ("/v1/completions/render", {"prompt": [1, 100000]}, "prompt"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "temperature": "hot"},
     "temperature"),
])
def test_bad_input_is_a_400_with_an_openai_error(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_unknown_model_is_a_404(http):
    for path, body in (("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [1]}),
                       ("/v1/completions/render", {"prompt": TEXT}),
                       ("/v1/chat/completions/render", {"messages": MESSAGES})):
        response = http.post(path, json={**body, "model": "nope"})
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "model_not_found"


def test_not_json_is_a_400(http):
    response = http.post("/tokenize", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


API_KEY = "tokenization-test-key"
MAX_PROMPT_BYTES = 1024
ENDPOINT_TO_BODY = {
    "/tokenize": {"model": MODEL_NAME, "prompt": TEXT},
    "/detokenize": {"model": MODEL_NAME, "tokens": [1, 2, 3]},
    "/v1/completions/render": {"model": MODEL_NAME, "prompt": TEXT, "max_tokens": 1},
    "/v1/chat/completions/render": {"model": MODEL_NAME, "messages": MESSAGES},
}


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir, *SERVER_ARGS, "--api-key", API_KEY,
                            "--max-prompt-bytes", str(MAX_PROMPT_BYTES))
    yield process
    assert_clean_exit(process)


@pytest.mark.parametrize("path", sorted(ENDPOINT_TO_BODY))
def test_tokenization_endpoints_need_the_api_key(keyed_server, path):
    body = ENDPOINT_TO_BODY[path]
    with httpx.Client(base_url=keyed_server.url, timeout=60) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            refused = anonymous.post(path, json=body, headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_api_key"
        accepted = anonymous.post(path, json=body,
                                  headers={"Authorization": f"Bearer {API_KEY}"})
        assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions/render",
                                  "/v1/chat/completions/render"])
def test_tokenization_endpoints_take_the_prompt_size_limit(keyed_server, path):
    huge = "x" * (MAX_PROMPT_BYTES + 1)
    body = dict(ENDPOINT_TO_BODY[path])
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": huge}]
    else:
        body["prompt"] = huge
    with httpx.Client(base_url=keyed_server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "prompt_too_large"
