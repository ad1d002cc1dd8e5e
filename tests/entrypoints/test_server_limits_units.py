"""The edge limits, roles, admission and options as units, without a server process."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import httpx
import pytest

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.engine.stats import EngineStats
from prefixcache.entrypoints.openai.admission import Admission, TenantStats
from prefixcache.entrypoints.openai.api_server import build_app
from prefixcache.entrypoints.openai.errors import APIError
from prefixcache.entrypoints.openai.limits import (
    check_json_depth,
    check_prompt_bytes,
    json_nesting_depth,
)
from prefixcache.entrypoints.openai.metrics import ServerMetrics
from prefixcache.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from prefixcache.entrypoints.openai.server_args import ServerArgs
from prefixcache.entrypoints.openai.serving import ModelInfo
from prefixcache.entrypoints.openai.tenancy import (
    Authenticator,
    ForbiddenError,
    load_admin_api_key_file,
)
from prefixcache.entrypoints.openai.worker_pool import INLINE_MAX_CHARS
from tests.entrypoints.fake_engine import FakeEngine


@pytest.mark.parametrize(("value", "depth"), [
    (1, 0), ([], 1), ({}, 1), ([[1, 2], [3]], 2), ({"a": [{"b": []}]}, 4),
    ("[[[{{", 0), ({"[": "]]]]", "k": [r'\"[[['], "q": "\\"}, 2),
])
def test_json_nesting_depth_ignores_brackets_inside_strings(value, depth):
    assert json_nesting_depth(json.dumps(value).encode()) == depth


def test_too_deep_json_is_a_400_that_says_so():
    deep_list = b"[" * 100_000 + b"1" + b"]" * 100_000
    deep_object = b'{"x":' * 50_000 + b"1" + b"}" * 50_000
    for body in (deep_list, deep_object):
        with pytest.raises(APIError) as info:
            check_json_depth(body, 64)
        assert info.value.status == 400 and info.value.code == "json_too_deep"
        assert "at most 64" in info.value.message
    check_json_depth(b"[" * 64 + b"]" * 64, 64)  # at the limit: accepted


def test_prompt_bytes_are_counted_in_utf8_before_tokenizing():
    limit = 1000
    check_prompt_bytes(CompletionRequest(prompt="a" * limit), limit)
    check_prompt_bytes(CompletionRequest(prompt=[1] * 10 * limit), limit)  # token ids
    for request, param in (
        (CompletionRequest(prompt="é" * (limit // 2 + 1)), "prompt"),  # 2 bytes each
        (CompletionRequest(prompt=["a" * 600, "b" * 600]), "prompt"),  # summed
        (ChatCompletionRequest(messages=[{"role": "user", "content": "x" * 700},
                                         {"role": "user", "content": "y" * 400}]),
         "messages"),
    ):
        with pytest.raises(APIError) as info:
            check_prompt_bytes(request, limit)
        assert (info.value.status, info.value.param, info.value.code) == \
            (400, param, "prompt_too_large")


def test_operator_role_in_each_mode():
    tenants = Authenticator({"ka": "alice"}, admin_key="root")
    alice = tenants.authenticate("Bearer ka")
    operator = tenants.authenticate("Bearer root")
    assert operator.is_operator and not alice.is_operator
    tenants.check_operator(operator)
    with pytest.raises(ForbiddenError):
        tenants.check_operator(alice)
    with pytest.raises(ForbiddenError):  # the operator key names no tenant
        tenants.engine_cache_salt(operator, None)
    no_admin = Authenticator({"ka": "alice"})
    with pytest.raises(ForbiddenError):
        no_admin.check_operator(no_admin.authenticate("Bearer ka"))
    # Open mode without an admin key: as before roles existed, anyone accepted may.
    for auth, header in ((Authenticator(), None), (Authenticator(shared_key="s"), "Bearer s")):
        auth.check_operator(auth.authenticate(header))
    open_with_admin = Authenticator(admin_key="root")
    with pytest.raises(ForbiddenError):
        open_with_admin.check_operator(open_with_admin.authenticate(None))
    assert open_with_admin.engine_cache_salt(open_with_admin.authenticate("Bearer root"),
                                             "s") == "s"
    with pytest.raises(ValueError):
        Authenticator({"root": "alice"}, admin_key="root")


def test_admin_key_file(tmp_path):
    path = tmp_path / "admin"
    path.write_text("# the operator key\n\n  s3cret  \n")
    assert load_admin_api_key_file(path) == "s3cret"
    path.write_text("# nothing\n")
    with pytest.raises(ValueError):
        load_admin_api_key_file(path)
    with pytest.raises(ValueError):
        load_admin_api_key_file(tmp_path / "missing")


def test_server_args_round_trip_through_the_command_line():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--h11-max-header-count", "7", "--max-prompt-bytes", "2KiB",
         "--shutdown-timeout", "2.5", "--max-requests-per-tenant", "3"]))
    assert (args.h11_max_header_count, args.max_prompt_bytes, args.shutdown_timeout,
            args.max_requests_per_tenant) == (7, 2048, 2.5, 3)
    with pytest.raises(ValueError):
        ServerArgs.from_cli_args(parser.parse_args(
            ["--admin-api-key", "a", "--admin-api-key-file", "f"]))


def test_admission_limits_each_tenant_and_drains():
    async def scenario() -> None:
        admission = Admission(("alice", "bob"), 4)
        first = admission.admit("alice", 3)
        with pytest.raises(APIError) as info:
            admission.admit("alice", 2)
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
        bob = admission.admit("bob", 4)  # one tenant's load never refuses another
        first.release()
        first.release()  # idempotent
        second = admission.admit("alice", 4)
        admission.start_draining()
        with pytest.raises(APIError) as info:
            admission.admit("bob", 0)
        assert info.value.status == 503
        assert not await admission.wait_idle(0.01)
        bob.release()
        second.release()
        assert await admission.wait_idle(1)

    asyncio.run(scenario())


def test_tenant_stats_are_counted_and_exposed_per_tenant():
    admission = Admission(("alice", "bob"), 2)
    metrics = ServerMetrics(EngineStats)
    metrics.add_stats(TenantStats, lambda: admission.tenant_to_stats, label="tenant")
    held = admission.admit("alice", 2)
    with pytest.raises(APIError):
        admission.admit("alice", 1)
    admission.admit("bob", 1).release()
    admission.admit(None, 5).release()  # open mode: no tenant, no tenant figures
    assert admission.tenant_to_stats == {
        "alice": TenantStats(requests_admitted=1, requests_rejected=1, num_requests=2),
        "bob": TenantStats(requests_admitted=1, requests_rejected=0, num_requests=0)}
    text = metrics.render().decode()
    for line in ('prefixcache:tenant_requests_admitted_total{tenant="alice"} 1.0',
                 'prefixcache:tenant_requests_rejected_total{tenant="alice"} 1.0',
                 'prefixcache:tenant_num_requests{tenant="alice"} 2.0',
                 'prefixcache:tenant_requests_admitted_total{tenant="bob"} 1.0',
                 'prefixcache:tenant_num_requests{tenant="bob"} 0.0'):
        assert line in text.splitlines(), line
    assert "# TYPE prefixcache:tenant_num_requests gauge" in text
    held.release()
    assert 'prefixcache:tenant_num_requests{tenant="alice"} 0.0' in metrics.render().decode()


class BlockingTokenizer:
    """Encodes a large text only once ``may_finish`` is set, so a test can check what the
    server does meanwhile; records the thread each encode ran on."""

    def __init__(self) -> None:
        self.may_finish = threading.Event()
        self.encode_threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.encode_threads.append(threading.current_thread().name)
        if len(text) >= INLINE_MAX_CHARS:
            assert self.may_finish.wait(30), "never released"
        return [1, 2, 3]


def test_a_large_prompt_is_tokenized_off_the_event_loop():
    # If the large prompt were tokenized on the event loop, /health and the small request
    # could not be answered before the encode returns, and it returns only after they are.
    tokenizer = BlockingTokenizer()
    llm = AsyncLLM(FakeEngine())
    model_info = ModelInfo(served_model_names=("m",), root="m", max_model_len=64,
                           num_kv_blocks=16, block_size=4)
    app = build_app(llm, tokenizer, model_info)

    async def scenario() -> tuple[int, int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://server", timeout=60) as client:
            large = asyncio.ensure_future(client.post(
                "/v1/completions", json={"prompt": "a" * INLINE_MAX_CHARS, "max_tokens": 2}))
            while not tokenizer.encode_threads:
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            small = await client.post("/v1/completions",
                                      json={"prompt": "small", "max_tokens": 2})
            tokenizer.may_finish.set()
            return health.status_code, small.status_code, (await large).status_code

    try:
        assert asyncio.run(scenario()) == (200, 200, 200)
    finally:
        llm.shutdown()
        app.state.tokenizer_pool.shutdown()
    assert tokenizer.encode_threads[0].startswith("tokenizer")
    assert tokenizer.encode_threads[1] == "MainThread"  # small: inline
