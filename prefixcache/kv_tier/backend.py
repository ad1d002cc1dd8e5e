"""The contract of a tier's storage: a map from string keys to byte values, with batched
calls, and nothing else (no meaning of keys or values; :class:`~prefixcache.kv_tier.tier.KVTier`
adds that).

A backend may raise anything on failure (a connection refused, a timeout, a full disk):
the tier counts it as an error and treats the call as a miss. It never has to be
thread-safe beyond this: the engine thread reads (``exists_many``, ``get_many``) while
one background writer thread writes (``put_many``), so implementations use a connection
pool or per-call files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class KVTierBackend(ABC):
    """Byte storage behind a :class:`~prefixcache.kv_tier.tier.KVTier`."""

    #: Printed in logs and errors, e.g. ``redis://127.0.0.1:6379/0``.
    description: str = ""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, None where there is none."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store the values of keys that hold none yet (a key already held keeps its
        value: same key, same content); returns how many were written."""

    @abstractmethod
    def clear(self, key_prefix: str) -> int:
        """Delete every key starting with ``key_prefix``; returns how many."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections or handles."""
