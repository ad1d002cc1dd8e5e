"""KV event endpoints per data-parallel rank: one set of flags, one address per replica.

Several engine replicas on one host (data parallelism behind one router) are started with
the same ``--kv-events-endpoint``; each must still bind its own address. This rule, after
vLLM's data-parallel port offset, derives that address from the rank:

* rank 0 keeps the endpoint exactly as given, so a single engine (and an engine started
  without a rank) binds what the user wrote;
* ``tcp://host:PORT`` -> ``tcp://host:(PORT + rank)``;
* ``tcp://host:*`` (and ``tcp://host:0``, libzmq's other spelling of it) stays as is:
  every replica already gets its own port from the OS;
* ``ipc://PATH`` -> ``ipc://PATH_dp{rank}`` and ``inproc://NAME`` -> ``inproc://NAME_dp{rank}``
  (``ipc://*``, a path libzmq picks, stays as is like ``tcp://host:*``).

Routers tell the replicas apart by the ``data_parallel_rank`` stamped into every batch,
not by the address, which is why the rank is applied to both in the same place
(``AsyncLLM.from_engine_args``).

Importing this module loads nothing beyond the stdlib.
"""

from __future__ import annotations

import re

MAX_TCP_PORT = 65535

# libzmq's ways of asking the OS (or libzmq) for an address of its own choosing.
_TCP_ANY_PORTS = ("*", "0")
_IPC_ANY_PATH = "*"
_DECIMAL = re.compile(r"[0-9]+")


def endpoint_for_rank(endpoint: str, data_parallel_rank: int) -> str:
    """The ZMQ ``endpoint`` that the replica of rank ``data_parallel_rank`` binds.

    See the module docstring for the rule. Rank 0 returns ``endpoint`` unchanged, whatever
    its transport, so nothing changes for an engine without data parallelism.

    Raises ValueError, with a message naming the endpoint, for a negative rank, a TCP
    port that would pass 65535, or (rank > 0) an endpoint the rule does not cover: another
    transport, a TCP address without a numeric port or ``*``, an empty ipc path or
    inproc name.
    """
    if data_parallel_rank < 0:
        raise ValueError(f"data-parallel rank must be >= 0, got {data_parallel_rank}")
    if data_parallel_rank == 0:
        return endpoint
    transport, sep, address = endpoint.partition("://")
    if sep and transport == "tcp":
        return _tcp_for_rank(endpoint, address, data_parallel_rank)
    if sep and transport in ("ipc", "inproc") and address:
        if transport == "ipc" and address == _IPC_ANY_PATH:
            return endpoint
        return f"{endpoint}_dp{data_parallel_rank}"
    raise ValueError(
        f"cannot derive a KV events endpoint for data-parallel rank {data_parallel_rank} "
        f"from {endpoint!r}: expected tcp://HOST:PORT, tcp://HOST:*, ipc://PATH or "
        "inproc://NAME")


def _tcp_for_rank(endpoint: str, address: str, data_parallel_rank: int) -> str:
    # The port follows the last colon: hosts may hold colons themselves ("[::1]", or
    # libzmq's "source;dest" form), ports never do.
    host, colon, port_text = address.rpartition(":")
    if not colon or not host:
        raise ValueError(
            f"cannot derive a KV events endpoint for data-parallel rank {data_parallel_rank} "
            f"from {endpoint!r}: expected tcp://HOST:PORT or tcp://HOST:*")
    if port_text in _TCP_ANY_PORTS:
        return endpoint
    if _DECIMAL.fullmatch(port_text) is None:
        raise ValueError(
            f"cannot derive a KV events endpoint for data-parallel rank {data_parallel_rank} "
            f"from {endpoint!r}: the port {port_text!r} is neither a number nor '*'")
    port = int(port_text) + data_parallel_rank
    if port > MAX_TCP_PORT:
        raise ValueError(
            f"KV events endpoint {endpoint!r} offset by data-parallel rank "
            f"{data_parallel_rank} gives port {port}, above {MAX_TCP_PORT}")
    return f"tcp://{host}:{port}"
