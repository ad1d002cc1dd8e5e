"""The value stored for one block: a small header that says exactly what the payload is,
then the payload (the block's KV bytes).

Layout (integers little-endian)::

    b"PCKV" | u16 format version | 32-byte layout fingerprint | u16 hash length | block hash
    | u32 token count | token ids as int64 | u64 payload length | u32 CRC-32 | payload

The CRC-32 covers everything before it and the payload. :func:`decode_block_value`
accepts a value only if every field matches what the reader expects (its own
fingerprint, the block hash it asked for, the block's token ids, the payload size) and
the checksum holds; anything else (a truncated, corrupted or foreign value) raises
:class:`InvalidBlockValue`, and the caller treats the block as missing.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

MAGIC = b"PCKV"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sH32sH")  # magic, version, fingerprint, hash length
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")


class InvalidBlockValue(ValueError):
    """A stored value that does not hold the block asked for; ``reason`` says which
    check failed (one word, for logs and tests)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid KV tier value: {reason}")
        self.reason = reason


def _tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def encode_block_value(fingerprint: bytes, block_hash: bytes, token_ids: Sequence[int],
                       payload: bytes | memoryview) -> bytes:
    """The stored form of one block (see the module docstring)."""
    header = b"".join((
        _HEAD.pack(MAGIC, FORMAT_VERSION, fingerprint, len(block_hash)), block_hash,
        _COUNT.pack(len(token_ids)), _tokens(token_ids),
    ))
    length = _LENGTH.pack(len(payload) if isinstance(payload, bytes) else payload.nbytes)
    checksum = zlib.crc32(payload, zlib.crc32(length, zlib.crc32(header)))
    return b"".join((header, length, _CRC.pack(checksum), payload))


def decode_block_value(value: bytes, fingerprint: bytes, block_hash: bytes,
                       token_ids: Sequence[int], payload_nbytes: int) -> memoryview:
    """The payload of ``value`` (a view, no copy) if it is block ``block_hash`` with
    ``token_ids`` under ``fingerprint`` and ``payload_nbytes`` long, intact; else
    :class:`InvalidBlockValue`."""
    view = memoryview(value)
    try:
        magic, version, stored_fingerprint, hash_len = _HEAD.unpack_from(view, 0)
    except struct.error:
        raise InvalidBlockValue("truncated") from None
    if magic != MAGIC or version != FORMAT_VERSION:
        raise InvalidBlockValue("format")
    if stored_fingerprint != fingerprint:
        raise InvalidBlockValue("fingerprint")
    offset = _HEAD.size
    if bytes(view[offset:offset + hash_len]) != block_hash:
        raise InvalidBlockValue("block_hash")
    offset += hash_len
    expected_tokens = _tokens(token_ids)
    try:
        (num_tokens,) = _COUNT.unpack_from(view, offset)
    except struct.error:
        raise InvalidBlockValue("truncated") from None
    offset += _COUNT.size
    if num_tokens != len(token_ids) or \
            bytes(view[offset:offset + len(expected_tokens)]) != expected_tokens:
        raise InvalidBlockValue("token_ids")
    offset += len(expected_tokens)
    try:
        (payload_len,) = _LENGTH.unpack_from(view, offset)
        (checksum,) = _CRC.unpack_from(view, offset + _LENGTH.size)
    except struct.error:
        raise InvalidBlockValue("truncated") from None
    payload = view[offset + _LENGTH.size + _CRC.size:]
    if payload_len != payload_nbytes or payload.nbytes != payload_len:
        raise InvalidBlockValue("size")
    if zlib.crc32(payload, zlib.crc32(view[:offset + _LENGTH.size])) != checksum:
        raise InvalidBlockValue("checksum")
    return payload
