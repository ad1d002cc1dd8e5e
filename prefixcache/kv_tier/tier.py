"""The second KV tier: blocks by chained hash in a store shared across replicas or
restarts, behind the in-process block pool.

:class:`KVTier` gives the engine three calls, all on block hashes of one request's
chain, and moves bytes only (the worker turns them into tensors):

1. ``lookup(block_hashes)`` — how many *leading* blocks the tier holds. A chain is only
   useful up to its first gap (a server evicting with LRU may drop any block), so the
   count stops there.
2. ``load(block_hashes, block_token_ids)`` — the leading blocks' payloads, each verified
   (:mod:`~prefixcache.kv_tier.block_value`) against this engine's layout fingerprint,
   the hash and the block's token ids. The result stops at the first block missing or
   invalid; an invalid value is counted (``num_invalid_values``), never returned.
3. ``store(block_hash, token_ids, payload)`` — queue a block for the background writer
   (:mod:`~prefixcache.kv_tier.writer`); best effort, never blocks.

Failures are misses: any exception from the backend (connection refused, timeout, full
disk) is counted in ``num_errors`` and the call answers "nothing held"; after one, the
tier is not asked again for ``retry_interval_s`` seconds, so a dead server costs one
timeout per interval, not one per request. A request never fails because of the tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.kv_tier.backend import KVTierBackend
from prefixcache.kv_tier.block_value import (
    InvalidBlockValue,
    decode_block_value,
    encode_block_value,
)
from prefixcache.kv_tier.identity import KVLayout
from prefixcache.kv_tier.writer import BackgroundWriter

logger = logging.getLogger(__name__)

KEY_NAMESPACE = "prefixcache"
ADMISSION_POLICIES = ("always", "seen-twice")
DEFAULT_WRITE_QUEUE_BYTES = 256 * 1024**2
DEFAULT_RETRY_INTERVAL_S = 2.0
# Hashes remembered as held by the tier (stored or found), so a block is not copied out
# of the KV cache again just to learn the tier has it; and hashes seen once, for the
# "seen-twice" admission. Bounded: forgetting costs one redundant copy or admission.
MAX_REMEMBERED_HASHES = 65536


@dataclass(slots=True)
class KVTierStats:
    """The tier's counters since it was opened. Blocks and bytes moved
    (``num_blocks_loaded``/``num_bytes_read``, ``num_blocks_stored``/``num_bytes_written``),
    writes skipped because the tier had the block (``num_writes_skipped``) or dropped
    (queue full, or a write error: ``num_writes_dropped``), values refused by
    verification (``num_invalid_values``), backend failures (``num_errors``), and the time
    spent in loads (``load_seconds`` over ``num_loads`` calls)."""

    num_blocks_loaded: int = 0
    num_bytes_read: int = 0
    num_blocks_stored: int = 0
    num_bytes_written: int = 0
    num_writes_skipped: int = 0
    num_writes_dropped: int = 0
    num_invalid_values: int = 0
    num_errors: int = 0
    num_loads: int = 0
    load_seconds: float = 0.0


class KVTier:
    """A tier of KV blocks with ``layout`` (which fixes the key space and the block
    size in bytes) on ``backend``; see the module docstring.

    ``admission`` is ``"always"`` (store every block offered) or ``"seen-twice"`` (store
    a block the second time it is offered, so one-off prompts never reach the tier).
    ``write_queue_bytes`` bounds the bytes waiting for the writer.
    """

    def __init__(self, backend: KVTierBackend, layout: KVLayout, *,
                 admission: str = "always",
                 write_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES,
                 retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S) -> None:
        if admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_POLICIES)}, "
                             f"got {admission!r}")
        self.backend = backend
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.block_nbytes = layout.block_nbytes
        self.admission = admission
        self.retry_interval_s = retry_interval_s
        self.key_prefix = f"{KEY_NAMESPACE}:{self.fingerprint[:16].hex()}:"
        self._stats = KVTierStats()
        self._stats_lock = threading.Lock()  # the writer thread counts errors too
        self._unavailable_until = 0.0
        self._held_hashes: OrderedDict[bytes, None] = OrderedDict()
        self._seen_once_hashes: OrderedDict[bytes, None] = OrderedDict()
        self._writer = BackgroundWriter(backend, write_queue_bytes, self._note_error)

    @property
    def description(self) -> str:
        return self.backend.description

    def key(self, block_hash: bytes) -> str:
        return self.key_prefix + block_hash.hex()

    # -- reads (engine thread) ------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the tier holds (0 on any error)."""
        if not block_hashes or not self._is_available():
            return 0
        try:
            held = self.backend.exists_many([self.key(h) for h in block_hashes])
        except Exception as error:  # noqa: BLE001 - a tier failure is a miss
            self._note_error(error)
            return 0
        num_held = 0
        for is_held in held:
            if not is_held:
                break
            num_held += 1
        self._remember_held(block_hashes[:num_held])
        return num_held

    def load(self, block_hashes: Sequence[bytes],
             block_token_ids: Sequence[Sequence[int]]) -> list[memoryview]:
        """The verified payloads of the leading blocks of ``block_hashes`` whose token ids
        are ``block_token_ids`` (one list per block), stopping at the first block missing
        or invalid; [] on any error."""
        if not block_hashes or not self._is_available():
            return []
        started = time.perf_counter()
        try:
            values = self.backend.get_many([self.key(h) for h in block_hashes])
        except Exception as error:  # noqa: BLE001 - a tier failure is a miss
            self._note_error(error)
            return []
        payloads: list[memoryview] = []
        num_bytes_read = 0
        num_invalid = 0
        for block_hash, token_ids, value in zip(block_hashes, block_token_ids, values,
                                                 strict=True):
            if value is None:
                break
            num_bytes_read += len(value)
            try:
                payloads.append(decode_block_value(value, self.fingerprint, block_hash,
                                                   token_ids, self.block_nbytes))
            except InvalidBlockValue as invalid:
                logger.warning("KV tier %s: block %s refused (%s); it will be recomputed",
                               self.description, block_hash.hex()[:16], invalid.reason)
                num_invalid = 1
                break
        with self._stats_lock:
            stats = self._stats
            stats.num_loads += 1
            stats.load_seconds += time.perf_counter() - started
            stats.num_blocks_loaded += len(payloads)
            stats.num_bytes_read += num_bytes_read
            stats.num_invalid_values += num_invalid
        return payloads

    # -- writes -----------------------------------------------------------------------------

    def wants(self, block_hash: bytes) -> bool:
        """Whether a block just computed should be offered to :meth:`store`: not when the
        tier is known to hold it, nor (``"seen-twice"``) the first time it is seen. Cheap:
        call it before copying the block out of the KV cache."""
        if block_hash in self._held_hashes:
            return False
        if self.admission == "seen-twice":
            seen = self._seen_once_hashes
            if block_hash not in seen:
                seen[block_hash] = None
                if len(seen) > MAX_REMEMBERED_HASHES:
                    seen.popitem(last=False)
                return False
            del seen[block_hash]
        return True

    def store(self, block_hash: bytes, token_ids: Sequence[int],
              payload: bytes | memoryview) -> bool:
        """Queue block ``block_hash`` (``token_ids``, KV ``payload`` of ``block_nbytes``)
        for the background writer; False when dropped (queue full) or not offered (the
        tier is down). Never blocks, never raises for the tier's sake."""
        if not self._is_available():
            return False
        payload_nbytes = len(payload) if isinstance(payload, bytes) else payload.nbytes
        if payload_nbytes != self.block_nbytes:
            raise ValueError(f"a block payload is {self.block_nbytes} bytes in this layout, "
                             f"got {payload_nbytes}")
        value = encode_block_value(self.fingerprint, block_hash, token_ids, payload)
        if not self._writer.submit(self.key(block_hash), value):
            return False
        self._remember_held((block_hash,))
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the blocks queued so far are written; False on timeout."""
        return self._writer.flush(timeout_s)

    def clear(self) -> int:
        """Delete every block of this layout from the tier (other layouts' blocks stay);
        returns how many, or 0 on an error (counted)."""
        self.flush()
        self._held_hashes.clear()
        try:
            return self.backend.clear(self.key_prefix)
        except Exception as error:  # noqa: BLE001 - reported as a count, not raised
            self._note_error(error)
            return 0

    def close(self) -> None:
        """Write what is queued (a few seconds at most), then release the backend."""
        self._writer.close()
        self.backend.close()

    @property
    def stats(self) -> KVTierStats:
        """A copy of the counters."""
        writer = self._writer
        with self._stats_lock:
            stats = KVTierStats(**{name: getattr(self._stats, name)
                                   for name in KVTierStats.__slots__})
        stats.num_blocks_stored = writer.num_written
        stats.num_bytes_written = writer.num_bytes_written
        stats.num_writes_skipped = writer.num_already_held
        stats.num_writes_dropped = writer.num_dropped
        return stats

    # -- internals --------------------------------------------------------------------------

    def _remember_held(self, block_hashes: Sequence[bytes]) -> None:
        held = self._held_hashes
        for block_hash in block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > MAX_REMEMBERED_HASHES:
            held.popitem(last=False)

    def _is_available(self) -> bool:
        return time.monotonic() >= self._unavailable_until

    def _note_error(self, error: BaseException) -> None:
        with self._stats_lock:
            self._stats.num_errors += 1
        first = time.monotonic() >= self._unavailable_until
        self._unavailable_until = time.monotonic() + self.retry_interval_s
        if first:
            logger.warning("KV tier %s failed (%s: %s); treated as a miss, retried in %.0f s",
                           self.description, type(error).__name__, error,
                           self.retry_interval_s)
