"""API keys, tenants and cache salts: unit tests, then a real server with a key file."""

from __future__ import annotations

import itertools
import uuid

import httpx
import openai
import pytest

from prefixcache.entrypoints.openai.tenancy import (
    MAX_CACHE_SALT_CHARS,
    Authenticator,
    AuthError,
    Principal,
    load_api_key_file,
    tenant_cache_salt,
    validate_cache_salt,
)
from tests.entrypoints.conftest import MODEL_NAME, ServerProcess, assert_clean_exit


@pytest.mark.parametrize("salt", ["a", "team-1", "é" * MAX_CACHE_SALT_CHARS, "with space",
                                  "emoji 🙂", "astral \U0001F600"])
def test_valid_salts(salt):
    assert validate_cache_salt(salt) == salt


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), "a\nb", "\x00",
                                  "tab\there", "del\x7f", "c1\x85", "lone \ud800",
                                  "low \udc00", 5, None, ["a"]])
def test_invalid_salts(salt):
    with pytest.raises(ValueError):
        validate_cache_salt(salt)


def test_tenant_salt_is_injective_where_concatenation_is_not():
    pairs = [("a", "b"), ("ab", None), ("a", "b:"), ("a:", "b"), ("ab", ""), ("a", None),
             ("a", "null"), ("a", '"b"'), ('a","b', None), ("a", "b\\"), ("", "ab"),
             ("b", "a")]
    salts = [tenant_cache_salt(tenant, salt) for tenant, salt in pairs]
    assert len(set(salts)) == len(pairs)
    assert tenant_cache_salt("a", "b") == tenant_cache_salt("a", "b")  # deterministic
    for salt in salts:  # opaque: neither the tenant nor the client salt is readable
        assert salt.startswith("t1:") and len(salt) == 3 + 64


def test_key_file_parsing(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\nkey-a alice\n  key-b   bob  \n")
    assert load_api_key_file(path) == {"key-a": "alice", "key-b": "bob"}
    for bad in ("key-a\n", "key-a alice extra\n", "k a\nk b\n", "# only a comment\n"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            load_api_key_file(path)


def test_authenticator_modes():
    open_auth = Authenticator()
    assert open_auth.authenticate(None) == Principal(None)
    assert open_auth.engine_cache_salt(Principal(None), "s") == "s"  # vLLM-compatible

    tenants = Authenticator({"k1": "alice", "k2": "bob"})
    assert tenants.authenticate("Bearer k1") == Principal("alice")
    assert tenants.authenticate("bearer  k2 ") == Principal("bob")
    for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1"):
        with pytest.raises(AuthError):
            tenants.authenticate(header)
    assert tenants.engine_cache_salt(Principal("alice"), None) == tenant_cache_salt("alice", None)

    shared = Authenticator(shared_key="secret")
    assert shared.authenticate("Bearer secret") == Principal(None)
    with pytest.raises(AuthError):
        shared.authenticate("Bearer other")
    with pytest.raises(ValueError):
        Authenticator({"k": "t"}, shared_key="secret")


# ---- a real server with tenants -------------------------------------------------------

KEYS = {"key-a": "a", "key-ab": "ab", "key-a2": "a", "key-b": "b"}


@pytest.fixture(scope="module")
def tenant_server(tiny_model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{key} {tenant}\n" for key, tenant in KEYS.items()))
    process = ServerProcess(tiny_model_dir, "--block-size", "4", "--num-kv-blocks", "128",
                            "--api-key-file", str(key_file))
    yield process
    assert_clean_exit(process)


def client_for(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def cached_tokens(server, key, prompt, salt=None):
    with client_for(server, key) as client:
        response = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0.0,
            extra_body=None if salt is None else {"cache_salt": salt})
    return response.usage.prompt_tokens_details.cached_tokens


def test_requests_need_a_known_key(tenant_server):
    for key in ("wrong-key", ""):
        with client_for(tenant_server, key or "x") as client, \
                pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    response = httpx.post(tenant_server.url + "/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    for path in ("/v1/models",):
        assert httpx.get(tenant_server.url + path, timeout=30).status_code == 401
    assert httpx.post(tenant_server.url + "/reset_prefix_cache", timeout=30).status_code == 401
    # Probes and scrapers need no key.
    assert httpx.get(tenant_server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(tenant_server.url + "/metrics", timeout=30).status_code == 200
    with client_for(tenant_server, "key-a") as client:
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_a_tenant_shares_its_own_cache_across_its_keys(tenant_server):
    prompt = f"{uuid.uuid4().hex} The quick brown fox jumps over the lazy dog."
    assert cached_tokens(tenant_server, "key-a", prompt) == 0
    assert cached_tokens(tenant_server, "key-a", prompt) > 0
    assert cached_tokens(tenant_server, "key-a2", prompt) > 0  # same tenant, other key


def test_tenants_never_share_whatever_salt_they_send(tenant_server):
    prompt = f"{uuid.uuid4().hex} A gentle breeze stirred the leaves."
    # Warm every (tenant, salt) combination below once from tenant "a" with salt "b".
    assert cached_tokens(tenant_server, "key-a", prompt, salt="b") == 0
    assert cached_tokens(tenant_server, "key-a", prompt, salt="b") > 0
    # Tenant "ab" without a salt would collide with ("a", "b") under concatenation.
    assert cached_tokens(tenant_server, "key-ab", prompt) == 0
    # Tenant "b" cannot reach it by sending tenant a's salt, or a salt that spells
    # tenant a's engine-side salt.
    assert cached_tokens(tenant_server, "key-b", prompt, salt="b") == 0
    assert cached_tokens(tenant_server, "key-b", prompt,
                         salt=tenant_cache_salt("a", "b")) == 0
    # And within tenant a, salts still partition.
    assert cached_tokens(tenant_server, "key-a", prompt) == 0
    assert cached_tokens(tenant_server, "key-a", prompt, salt="c") == 0
    assert cached_tokens(tenant_server, "key-a2", prompt, salt="b") > 0


def test_every_tenant_pair_is_isolated(tenant_server):
    prompt = f"{uuid.uuid4().hex} Prefix caching reuses the key and value blocks."
    keys = ["key-a", "key-ab", "key-b"]
    for first, second in itertools.permutations(keys, 2):
        salted_prompt = f"{first}->{second} {prompt}"
        cached_tokens(tenant_server, first, salted_prompt)
        assert cached_tokens(tenant_server, second, salted_prompt) == 0
        assert cached_tokens(tenant_server, first, salted_prompt) > 0
