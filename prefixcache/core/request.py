"""A request as the KV cache manager sees it: its tokens, what makes its blocks unique,
and its chain of block hashes.

The manager attaches a :class:`~prefixcache.core.hashing.BlockHasher` the first time it
sees a request; from then on ``block_hashes`` always covers every full block, extended
incrementally by :meth:`Request.append_output_token_ids`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.core.hashing import BlockHash, BlockHasher


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler's life cycle."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waiting to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in _FINISHED_VALUES


_FINISHED_VALUES = frozenset({"stop", "length", "abort", "error"})


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item whose placeholder tokens are ``[offset, offset + length)``.

    ``identifier`` is the item's content hash from the frontend (e.g. an image digest):
    it is what tells two images apart when their placeholder tokens are identical.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"multimodal offset must be >= 0, got {self.offset}")
        if self.length < 1:
            raise ValueError(f"multimodal length must be >= 1, got {self.length}")


class Request:
    """Token state of one request.

    ``num_computed_tokens`` is advanced by the caller (the scheduler) once tokens are
    scheduled for computation; the manager only reads it. ``status`` and
    ``num_preemptions`` belong to the scheduler. ``block_hashes[i]`` is the chained hash of
    full block ``i``; partial blocks have no hash.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "all_token_ids", "num_prompt_tokens",
        "num_computed_tokens", "cache_salt", "lora_name", "lora_path", "lora_id",
        "mm_features", "skip_reading_prefix_cache", "block_hashes", "block_hasher",
        "has_extra_keys", "_next_hash_at", "status", "num_preemptions",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_features: Iterable[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
        lora_id: int | None = None,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt must have at least one token")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"request {request_id!r}: cache_salt must be a string or None")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.lora_id = lora_id
        self.mm_features = tuple(sorted(mm_features, key=lambda f: f.offset))
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.has_extra_keys = bool(
            lora_name is not None or self.mm_features or cache_salt is not None
        )
        self.block_hashes: list[BlockHash] = []
        self.block_hasher: BlockHasher | None = None
        self._next_hash_at = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        if block_hasher is not None:
            self.attach_block_hasher(block_hasher)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def attach_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Bind the hasher that keeps ``block_hashes`` current; idempotent for the same one.

        A request carries one hash chain, so binding a second hasher (another manager's,
        even one of the same configuration) is a ValueError; so are tokens that cannot be
        hashed, and then the request stays unbound.
        """
        if self.block_hasher is block_hasher:
            return
        if self.block_hasher is not None:
            raise ValueError(
                f"request {self.request_id!r} is already hashed by another KV cache manager"
            )
        # Hash before binding: tokens that cannot be hashed raise here and leave the request
        # unbound, instead of bound to a hasher with its hashes missing.
        block_hasher.extend_request(self)
        self.block_hasher = block_hasher
        self._next_hash_at = (len(self.block_hashes) + 1) * block_hasher.block_size

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled tokens; hashes any block they complete.

        Tokens that cannot be hashed raise ValueError when their block completes; the
        tokens of that call are then taken back out, so the request stays consistent.
        """
        all_token_ids = self.all_token_ids
        if isinstance(token_ids, int):
            all_token_ids.append(token_ids)
        else:
            all_token_ids.extend(token_ids)
        hasher = self.block_hasher
        if hasher is not None and len(all_token_ids) >= self._next_hash_at:
            try:
                hasher.extend_request(self)
            except ValueError:
                num_appended = 1 if isinstance(token_ids, int) else len(token_ids)
                del all_token_ids[len(all_token_ids) - num_appended:]
                raise
            self._next_hash_at = (len(self.block_hashes) + 1) * hasher.block_size

    def block_extra_keys(self, block_index: int, block_size: int) -> tuple | None:
        """The tagged extra keys of full block ``block_index``, in the order
        ``("lora", name, path)``, then ``("mm", identifier, offset - block_start)`` for each
        multimodal item overlapping the block, then ``("cache_salt", salt)`` on block 0.
        None when the block has none."""
        keys: list[tuple] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        start = block_index * block_size
        end = start + block_size
        for feature in self.mm_features:
            if feature.offset >= end:
                break  # sorted by offset: nothing later overlaps
            if feature.offset + feature.length > start:
                keys.append(("mm", feature.identifier, feature.offset - start))
        if block_index == 0 and self.cache_salt is not None:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
