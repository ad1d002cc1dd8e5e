"""A real server with tenants, an operator key and small limits, probed as a hostile client
would: oversized and endless heads, stalls, deep JSON, huge prompts, vanishing uploads,
operator endpoints with a tenant's key, one tenant flooding. Raw sockets where HTTP
clients cannot misbehave enough; the official ``openai`` client where it applies."""

from __future__ import annotations

import socket
import time
import uuid
from contextlib import ExitStack

import httpx
import openai
import pytest

from tests.entrypoints.conftest import (
    MODEL_NAME,
    SERVER_ARGS,
    ServerProcess,
    assert_clean_exit,
    scrape,
    wait_for_idle,
)

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
MAX_HEAD_BYTES = 8 * 1024
MAX_HEADER_COUNT = 50
MAX_URL_LENGTH = 1024
MAX_JSON_DEPTH = 16
MAX_PROMPT_BYTES = 64 * 1024
MAX_REQUESTS_PER_TENANT = 4
HEAD_TIMEOUT_S = 1
BODY_TIMEOUT_S = 1
SOCKET_TIMEOUT_S = 30  # a bound for a failing test, never a measured duration


@pytest.fixture(scope="module")
def hardened(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    (folder / "keys").write_text(f"{ALICE} alice\n{BOB} bob\n")
    (folder / "admin").write_text(f"{ADMIN}\n")
    process = ServerProcess(
        tiny_model_dir, *SERVER_ARGS, "--log-level", "debug",
        "--api-key-file", str(folder / "keys"), "--admin-api-key-file", str(folder / "admin"),
        "--h11-max-incomplete-event-size", str(MAX_HEAD_BYTES),
        "--h11-max-header-count", str(MAX_HEADER_COUNT),
        "--max-url-length", str(MAX_URL_LENGTH),
        "--request-head-timeout", str(HEAD_TIMEOUT_S),
        "--request-body-timeout", str(BODY_TIMEOUT_S),
        "--max-json-depth", str(MAX_JSON_DEPTH), "--max-prompt-bytes", str(MAX_PROMPT_BYTES),
        "--max-requests-per-tenant", str(MAX_REQUESTS_PER_TENANT))
    yield process
    assert_clean_exit(process)
    log = "".join(process.log)
    assert "unhandled error" not in log, log


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def http(server: ServerProcess, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def connect(server: ServerProcess) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def head(target: str = "/health", extra: bytes = b"") -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: x\r\n".encode() + extra + b"\r\n"


# ---- the head ----------------------------------------------------------------------------


@pytest.mark.parametrize("in_pieces", [False, True], ids=["one-piece", "in-pieces"])
def test_a_head_over_the_limit_is_431_and_closed(hardened, in_pieces):
    request = head(extra=b"X-Big: " + b"a" * 100_000 + b"\r\n")
    with connect(hardened) as sock:
        if in_pieces:
            for start in range(0, len(request), 1000):
                try:
                    sock.sendall(request[start:start + 1000])
                except (BrokenPipeError, ConnectionResetError):
                    break  # refused before the end: as it should
        else:
            sock.sendall(request)
        response = read_all(sock)
    assert status_of(response) == 431, response[:200]
    assert b'"code":"headers_too_large"' in response


def test_too_many_headers_is_431(hardened):
    extra = b"".join(b"X-%d: v\r\n" % i for i in range(2 * MAX_HEADER_COUNT))
    with http(hardened) as client_:
        response = client_.get("/health", headers={f"X-{i}": "v" for i in range(2000)})
    assert response.status_code == 431, response.text
    with connect(hardened) as sock:
        sock.sendall(head(extra=extra))
        assert status_of(read_all(sock)) == 431


def test_a_long_url_is_414(hardened):
    with http(hardened, ALICE) as client_:
        response = client_.get("/v1/models?" + "q" * (2 * MAX_URL_LENGTH))
        assert response.status_code == 414
        assert response.json()["error"]["code"] == "url_too_long"
        assert client_.get("/v1/models?q=1").status_code == 200


def test_a_stalled_head_is_408_and_closed(hardened):
    with connect(hardened) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        response = read_all(sock)
    assert status_of(response) == 408
    assert b'"code":"request_timeout"' in response


def test_a_connection_that_sends_nothing_is_closed(hardened):
    with connect(hardened) as sock:
        assert read_all(sock) == b""


def test_a_keep_alive_connection_gets_a_head_deadline_again(hardened):
    with connect(hardened) as sock:
        sock.sendall(head())
        time.sleep(0.1)
        sock.sendall(b"GET /hea")  # the next request's head, never finished
        response = read_all(sock)
    assert response.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1 408" in response


def test_a_stalled_body_is_408(hardened):
    body_head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}"
                 "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    with connect(hardened) as sock:
        sock.sendall(body_head + b'{"prompt": "a')  # 13 of 100 bytes, then nothing
        response = read_all(sock)
    assert status_of(response) == 408, response
    assert b'"code":"request_timeout"' in response


def test_a_client_gone_during_upload_is_logged_quietly(hardened):
    body_head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}"
                 "\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    num_lines = len(hardened.log)
    with connect(hardened) as sock:
        sock.sendall(body_head + b'{"prompt": "abc')
    deadline = time.monotonic() + SOCKET_TIMEOUT_S
    while not any("client disconnected" in line for line in hardened.log[num_lines:]):
        assert time.monotonic() < deadline, "".join(hardened.log[num_lines:])
        time.sleep(0.05)
    new_lines = "".join(hardened.log[num_lines:])
    assert "Traceback" not in new_lines and "ERROR" not in new_lines, new_lines


# ---- the body ----------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}",
    b'{"model": "tiny", "prompt": "a", "unknown": ' + b'{"x":' * 50_000 + b"1"
    + b"}" * 50_000 + b"}",
], ids=["deep-prompt", "deep-unknown-field"])
def test_deeply_nested_json_is_400(hardened, body):
    with http(hardened, ALICE) as client_:
        response = client_.post("/v1/completions", content=body,
                                headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "json_too_deep" and f"at most {MAX_JSON_DEPTH}" in error["message"]


def test_a_prompt_over_the_byte_limit_is_400_before_tokenizing(hardened):
    with client(hardened, ALICE) as alice, pytest.raises(openai.BadRequestError) as info:
        alice.completions.create(model=MODEL_NAME, prompt="a" * (MAX_PROMPT_BYTES + 1),
                                 max_tokens=1)
    assert info.value.code == "prompt_too_large"
    with client(hardened, ALICE) as alice, pytest.raises(openai.BadRequestError) as info:
        alice.chat.completions.create(
            model=MODEL_NAME, max_tokens=1,
            messages=[{"role": "user", "content": "é" * (MAX_PROMPT_BYTES // 2 + 1)}])
    assert info.value.code == "prompt_too_large"


# ---- roles -------------------------------------------------------------------------------


def test_only_the_operator_may_reset_the_prefix_cache(hardened):
    with http(hardened, ALICE) as alice, http(hardened, ADMIN) as admin, \
            http(hardened) as anonymous:
        response = alice.post("/reset_prefix_cache", params={"abort_running": "true"})
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"
        assert anonymous.post("/reset_prefix_cache").status_code == 401
        wait_for_idle(admin)
        response = admin.post("/reset_prefix_cache")
        assert response.status_code == 200 and response.json() == {"success": True}


def test_the_operator_key_cannot_generate_as_a_tenant(hardened):
    with client(hardened, ADMIN) as admin, pytest.raises(openai.PermissionDeniedError):
        admin.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=1)


def test_a_tenant_cannot_abort_another_tenants_stream(hardened):
    with client(hardened, BOB) as bob, http(hardened, ALICE) as alice:
        stream = bob.completions.create(model=MODEL_NAME, prompt=f"{uuid.uuid4()} story",
                                        max_tokens=60, stream=True, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        assert alice.post("/reset_prefix_cache",
                          params={"abort_running": "true"}).status_code == 403
        finish_reasons = [c.choices[0].finish_reason for c in [first, *chunks] if c.choices]
    assert finish_reasons[-1] == "length"


# ---- fairness ----------------------------------------------------------------------------


def test_a_tenant_past_its_limit_gets_429_and_others_are_served(hardened):
    long_request = {"model": MODEL_NAME, "prompt": "flood", "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
    with http(hardened, BOB) as bob, http(hardened, ALICE) as alice, ExitStack() as streams:
        for _ in range(MAX_REQUESTS_PER_TENANT):  # held open until the ExitStack closes
            stream = streams.enter_context(bob.stream("POST", "/v1/completions",
                                                      json=long_request))
            assert stream.status_code == 200
        refused = bob.post("/v1/completions", json={**long_request, "stream": False})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        with client(hardened, BOB) as bob_openai, pytest.raises(openai.RateLimitError):
            bob_openai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
        served = alice.post("/v1/completions",
                            json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert served.status_code == 200
        values = scrape(alice)
        assert values['prefixcache:tenant_num_requests{tenant="bob"}'] == \
            MAX_REQUESTS_PER_TENANT
        assert values['prefixcache:tenant_requests_rejected_total{tenant="bob"}'] >= 2
        assert values['prefixcache:tenant_requests_rejected_total{tenant="alice"}'] == 0
    with http(hardened, ALICE) as alice:
        values = wait_for_idle(alice)
    assert values['prefixcache:tenant_num_requests{tenant="bob"}'] == 0


def test_after_every_probe_the_server_is_healthy_and_holds_no_blocks(hardened):
    with http(hardened, ALICE) as alice:
        assert alice.get("/health").status_code == 200
        values = wait_for_idle(alice)
    assert values["prefixcache:kv_cache_usage_perc"] == 0
