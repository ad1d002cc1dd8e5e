"""What every workload family produces: requests whose prompts are concatenated *segments*
of named token streams, turned into Mooncake hash ids or token ids.

A segment ``(stream, length)`` is the first ``length`` tokens of the token stream named
``stream`` (any hashable key: a system prompt, a document, a conversation's transcript).
Two prompts share a block exactly when they agree on every token up to the block's end, so
a block's Mooncake hash id is interned from its parent's id and the stream slices it covers:
a conversation turn that extends the previous prompt names the same ids for the blocks the
previous prompt filled. A trailing partial block gets an id of its own (its content differs
from any longer prompt's full block at that position).

Token ids, for the token-id format, are a pure function of ``(stream, offset)`` and the
generator's seed, so equal segments give equal tokens.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TextIO

from prefixcache.sim.trace import MOONCAKE_BLOCK_SIZE

Segment = tuple[Hashable, int]  # (stream key, number of tokens from the stream's start)


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    """One generated request: arrival time, prompt segments, tokens to generate."""

    timestamp_ms: int
    segments: tuple[Segment, ...]
    output_length: int

    @property
    def input_length(self) -> int:
        return sum(length for _, length in self.segments)


class BlockIdInterner:
    """Assigns Mooncake hash ids: equal (parent id, covered slices) -> equal id, numbered
    0, 1, 2, ... in order of first appearance."""

    def __init__(self) -> None:
        self._key_to_id: dict[tuple, int] = {}

    def hash_ids(self, segments: Iterable[Segment]) -> list[int]:
        """The hash ids of the prompt made of ``segments``, one per 512-token block (the
        last one possibly partial)."""
        key_to_id = self._key_to_id
        ids: list[int] = []
        parent = -1
        pieces: list[tuple] = []
        room = MOONCAKE_BLOCK_SIZE
        for stream, length in segments:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                pieces.append((stream, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._intern(key_to_id, parent, pieces)
                    ids.append(parent)
                    pieces, room = [], MOONCAKE_BLOCK_SIZE
        if pieces:
            ids.append(self._intern(key_to_id, parent, pieces))
        return ids

    @staticmethod
    def _intern(key_to_id: dict[tuple, int], parent: int, pieces: list[tuple]) -> int:
        key = (parent, tuple(pieces))
        block_id = key_to_id.get(key)
        if block_id is None:
            block_id = key_to_id[key] = len(key_to_id)
        return block_id


def stream_token_ids(seed: int, stream: Hashable, length: int) -> list[int]:
    """The first ``length`` token ids, in [0, 32768), of ``stream`` under ``seed``."""
    data = hashlib.shake_128(f"{seed}:{stream!r}".encode()).digest(2 * length)
    return [token & 0x7FFF for token in array("H", data)]


def write_trace(requests: Iterable[SyntheticRequest], handle: TextIO, trace_format: str,
                seed: int) -> None:
    """Write ``requests`` as JSON lines, each as soon as it is taken from ``requests``:
    ``mooncake`` (hash ids of 512-token blocks) or ``token-ids`` (``{"timestamp",
    "prompt_token_ids", "output_length"}``)."""
    if trace_format == "mooncake":
        interner = BlockIdInterner()
        for request in requests:
            handle.write(json.dumps({
                "timestamp": request.timestamp_ms,
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": interner.hash_ids(request.segments),
            }) + "\n")
    elif trace_format == "token-ids":
        stream_to_tokens: dict[Hashable, list[int]] = {}
        for request in requests:
            tokens: list[int] = []
            for stream, length in request.segments:
                known = stream_to_tokens.get(stream)
                if known is None or len(known) < length:
                    known = stream_to_tokens[stream] = stream_token_ids(seed, stream, length)
                tokens.extend(known[:length])
            handle.write(json.dumps({
                "timestamp": request.timestamp_ms,
                "prompt_token_ids": tokens,
                "output_length": request.output_length,
            }) + "\n")
    else:
        raise ValueError(f"unknown trace format {trace_format!r}: mooncake or token-ids")
