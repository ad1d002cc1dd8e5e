"""``adaptive``'s per-block bookkeeping: the ghost list of recent evictions, what happens
to a block the pool takes, and where each block a request releases goes.

The Python functions and :class:`PythonGhostList` here are the reference. The package
also builds the same contracts in C (``_adaptive_bookkeeping_native.c``), because
``adaptive`` does this for every block taken and every block released, and in Python the
interpreter between its few table operations costs more than the rest of the policy; the
tests hold the two to the same entries, lists and orders. :data:`GhostList`,
:func:`note_taken`, :func:`sort_released` and :func:`mark_hashed` are what ``adaptive``
uses: the C ones when the package was built with a C compiler
(:data:`NATIVE_BOOKKEEPING`), else the Python ones. Either way every decision is the
same; only the cost differs. The two kinds do not mix: the C functions take only the C
ghost list.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.hashing import BlockHash


class PythonGhostList:
    """The hashes of recently evicted blocks, oldest first, each with the eviction count
    when it was evicted and its content's state then; at most ``max_size`` (the oldest
    dropped first). Keys that are not bytes are never held."""

    __slots__ = ("max_size", "_entries")

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("max_size must not be negative")
        self.max_size = max_size
        self._entries: OrderedDict[BlockHash, tuple[int, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: BlockHash) -> tuple[int, Any]:
        """``(evicted_at, state)``; KeyError if absent."""
        return self._entries[key]

    def add(self, key: BlockHash, evicted_at: int, state: Any) -> None:
        """A new key goes last; a key present keeps its place, with the new values. Then
        the oldest are dropped while more than ``max_size`` are kept."""
        if type(key) is not bytes:
            raise TypeError(f"a ghost list's keys must be bytes, not {type(key).__name__}")
        self._entries[key] = (evicted_at, state)
        self._trim()

    def pop(self, key: BlockHash) -> tuple[int, Any]:
        """Remove ``key`` and return ``(evicted_at, state)``; KeyError if absent."""
        return self._entries.pop(key)

    def clear(self) -> None:
        self._entries.clear()

    def keys(self) -> list[BlockHash]:
        """The keys, oldest first."""
        return list(self._entries)

    def _trim(self) -> None:
        entries = self._entries
        for _ in range(len(entries) - self.max_size):
            entries.popitem(last=False)


def python_note_taken(blocks: list[KVCacheBlock], ghost: PythonGhostList, num_evicted: int,
                      is_reused: bytearray, unproven: list, new_marker: Any) -> int:
    """The pool took ``blocks`` for new content. For each, in order: its reuse mark is
    cleared; if it holds a hash (about to be evicted), the hash joins the ghost list with
    the eviction count and the block's unproven state, and the count advances; its
    unproven state becomes ``new_marker``. Then the ghost list is trimmed. Returns the
    eviction count."""
    entries = ghost._entries
    for block in blocks:
        block_hash = block.block_hash
        if block_hash is not None and type(block_hash) is not bytes:
            raise TypeError(f"a ghost list's keys must be bytes, not {type(block_hash).__name__}")
        block_id = block.block_id
        is_reused[block_id] = 0
        if block_hash is not None:
            entries[block_hash] = (num_evicted, unproven[block_id])
            num_evicted += 1
        unproven[block_id] = new_marker
    ghost._trim()
    return num_evicted


def python_sort_released(blocks: list[KVCacheBlock], finished: bool, is_reused: bytearray,
                         unproven: list, ghost: PythonGhostList, num_evicted: int,
                         followed_reach: int, threshold: int, state: Any, new_marker: Any
                         ) -> tuple[list, list, list, list, list, list]:
    """Where a request's released blocks go, in order; ``finished`` says the request
    finished (was not preempted). Returns ``(unhashed, lower, protected, new,
    sampled_new, credits)``:

    - a block holding nothing goes to ``unhashed``;
    - a block marked reused goes to ``protected``;
    - a block whose hash is in the ghost list (recomputed) leaves the ghost list, and
      goes to ``protected`` (and is marked reused) if it was evicted fewer than
      ``followed_reach`` evictions ago, else to ``lower``; if its content's state then
      was a truthy one (unproven new content), that state is added to ``credits``;
    - any other block goes to ``lower``, and if the request finished and the block's
      unproven state is ``new_marker`` (filled since it was taken), also to ``new``, its
      state becoming ``state``, and its hash to ``sampled_new`` if the hash's last byte is
      below ``threshold``.

    When the request finished, the unproven state of a block in ``protected``, or
    recomputed, becomes None."""
    unhashed, lower, protected, new, sampled_new, credits = [], [], [], [], [], []
    entries = ghost._entries
    for block in blocks:
        block_hash = block.block_hash
        if block_hash is None:
            unhashed.append(block)
            continue
        if type(block_hash) is not bytes:
            raise TypeError(f"a ghost list's keys must be bytes, not {type(block_hash).__name__}")
        block_id = block.block_id
        if is_reused[block_id]:
            if finished:
                unproven[block_id] = None
            protected.append(block)
        elif block_hash in entries:
            evicted_at, evicted_state = entries.pop(block_hash)
            if num_evicted - evicted_at < followed_reach:
                is_reused[block_id] = 1
                protected.append(block)
            else:  # wanted again, but further back than the order followed trusts
                lower.append(block)
            if finished:
                unproven[block_id] = None
            if evicted_state:
                credits.append(evicted_state)
        else:
            lower.append(block)
            if finished and unproven[block_id] is new_marker:
                unproven[block_id] = state
                new.append(block)
                if block_hash[-1] < threshold:
                    sampled_new.append(block_hash)
    return unhashed, lower, protected, new, sampled_new, credits


def python_mark_hashed(blocks: list[KVCacheBlock], per_block: list, value: Any) -> None:
    """For each of ``blocks`` holding a hash, in order: ``per_block[block_id] = value``."""
    for block in blocks:
        if block.block_hash is not None:
            block_id = block.block_id
            if not 0 <= block_id < len(per_block):
                raise IndexError(f"block id {block_id} is out of range")
            per_block[block_id] = value


try:
    from prefixcache.core.eviction._adaptive_bookkeeping_native import (
        GhostList as NativeGhostList,
    )
    from prefixcache.core.eviction._adaptive_bookkeeping_native import (
        mark_hashed as native_mark_hashed,
    )
    from prefixcache.core.eviction._adaptive_bookkeeping_native import (
        note_taken as native_note_taken,
    )
    from prefixcache.core.eviction._adaptive_bookkeeping_native import (
        sort_released as native_sort_released,
    )
except ImportError:  # built without a C compiler: the Python ones decide the same
    NativeGhostList = native_note_taken = native_sort_released = native_mark_hashed = None

#: Whether ``adaptive`` runs the C bookkeeping.
NATIVE_BOOKKEEPING = NativeGhostList is not None
GhostList = NativeGhostList if NATIVE_BOOKKEEPING else PythonGhostList
note_taken = native_note_taken if NATIVE_BOOKKEEPING else python_note_taken
sort_released = native_sort_released if NATIVE_BOOKKEEPING else python_sort_released
mark_hashed = native_mark_hashed if NATIVE_BOOKKEEPING else python_mark_hashed
