"""A free TCP port for a process this one is about to start (a replica, the router, a
redis-server), which binds it itself."""

from __future__ import annotations

import socket


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out on ``host`` and that is free again. Another process
    could take it before the caller's child binds it; on loopback that race is rare, and
    the child then fails to start, which its caller reports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
