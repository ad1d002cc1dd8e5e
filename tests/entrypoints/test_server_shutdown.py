"""Stopping the server while requests run (Ctrl-C, SIGTERM): each request in flight ends
at once with an OpenAI-style error, nothing is logged as a crash, and the exit status is
the signal's (130 for Ctrl-C, death by SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.entrypoints.openai.api_server import build_app
from prefixcache.entrypoints.openai.serving import ModelInfo
from tests.entrypoints.conftest import MODEL_NAME, ServerProcess, scrape
from tests.entrypoints.fake_engine import FakeEngine

SHUTTING_DOWN = {"message": "the server is shutting down", "type": "server_error",
                 "param": None, "code": "engine_unavailable"}
# One sequence at a time (--max-num-seqs 1), 8 prompts x 16 choices x 500 tokens: each
# request would run for minutes, so both are surely in flight when the signal comes.
LONG_REQUEST = {"model": MODEL_NAME, "prompt": ["a"] * 8, "n": 16, "max_tokens": 500}
NUM_SEQUENCES = 8 * 16


def compact(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def wait_until_queued(client: httpx.Client, num_requests: int, timeout_s: float = 30) -> None:
    """Poll ``/metrics`` until ``num_requests`` engine requests run or wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(client)
        num_queued = (values["prefixcache:num_requests_running"]
                      + values["prefixcache:num_requests_waiting"])
        if num_queued >= num_requests:
            return
        assert time.monotonic() < deadline, f"requests never queued: {values}"
        time.sleep(0.02)


@pytest.mark.parametrize(("signum", "returncode"), [(signal.SIGINT, 130),
                                                     (signal.SIGTERM, -signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm"])
def test_shutdown_ends_requests_in_flight_with_an_error(tiny_model_dir, signum, returncode):
    process = ServerProcess(tiny_model_dir, "--max-num-seqs", "1")
    try:
        with httpx.Client(base_url=process.url, timeout=60) as streaming, \
                httpx.Client(base_url=process.url, timeout=60) as plain, \
                httpx.Client(base_url=process.url, timeout=60) as probe, \
                ThreadPoolExecutor(1) as pool, \
                streaming.stream("POST", "/v1/completions",
                                 json={**LONG_REQUEST, "stream": True}) as stream:
            lines = (line for line in stream.iter_lines() if line)
            assert next(lines).startswith('data: {"id":')  # generating
            pending = pool.submit(plain.post, "/v1/completions", json=LONG_REQUEST)
            wait_until_queued(probe, 2 * NUM_SEQUENCES)
            assert process.stop(signum) == returncode
            response = pending.result(timeout=30)
            rest = list(lines)
    finally:
        process.stop()
    log = "".join(process.log)
    assert "Traceback" not in log, log
    assert "graceful shutdown exceeded" not in log, log  # nobody waited for the timeout
    # The non-streaming client: OpenAI's error JSON, written like every other error.
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.text == compact({"error": SHUTTING_DOWN})
    # The streaming client: what was generated, then the error event and the end.
    assert rest[-2:] == [f"data: {compact({'error': SHUTTING_DOWN})}", "data: [DONE]"]
    assert all(line.startswith('data: {"id":') for line in rest[:-2])


def test_once_the_engine_stopped_every_route_needing_it_answers_503():
    # What a request arriving during the shutdown meets: the AsyncLLM already shut down.
    llm = AsyncLLM(FakeEngine())
    llm.shutdown()
    model_info = ModelInfo(served_model_names=(MODEL_NAME,), root=MODEL_NAME,
                           max_model_len=64, num_kv_blocks=16, block_size=4)
    app = build_app(llm, tokenizer=None, model_info=model_info)

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://server") as client:
            return [await client.post("/v1/completions",
                                      json={"prompt": [1, 2], "max_tokens": 2}),
                    await client.post("/reset_prefix_cache"),
                    await client.get("/health")]

    for response in asyncio.run(ask()):
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["message"]
