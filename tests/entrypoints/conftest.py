"""Real servers on loopback for the server tests.

``ServerProcess`` runs ``python -m prefixcache serve`` on a tiny random model with
``--port 0`` and takes the URL from the server's one "ready" line, so there is no port
race. Every wait is bounded; a server that does not come up fails the test with its log.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.tiny_model import build_tiny_model

STARTUP_TIMEOUT_S = 120
READY_PATTERN = re.compile(r"ready: serving \S+ at (http://127\.0\.0\.1:\d+)")
MODEL_NAME = "tiny"
REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A ``prefixcache serve`` subprocess; ``url`` once ready, ``log`` its stderr lines."""

    def __init__(self, model_dir: Path, *extra_args: str) -> None:
        command = [sys.executable, "-m", "prefixcache", "serve", str(model_dir),
                   "--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL_NAME,
                   *extra_args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()
        # Drain stderr for the server's whole life: a full pipe would block it.
        self._reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self._reader.start()
        self.url = self._wait_ready(lines)

    def _read(self, lines: queue.Queue) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            lines.put(line)
        lines.put(None)

    def _wait_ready(self, lines: queue.Queue) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if line is None:
                break
            match = READY_PATTERN.search(line)
            if match:
                return match.group(1)
        self.stop()
        raise RuntimeError("server did not become ready:\n" + "".join(self.log))

    def stop(self, signum: int = signal.SIGINT) -> int | None:
        """Ctrl-C the server, or send it ``signum`` (bounded); returns its exit code (130
        after a clean Ctrl-C, -15 when SIGTERM ended it, as a shell's 143)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(5)
        return self.process.returncode


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# Block size 4 so short test prompts span several blocks; 512 blocks hold 32 concurrent
# requests of ~40 tokens with room to spare, so the load test never preempts.
SERVER_ARGS = ("--block-size", "4", "--num-kv-blocks", "512", "--max-num-seqs", "64")


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir, *SERVER_ARGS, "--max-request-body-bytes", "64KiB")
    yield process
    assert_clean_exit(process)


def assert_clean_exit(process: ServerProcess) -> None:
    returncode = process.stop()
    log = "".join(process.log)
    assert returncode == 130, log  # the CLI's exit code for Ctrl-C
    assert "Traceback" not in log, log


@pytest.fixture
def openai_client(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def scrape(http_client: httpx.Client) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client's parser: ``{sample name{labels}: value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    response = http_client.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_for_idle(http_client: httpx.Client, timeout_s: float = 30) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(http_client)
        if (values["prefixcache:num_requests_running"] == 0
                and values["prefixcache:num_requests_waiting"] == 0
                and values["prefixcache:kv_cache_usage_perc"] == 0):
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s}s: {values}")
        time.sleep(0.05)
