"""A tier on a Redis or Valkey server, shared by every replica that reaches it.

Reads and writes go in pipelines: ``EXISTS`` for lookups, ``MGET`` in batches of
``MGET_BATCH`` keys for loads (one batch is a few MB: big enough to amortise round
trips, small enough not to stall the server for other clients), ``SET ... NX`` for
writes (a key already held keeps its value). Every call has ``timeout_s`` to answer.
The server's own ``maxmemory`` with ``maxmemory-policy allkeys-lru`` bounds its size;
the tier never sets server configuration, since other clients may share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from prefixcache.kv_tier.backend import KVTierBackend

MGET_BATCH = 16


class RedisBackend(KVTierBackend):
    """Values on the Redis/Valkey server of ``url`` (``redis://host:port/db``)."""

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        try:
            import redis
        except ImportError as error:
            raise ImportError("--kv-tier redis://... needs the 'redis' package: "
                              "pip install redis") from error
        self.description = url
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            health_check_interval=0)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for start in range(0, len(keys), MGET_BATCH):
            pipe.mget(keys[start:start + MGET_BATCH])
        return [value for batch in pipe.execute() for value in batch]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        pipe = self._client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, nx=True)
        return sum(1 for written in pipe.execute() if written)

    def clear(self, key_prefix: str) -> int:
        num_deleted = 0
        batch: list[bytes] = []
        for key in self._client.scan_iter(match=key_prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                num_deleted += self._client.delete(*batch)
                batch = []
        if batch:
            num_deleted += self._client.delete(*batch)
        return num_deleted

    def close(self) -> None:
        self._client.close()


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a ``redis://`` or ``rediss://`` URL, or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        return "the scheme must be redis://, rediss:// or unix://"
    if parts.scheme != "unix" and not parts.hostname:
        return "it names no host"
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        return "its port is not a number in 0..65535"
    database = parts.path.lstrip("/")
    if database and not database.isdigit() and parts.scheme != "unix":
        return f"the database {database!r} is not a number"
    return None
