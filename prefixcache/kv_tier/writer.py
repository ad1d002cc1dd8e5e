"""The tier's background writer: stores values off the engine's thread, best effort.

``submit`` never blocks and never fails: a value that would push the queued bytes past
``max_queued_bytes`` is dropped and counted, so a slow or dead tier costs the engine
nothing but the copy it already made. One daemon thread drains the queue in batches of
up to ``MAX_BATCH`` values per backend call (one pipeline round trip for Redis). When the
interpreter exits, what is still queued gets a few seconds to be written (a one-shot
``prefixcache generate`` would otherwise lose its last blocks).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable

from prefixcache.kv_tier.backend import KVTierBackend

MAX_BATCH = 16
EXIT_FLUSH_SECONDS = 5.0


class BackgroundWriter:
    """Writes ``(key, value)`` pairs to ``backend`` from one thread. ``on_error`` is
    called (on that thread) with each exception a batch raised; the batch is dropped.

    Counters (read them from any thread): ``num_written`` values stored,
    ``num_already_held`` values the backend already had, ``num_dropped`` values refused
    because the queue was full or lost to an error, ``num_bytes_written``.
    """

    def __init__(self, backend: KVTierBackend, max_queued_bytes: int,
                 on_error: Callable[[BaseException], None]) -> None:
        self.backend = backend
        self.max_queued_bytes = max_queued_bytes
        self._on_error = on_error
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._condition = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.num_written = 0
        self.num_already_held = 0
        self.num_dropped = 0
        self.num_bytes_written = 0

    def submit(self, key: str, value: bytes) -> bool:
        """Queue one value; False (and counted in ``num_dropped``) when the queue is
        full or the writer is closed."""
        with self._condition:
            if self._closed or self._queued_bytes + len(value) > self.max_queued_bytes:
                self.num_dropped += 1
                return False
            self._queue.append((key, value))
            self._queued_bytes += len(value)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-tier-writer",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.flush, EXIT_FLUSH_SECONDS)
            self._condition.notify()
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is written (or dropped); False on
        timeout."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while self._queue or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._condition.wait(remaining)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting values, write what is queued (up to ``timeout_s``) and stop."""
        self.flush(timeout_s)
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            atexit.unregister(self.flush)

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft()
                         for _ in range(min(MAX_BATCH, len(self._queue)))]
                batch_bytes = sum(len(value) for _, value in batch)
                self._queued_bytes -= batch_bytes
                self._in_flight = len(batch)
            try:
                num_written = self.backend.put_many(batch)
            except Exception as error:  # noqa: BLE001 - best effort: count and go on
                num_written = None
                self._on_error(error)
            with self._condition:
                if num_written is None:
                    self.num_dropped += len(batch)
                else:
                    self.num_written += num_written
                    self.num_already_held += len(batch) - num_written
                    # Values of one batch are all blocks of one layout: the same size.
                    self.num_bytes_written += num_written * (batch_bytes // len(batch))
                self._in_flight = 0
                self._condition.notify_all()
