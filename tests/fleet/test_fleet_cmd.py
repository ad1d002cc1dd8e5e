"""``prefixcache fleet`` itself: it starts the replicas and the router, serves through the
router's URL, and stops every process it started, on SIGTERM or when one part dies."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from prefixcache.ports import free_loopback_port
from tests.entrypoints.conftest import MODEL_NAME, REPO_ROOT

STARTUP_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            pids.append(int(entry.name))
    return pids


def command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class FleetProcess:
    """``prefixcache fleet`` on the tiny model, two replicas, with ``fleet_args`` among
    the fleet's own options; ``url`` and ``ready_line`` once ready."""

    def __init__(self, model_dir: Path, *fleet_args: str) -> None:
        command = [sys.executable, "-m", "prefixcache", "fleet", "--replicas", "2",
                   "--port", str(free_loopback_port()), "--health-check-interval", "1", *fleet_args,
                   "--", str(model_dir), "--served-model-name", MODEL_NAME,
                   "--block-size", "16", "--num-kv-blocks", "128"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.stdout: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, self.stdout),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, None),
                         daemon=True).start()
        self.url = self._wait_ready()

    def _read(self, stream, lines: queue.Queue | None) -> None:
        for line in stream:
            self.log.append(line)
            if lines is not None:
                lines.put(line)
        if lines is not None:
            lines.put(None)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith("fleet ready: "):
                self.ready_line = line
                return line.split()[2]
        self.kill_all()
        pytest.fail("the fleet never became ready:\n" + "".join(self.log))

    def parts(self) -> dict[str, int]:
        """``{"router": pid, "replica PID": pid, ..., "redis": pid}`` of the fleet's
        children."""
        def name(pid: int) -> str:
            command = command_line(pid)
            if " prefixcache serve " in command:
                return f"replica {pid}"
            return "redis" if "redis-server" in command else "router"

        return {name(pid): pid for pid in children_of(self.process.pid)}

    def wait(self) -> int:
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail("the fleet did not stop:\n" + "".join(self.log))

    def kill_all(self) -> None:
        for pid in children_of(self.process.pid):
            os.kill(pid, signal.SIGKILL)
        self.process.kill()
        self.process.wait(10)


@pytest.fixture
def fleet(tiny_model_dir):
    process = FleetProcess(tiny_model_dir)
    yield process
    if process.process.poll() is None:
        process.kill_all()


def assert_all_stopped(pids: list[int]) -> None:
    deadline = time.monotonic() + 10  # the OS reaps them; nothing of ours to wait for
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if is_alive(pid)]


def test_fleet_serves_through_the_router_and_sigterm_stops_every_part(fleet):
    parts = fleet.parts()
    assert len(parts) == 3 and "router" in parts, parts
    response = httpx.post(f"{fleet.url}/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": "hello fleet", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    fleet.process.send_signal(signal.SIGTERM)
    assert fleet.wait() == 0
    assert_all_stopped(list(parts.values()))
    assert "stopping the fleet (SIGTERM)" in "".join(fleet.log)


def test_a_dying_replica_stops_the_whole_fleet(fleet):
    parts = fleet.parts()
    replica_pid = next(pid for name, pid in parts.items() if name != "router")
    os.kill(replica_pid, signal.SIGKILL)
    assert fleet.wait() == 1
    assert_all_stopped(list(parts.values()))
    assert "exited with code -9; stopping the fleet" in "".join(fleet.log)
