"""KV-cache events on the wire: msgspec structs that encode exactly as vLLM's do.

Cache-aware routers (llm-d, Dynamo, vLLM production-stack) decode vLLM's msgpack payloads
with their own copies of these types, so the field names, their order, the tagging and
which fields may be left out are the contract, not an implementation detail:

* every event is a msgpack **map** tagged with ``"type": "<ClassName>"`` (msgspec
  ``tag=True``), fields in declaration order;
* a field is left off the wire only when it has a default and holds it (``omit_defaults``),
  which is how ``BlockStored.extra_keys`` stays absent for blocks without extra keys while
  ``lora_id``/``lora_name`` (no defaults in vLLM) are always sent, even as ``None``;
* a batch is a msgpack **array** ``[ts, [events...], data_parallel_rank]``; array-like
  structs always carry every field, so a ``None`` rank is sent as ``nil``.

Decoding ignores map keys it does not know, so these types also read streams from newer
vLLM versions that add optional fields (``group_idx``, ...).
"""

from __future__ import annotations

from typing import Any

import msgspec

# A block hash as routers see it: vLLM's default 64-bit integer form, or the raw digest.
ExternalBlockHash = int | bytes

# vLLM's name for the primary KV tier (also the core's DEFAULT_MEDIUM).
MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three wire events; the tag is the class name under the key ``type``."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one sequence became cached.

    ``token_ids`` holds ``block_size`` tokens per hash, block after block.
    ``parent_block_hash`` is the block logically before ``block_hashes[0]``, or None when
    the run starts the sequence. ``extra_keys``, when present, has one entry per block: the
    untagged extra keys that went into that block's hash (see ``convert``), or None.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    # Optional fields newer vLLM versions send; we never set them, but declaring them lets
    # the decoder type them in vLLM streams. They also matter for bytes: msgspec sizes a
    # map header by the number of entries a struct *could* have, and with 16 or more
    # (these plus the tag) it writes a map16 header (``de 00 08``) even for 8 entries,
    # exactly as vLLM's BlockStored does. The shared-vector test pins this.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    skipped_parent_block_hash: ExternalBlockHash | None = None
    skipped_token_ids: list[int] | None = None
    skipped_extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    """These hashes stopped being cached; one entry per evicted block."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block this engine had reported as stored is gone."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One engine step's events, in the order they happened.

    ``ts`` is the publisher's wall-clock time (seconds since the epoch) when the step's
    events were handed over; ``data_parallel_rank`` tells replicas behind one endpoint
    apart (None when the publisher does not set it).
    """

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch as vLLM puts it on the wire (the ZMQ payload frame)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse one payload frame; raises ``msgspec.DecodeError`` on anything else."""
    return _batch_decoder.decode(payload)
