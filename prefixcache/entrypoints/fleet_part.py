"""One child process of ``prefixcache fleet`` (a replica, the router, the redis-server):
started in its own session, its output forwarded, stopped with a bounded wait.

Children run in their own sessions so that the fleet alone decides the order of shutdown
(a Ctrl-C in the terminal reaches only the fleet) and, on Linux, get SIGTERM if the fleet
process itself dies, so nothing outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

_STOP_TIMEOUT_S = 20.0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


@dataclass(slots=True)
class Part:
    """One child process; its stderr+stdout lines go to our stderr tagged with ``name``."""

    name: str
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, command: list[str]) -> Part:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", env=env,
            start_new_session=True, preexec_fn=_die_with_parent if _PRCTL else None)
        part = cls(name, process)
        part.reader = threading.Thread(target=part._forward, daemon=True,
                                       name=f"fleet-log-{name}")
        part.reader.start()
        return part

    def _forward(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            try:
                sys.stderr.write(f"[{self.name}] {line}")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone; keep draining so the child never blocks

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def stop(self, signum: int = signal.SIGINT, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Ask it to stop with ``signum``; SIGKILL after ``timeout_s``."""
        if self.is_running:
            try:
                self.process.send_signal(signum)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
            except ProcessLookupError:
                pass
        if self.reader is not None:
            self.reader.join(5)
