"""KV-cache events for cache-aware routers, on vLLM's wire format and ZMQ protocol.

* ``wire`` — msgspec structs and codec (``KVEventBatch``, ``BlockStored``, ...).
* ``convert`` — core records (raw digests, tagged extra keys) to wire events.
* ``publisher`` — ``EventPublisher`` (the engine's side), ``NullEventPublisher``, sequence
  numbers on the wire.
* ``zmq_publisher`` — ``ZmqEventPublisher`` (PUB + ROUTER replay) and its protocol.
* ``endpoint`` — ``endpoint_for_rank``: each data-parallel replica's own endpoint.
* ``subscriber`` — ``EventSubscriber``, the consumer side (imports pyzmq).
* ``index`` — ``EventIndex``, a router's view of the stored hashes built from events.

The ``prefixcache events`` command over them lives in ``prefixcache.entrypoints.events_cmd``.

Importing this package loads msgspec but not pyzmq; the publisher imports pyzmq when one
is constructed.
"""

from prefixcache.events.convert import block_hash_to_int64, make_batch, to_wire_event
from prefixcache.events.endpoint import endpoint_for_rank
from prefixcache.events.index import EventIndex
from prefixcache.events.publisher import EventPublisher, NullEventPublisher, make_event_publisher
from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from prefixcache.events.zmq_publisher import ZmqEventPublisher

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventIndex",
    "EventPublisher",
    "KVEventBatch",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "block_hash_to_int64",
    "decode_batch",
    "encode_batch",
    "endpoint_for_rank",
    "make_batch",
    "make_event_publisher",
    "to_wire_event",
]
