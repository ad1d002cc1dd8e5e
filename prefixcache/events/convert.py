"""From the core's event records to wire events, the way vLLM presents them to routers.

Two things change on the way out:

* **Block hashes.** The core keeps raw digests (32 bytes for sha256, 16 for xxhash). vLLM
  publishes, by default, a 64-bit integer: the digest's low 8 bytes read big-endian. The
  raw digest is the alternative (``block_hash_format="bytes"``).
* **Extra keys.** The core tags each extra key with its source so that, say, a cache salt
  can never collide with a LoRA name inside a hash. vLLM's events publish the *untagged*
  shapes routers have always seen, in the same order (LoRA, multimodal, cache salt,
  prompt embeds):

  ================================  =========================
  core (hash input)                 event
  ================================  =========================
  ``("lora", name, path)``          ``name`` (no path)
  ``("mm", identifier, offset)``    ``(identifier, offset)``
  ``("cache_salt", salt)``          ``salt``
  ``("prompt_embeds", digest)``     ``digest``
  ================================  =========================

  so a router cannot rebuild a LoRA block's hash from the event (the path is not sent);
  it should use the published hashes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from prefixcache.core import kv_events as core_events
from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    WireEvent,
)

BlockHashFormat = Literal["int64", "bytes"]
BLOCK_HASH_FORMATS: tuple[str, ...] = ("int64", "bytes")

_INT64_MASK = (1 << 64) - 1


def block_hash_to_int64(block_hash: bytes) -> int:
    """vLLM's external 64-bit form of a block hash: its low 8 bytes, big-endian."""
    return int.from_bytes(block_hash, "big") & _INT64_MASK


def to_external_block_hash(
    block_hash: bytes, block_hash_format: BlockHashFormat = "int64"
) -> ExternalBlockHash:
    """``block_hash`` as routers receive it in ``block_hash_format``."""
    _check_format(block_hash_format)
    if block_hash_format == "int64":
        return int.from_bytes(block_hash, "big") & _INT64_MASK
    return bytes(block_hash)


def _check_format(block_hash_format: str) -> None:
    if block_hash_format not in BLOCK_HASH_FORMATS:
        raise ValueError(
            f"block_hash_format must be one of {BLOCK_HASH_FORMATS}, not {block_hash_format!r}"
        )


def _external_block_hashes(block_hashes: list[bytes], as_int64: bool) -> list[ExternalBlockHash]:
    # One comprehension per event rather than a call per hash: stores can be long runs.
    if as_int64:
        return [int.from_bytes(h, "big") & _INT64_MASK for h in block_hashes]
    return [bytes(h) for h in block_hashes]


def untag_extra_key(extra_key: Any) -> Any:
    """One core extra key in vLLM's event shape (see the module table).

    Keys that are not tagged tuples pass through unchanged; an unknown tag loses its tag
    and keeps the rest (a lone value unwrapped), the same rule as the known ones.
    """
    if not isinstance(extra_key, tuple) or not extra_key or not isinstance(extra_key[0], str):
        return extra_key
    tag = extra_key[0]
    if tag == "lora":
        # vLLM's events carry the adapter name only; the path stays private to the hash.
        return extra_key[1]
    values = extra_key[1:]
    if tag == "mm":
        return tuple(values)
    return values[0] if len(values) == 1 else tuple(values)


def untag_block_extra_keys(block_extra_keys: tuple | None) -> tuple | None:
    """One block's extra-key tuple in event shape; None (no extra keys) stays None."""
    if not block_extra_keys:
        return None
    return tuple(untag_extra_key(key) for key in block_extra_keys)


def to_wire_event(
    record: core_events.KVCacheEvent, block_hash_format: BlockHashFormat = "int64"
) -> WireEvent:
    """The wire event for one core record.

    ``BlockStored.extra_keys`` is sent only when at least one block has extra keys, as
    vLLM does; otherwise the field is left off the wire entirely.
    """
    _check_format(block_hash_format)
    as_int64 = block_hash_format == "int64"
    if isinstance(record, core_events.BlockStored):
        block_hashes = _external_block_hashes(record.block_hashes, as_int64)
        parent = record.parent_block_hash
        if parent is not None:
            parent = to_external_block_hash(parent, block_hash_format)
        extra_keys = None
        if record.extra_keys and any(record.extra_keys):
            extra_keys = [untag_block_extra_keys(keys) for keys in record.extra_keys]
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=list(record.token_ids),
            block_size=record.block_size,
            lora_id=record.lora_id,
            medium=record.medium,
            lora_name=record.lora_name,
            extra_keys=extra_keys,
        )
    if isinstance(record, core_events.BlockRemoved):
        return BlockRemoved(
            block_hashes=_external_block_hashes(record.block_hashes, as_int64),
            medium=record.medium,
        )
    if isinstance(record, core_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a core KV cache event: {record!r}")


def make_batch(
    records: Iterable[core_events.KVCacheEvent],
    ts: float,
    data_parallel_rank: int | None = None,
    block_hash_format: BlockHashFormat = "int64",
) -> KVEventBatch:
    """A wire batch holding ``records`` converted in order."""
    return KVEventBatch(
        ts=ts,
        events=[to_wire_event(record, block_hash_format) for record in records],
        data_parallel_rank=data_parallel_rank,
    )
