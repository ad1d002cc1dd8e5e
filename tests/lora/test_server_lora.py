"""``prefixcache serve --lora-modules``, through the official ``openai`` client: an adapter
by model name, listing, cache isolation with /metrics, runtime load/unload, bad names."""

from __future__ import annotations

import httpx
import openai
import pytest

from prefixcache import LLM, SamplingParams
from tests.entrypoints.conftest import (
    MODEL_NAME,
    ServerProcess,
    assert_clean_exit,
    wait_for_idle,
)

PROMPT = "the quick brown fox jumps over the lazy dog, again and again."
HITS = "prefixcache:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, lora_a):
    process = ServerProcess(tiny_model_dir, "--block-size", "4", "--num-kv-blocks", "256",
                            "--enable-lora", "--max-loras", "2",
                            "--lora-modules", f"adapter-a={lora_a.lora_path}")
    yield process
    assert_clean_exit(process)


@pytest.fixture
def client(lora_server):
    with openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


@pytest.fixture
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=60) as client:
        yield client


def complete(client, model, prompt=PROMPT):
    return client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                      temperature=0)


def test_models_lists_adapters_with_their_parent(client, lora_a):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "adapter-a"}
    assert cards["adapter-a"].parent == MODEL_NAME
    assert cards["adapter-a"].root == lora_a.lora_path
    assert getattr(cards[MODEL_NAME], "parent", None) is None


def test_a_request_naming_an_adapter_runs_with_it(client, tiny_model_dir, lora_a):
    adapted = complete(client, "adapter-a", "hello world! blocks")
    base = complete(client, MODEL_NAME, "hello world! blocks")
    assert adapted.model == "adapter-a"
    llm = LLM(str(tiny_model_dir), enable_lora=True, num_kv_blocks=64)
    expected = llm.generate("hello world! blocks", SamplingParams(temperature=0, max_tokens=5),
                            lora_request=lora_a)[0].outputs[0].text
    assert adapted.choices[0].text == expected
    assert base.choices[0].text != expected


def test_adapter_and_base_share_no_cache_and_metrics_agree(client, http):
    prompt = "prefix caching reuses the key and value blocks of prompts that share a prefix."
    hits_before = wait_for_idle(http)[HITS]
    base = complete(client, MODEL_NAME, prompt)
    first = complete(client, "adapter-a", prompt)
    second = complete(client, "adapter-a", prompt)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (base, first, second)]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0
    assert wait_for_idle(http)[HITS] - hits_before == cached[2]


def test_load_and_unload_at_run_time(client, lora_a, lora_b):
    message = client.post("/load_lora_adapter", cast_to=str,
                          body={"lora_name": "adapter-b", "lora_path": lora_b.lora_path})
    assert "adapter-b" in message
    assert "adapter-b" in {card.id for card in client.models.list().data}
    assert complete(client, "adapter-b").choices[0].text
    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        client.post("/load_lora_adapter", cast_to=str,
                    body={"lora_name": "adapter-b", "lora_path": lora_b.lora_path})
    client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "adapter-b"})
    assert "adapter-b" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "adapter-b")
    assert info.value.body["code"] == "model_not_found"
    # Back from the same folder it is served again; under another folder the name is
    # refused, since KV cached under it may remain.
    client.post("/load_lora_adapter", cast_to=str,
                body={"lora_name": "adapter-b", "lora_path": lora_b.lora_path})
    assert complete(client, "adapter-b").usage.prompt_tokens_details.cached_tokens > 0
    client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "adapter-b"})
    with pytest.raises(openai.BadRequestError, match="until removed"):
        client.post("/load_lora_adapter", cast_to=str,
                    body={"lora_name": "adapter-b", "lora_path": lora_a.lora_path})


def test_bad_names_and_folders_are_openai_errors(client, tmp_path):
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "no-such-adapter")
    assert info.value.body["param"] == "model" and "no-such-adapter" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "nope"})
    assert info.value.body["code"] == "lora_adapter_not_found"
    with pytest.raises(openai.NotFoundError, match="no adapter folder"):
        client.post("/load_lora_adapter", cast_to=str,
                    body={"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")})
    with pytest.raises(openai.BadRequestError, match="base model's name"):
        client.post("/load_lora_adapter", cast_to=str,
                    body={"lora_name": MODEL_NAME, "lora_path": str(tmp_path)})
    with pytest.raises(openai.BadRequestError, match="lora_path"):
        client.post("/load_lora_adapter", cast_to=str, body={"lora_name": "x"})


def test_load_without_enable_lora_is_refused(tiny_model_dir, lora_b):
    process = ServerProcess(tiny_model_dir, "--block-size", "4", "--num-kv-blocks", "32")
    try:
        with openai.OpenAI(base_url=process.url + "/v1", api_key="unused",
                           max_retries=0, timeout=60) as client, \
                pytest.raises(openai.BadRequestError, match="not enabled"):
            client.post("/load_lora_adapter", cast_to=str,
                        body={"lora_name": "b", "lora_path": lora_b.lora_path})
    finally:
        assert_clean_exit(process)


def test_serve_refuses_a_bad_lora_module_before_serving(tiny_model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="LoRA adapter 'gone': no adapter folder"):
        ServerProcess(tiny_model_dir, "--num-kv-blocks", "32",
                      "--lora-modules", f"gone={tmp_path / 'nowhere'}")


def test_load_and_unload_are_operator_only(tiny_model_dir, lora_a, lora_b):
    process = ServerProcess(tiny_model_dir, "--num-kv-blocks", "32", "--api-key", "user-key",
                            "--admin-api-key", "admin-key",
                            "--lora-modules", f"adapter-a={lora_a.lora_path}")
    try:
        def client_with(key):
            return openai.OpenAI(base_url=process.url + "/v1", api_key=key, max_retries=0,
                                 timeout=60)

        body = {"lora_name": "adapter-b", "lora_path": lora_b.lora_path}
        with client_with("user-key") as user:
            with pytest.raises(openai.PermissionDeniedError):
                user.post("/load_lora_adapter", cast_to=str, body=body)
            with pytest.raises(openai.PermissionDeniedError):
                user.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "adapter-a"})
            assert complete(user, "adapter-a").choices[0].text  # users may still use it
        with client_with("admin-key") as admin:
            assert "adapter-b" in admin.post("/load_lora_adapter", cast_to=str, body=body)
    finally:
        assert_clean_exit(process)
