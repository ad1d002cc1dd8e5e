"""SIGTERM with ``--shutdown-timeout``: the server stops admitting, lets the requests in
flight finish, then exits; past the timeout, what still runs ends with the 503 error."""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.entrypoints.conftest import MODEL_NAME, ServerProcess, scrape

SHUTTING_DOWN = {"message": "the server is shutting down", "type": "server_error",
                 "param": None, "code": "engine_unavailable"}


def sigterm_during_a_stream(request: dict, *server_args: str,
                            model_dir) -> tuple[list[str], str]:
    """Start a server, a streamed request, SIGTERM the server once it generates; return
    the rest of the stream and the server's log, after checking its exit was clean."""
    process = ServerProcess(model_dir, *server_args)
    try:
        with httpx.Client(base_url=process.url, timeout=120) as client, \
                client.stream("POST", "/v1/completions",
                              json={**request, "stream": True}) as stream:
            lines = (line for line in stream.iter_lines() if line)
            assert next(lines).startswith('data: {"id":')  # generating
            process.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        returncode = process.stop()
    finally:
        process.stop()
    log = "".join(process.log)
    assert returncode == -signal.SIGTERM, log
    assert "Traceback" not in log, log
    return rest, log


def test_sigterm_lets_a_running_request_finish(tiny_model_dir):
    rest, log = sigterm_during_a_stream(
        {"model": MODEL_NAME, "prompt": "a", "max_tokens": 120, "ignore_eos": True},
        "--shutdown-timeout", "60", model_dir=tiny_model_dir)
    assert "draining" in log
    assert rest[-1] == "data: [DONE]"
    last_chunk = json.loads(rest[-2].removeprefix("data: "))
    assert last_chunk["choices"][0]["finish_reason"] == "length"


def test_past_the_shutdown_timeout_running_requests_end_with_503(tiny_model_dir):
    # One sequence at a time, 8 x 16 sequences of 500 tokens: minutes of work.
    rest, log = sigterm_during_a_stream(
        {"model": MODEL_NAME, "prompt": ["a"] * 8, "n": 16, "max_tokens": 500},
        "--shutdown-timeout", "0.5", "--max-num-seqs", "1", model_dir=tiny_model_dir)
    assert "still in flight; aborting" in log
    error = json.dumps({"error": SHUTTING_DOWN}, separators=(",", ":"))
    assert rest[-2:] == [f"data: {error}", "data: [DONE]"]


def test_while_draining_health_is_503_and_new_requests_are_refused(tiny_model_dir):
    process = ServerProcess(tiny_model_dir, "--shutdown-timeout", "60", "--max-num-seqs",
                            "1")
    long_request = {"model": MODEL_NAME, "prompt": ["a"] * 8, "n": 16, "max_tokens": 500,
                    "stream": True}
    try:
        # A connection opened before the signal, kept alive, asks during the drain.
        with httpx.Client(base_url=process.url, timeout=60) as probe, \
                httpx.Client(base_url=process.url, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=long_request) as stream:
            lines = (line for line in stream.iter_lines() if line)
            assert next(lines).startswith('data: {"id":')
            assert probe.get("/health").status_code == 200
            process.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while "draining" not in "".join(process.log):  # the reader thread fills it
                assert time.monotonic() < deadline and process.process.poll() is None
                time.sleep(0.02)
            health = probe.get("/health")
            refused = probe.post("/v1/completions",
                                 json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 1})
            values = scrape(probe)
            assert values["prefixcache:num_requests_running"] == 1
    finally:
        process.stop(signal.SIGINT)  # a second signal cuts the drain short
    assert health.status_code == 503
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "the server is shutting down"
    assert "Traceback" not in "".join(process.log)
