"""Helpers for tests that run ``prefixcache`` as a real process or need real ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_with_reader_gone(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m prefixcache *args`` with stdout a pipe whose reader has already
    closed (``... | head`` once head has exited); stderr is captured as text."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "prefixcache", *args],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=timeout,
            cwd=REPO_ROOT, env=prefixcache_env())
    finally:
        os.close(write_end)


def prefixcache_env(**changes: str | None) -> dict[str, str]:
    """The environment a ``python -m prefixcache`` child runs in: this one, with the repo
    importable, and each of ``changes`` set (None: removed)."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_with_stderr_closed(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m prefixcache *args 2>&-``: started with file descriptor 2 closed;
    stdout is captured as bytes."""
    return subprocess.run([sys.executable, "-m", "prefixcache", *args], cwd=REPO_ROOT,
                          env=prefixcache_env(), stdout=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(2),
                          timeout=timeout, check=False)


def free_loopback_ports(num_ports: int) -> list[int]:
    """Distinct ports on 127.0.0.1 that the OS just handed out (as for ``tcp://...:*``)
    and that are free again, for a test that must name a port by its number."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(num_ports)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
