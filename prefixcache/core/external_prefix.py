"""The scheduler's view of a KV tier outside the block pool (``prefixcache.kv_tier``):
a source of blocks, by chained hash, whose bytes the worker copies into the pool.

The core never looks inside a payload; it only counts blocks and hands each payload
to the worker with the block id it must fill (:class:`ExternalBlock`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixcache.core.hashing import BlockHash


class ExternalPrefixSource(Protocol):
    """What the scheduler asks of a second tier. Neither call may raise for the tier's
    own failures: a tier that cannot answer holds nothing."""

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` the tier holds."""
        ...

    def load(self, block_hashes: Sequence[BlockHash],
             block_token_ids: Sequence[Sequence[int]]) -> Sequence[Any]:
        """The verified payloads of the leading blocks (one per block, stopping at the
        first that is missing or invalid)."""
        ...


@dataclass(frozen=True, slots=True)
class ExternalBlock:
    """Copy ``payload`` (from an :class:`ExternalPrefixSource`) into block ``block_id``
    before the step that schedules its request runs."""

    block_id: int
    payload: Any
