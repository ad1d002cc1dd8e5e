"""Listening sockets for the server, bound before anything slow happens.

``prefixcache serve`` binds and listens on ``--host``/``--port`` before it loads the model
(check first, then commit), then hands the sockets to uvicorn.
"""

from __future__ import annotations

import errno
import os
import socket
import sys


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets for ``host``:``port``, one per address ``host`` resolves to
    (``""`` is every interface), made as asyncio's ``create_server`` makes them (the one
    uvicorn would otherwise call): ``SO_REUSEADDR`` on POSIX, IPv6 sockets IPv6-only, an
    address of a disabled family (``EADDRNOTAVAIL``) skipped while another binds.

    ``port`` 0 lets the first socket pick a free port and binds the others to that same
    one, so every address serves one URL. They listen already because only ``listen``
    is definitive: on Linux two ``SO_REUSEADDR`` sockets may both bind a port, and the
    second learns it is taken at ``listen``. A client connecting before the app starts
    waits in the backlog.

    Raises OSError (``socket.gaierror`` for a name that does not resolve) with no socket
    left open.
    """
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                               0, socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((info[0], info[4]) for info in infos))
    sockets: list[socket.socket] = []
    unavailable: OSError | None = None
    try:
        for family, address in addresses:
            if sockets and port == 0:  # the rest follow the port the first one picked
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on connections whose
            # socket says it is TCP, and without it a response's body waits ~40 ms behind
            # its head (Nagle against the client's delayed ACK) on keep-alive connections.
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sockets.append(sock)
            # asyncio's condition: elsewhere (Windows) it would let another steal the port.
            if os.name == "posix" and sys.platform != "cygwin":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # Linux is dual-stack by default; "::" would also take the IPv4 port,
                # which asyncio (and so uvicorn) never did.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                unavailable = exc
                sockets.pop().close()
                continue
            sock.listen()
        if not sockets:
            raise unavailable or OSError(errno.EADDRNOTAVAIL, "no address to listen on")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def host_port(host: str, port: int) -> str:
    """``host:port`` as a user types it in a URL: IPv6 hosts bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def os_error_reason(exc: OSError) -> str:
    """The reason of ``exc`` as a phrase: "address already in use", not
    "[Errno 98] Address already in use"."""
    return (exc.strerror or str(exc)).lower()
