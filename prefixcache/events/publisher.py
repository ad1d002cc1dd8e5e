"""What the engine publishes KV events through, and the sequence numbers on the wire.

* :class:`EventPublisher` — the contract the engine talks to; :class:`NullEventPublisher`
  (events off) and :class:`~prefixcache.events.zmq_publisher.ZmqEventPublisher` (the
  ZeroMQ protocol, described in ``zmq_publisher``) implement it.
* Sequence numbers as they travel (``seq_to_bytes``, ``seq_from_bytes``, ``END_OF_REPLAY``),
  shared by the publisher and ``subscriber``; ``restart_safe_first_seq``.
* :func:`make_event_publisher` — a ZMQ publisher on an endpoint, or the null one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.core.kv_events import KVCacheEvent

END_OF_REPLAY_SEQ = -1
END_OF_REPLAY = END_OF_REPLAY_SEQ.to_bytes(8, "big", signed=True)
MAX_SEQ = (1 << 63) - 1


def seq_to_bytes(seq: int) -> bytes:
    """A sequence number as it travels: 8 bytes, big-endian, signed (so -1 ends a replay)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(frame: bytes) -> int:
    """Inverse of ``seq_to_bytes``."""
    return int.from_bytes(frame, "big", signed=True)


def restart_safe_first_seq() -> int:
    """A first sequence number above any its predecessors on the same endpoint reached:
    the microseconds since the epoch now (they published fewer batches than microseconds
    passed since their own start)."""
    return time.time_ns() // 1_000


class EventPublisher:
    """What the engine talks to; ``NullEventPublisher`` and ``ZmqEventPublisher`` implement it.

    Call ``publish(events)`` once per engine step with that step's drained events (for
    example ``kv_cache_manager.take_events()``); an empty list publishes nothing.
    """

    num_published_batches: int = 0
    num_dropped_batches: int = 0

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> None:
        raise NotImplementedError

    def wait_until_sent(self, timeout_s: float) -> bool:
        """Block until every batch published so far is on the wire (or dropped), at most
        ``timeout_s`` seconds; True if so. A publisher without a network side returns at
        once."""
        return True

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NullEventPublisher(EventPublisher):
    """Events off: accepts and forgets everything, at the cost of one method call."""

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> None:
        return None

    def close(self) -> None:
        return None


def make_event_publisher(endpoint: str | None, **kwargs) -> EventPublisher:
    """A ``ZmqEventPublisher`` on ``endpoint``, or a ``NullEventPublisher`` when it is None.

    ``kwargs`` go to ``ZmqEventPublisher`` unchanged.
    """
    if endpoint is None:
        return NullEventPublisher()
    from prefixcache.events.zmq_publisher import ZmqEventPublisher

    return ZmqEventPublisher(endpoint, **kwargs)


def __getattr__(name: str) -> Any:
    # ``ZmqEventPublisher`` stays importable from here, where it used to live. Loaded on
    # first use: zmq_publisher imports this module, so a top-level import would be a cycle.
    if name == "ZmqEventPublisher":
        from prefixcache.events.zmq_publisher import ZmqEventPublisher

        return ZmqEventPublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
