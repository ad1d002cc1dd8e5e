"""``ZmqEventPublisher``: KV event batches published over ZeroMQ, speaking vLLM's
``ZmqEventPublisher`` protocol.

Live stream (an XPUB socket: a PUB that also sees subscriptions): one multipart message per
batch, ``(topic, seq, payload)`` where ``topic`` is the UTF-8 topic (empty by default),
``seq`` the batch's sequence number as 8 bytes big-endian (consecutive per publisher, see
below) and ``payload`` the msgpack ``KVEventBatch`` (see ``wire``).

Restarts. Subscribers track each publisher's last sequence number: vllm-router drops a batch
whose number it has seen already, takes a lower one as the engine's restart, and asks for a
replay when numbers skip. An engine that restarts and numbers from 0 again is therefore
invisible to it when its predecessor published exactly one batch (seq 0): the new seq 0 is
dropped as seen, seq 1 follows on, and the blocks of the dead engine stay in the router's
index. So by default a publisher numbers from the microseconds since the epoch at its start
(``first_seq``), which no predecessor on the same endpoint can have reached, and its first
batch is an ``AllBlocksCleared`` (``clear_on_start``): an engine starts with an empty cache.
That first batch goes out before a reconnecting subscriber is back (PUB drops messages for
peers still connecting), so until the engine's first blocks are published, every
subscription that arrives (the live socket is an XPUB, which sees them) gets another
``AllBlocksCleared`` with the next number. A subscriber that saw the predecessor sees a
skip, asks for a replay, and gets the clears (vllm-router, finding the replay does not
continue its numbering, drops its view of that engine and carries on from the live batch).
``first_seq=0`` and ``clear_on_start=False`` give vLLM's own numbering.

Replay (optional ROUTER socket): a client (REQ, or DEALER sending an empty delimiter first)
sends the first sequence number it wants as 8 bytes big-endian. The publisher answers with
one ``(topic, seq, payload)`` message per buffered batch whose sequence number is at least
that, oldest first, then ``(topic, -1 as 8 signed big-endian bytes, b"")`` to mark the end:
the live message's three frames behind the envelope, as vLLM's publisher sends them and
vllm-router's replay client requires (it reads the sequence number from the next-to-last
frame and drops shorter answers). Only the last ``buffer_steps`` batches are kept.

The engine loop never waits on the network: ``publish`` stamps the batch, gives it its
sequence number and appends it to a bounded in-memory queue; a background thread, woken at
once, converts, encodes, sends, buffers for replay and answers replay requests. A caller that
must not let anyone learn of a step before its events are out (the server: a router reads
the events to place the next request of the same prefix) calls ``wait_until_sent`` after
``publish`` and before it hands out the step's outputs; that wait is bounded. When the queue is full
the oldest queued batch is dropped and ``num_dropped_batches`` counts it. A dropped batch
keeps its sequence number, so subscribers see the gap (which replay cannot fill: the batch
was never sent) and know their view of this engine's cache is incomplete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixcache.core.kv_events import AllBlocksCleared
from prefixcache.events.convert import BLOCK_HASH_FORMATS, BlockHashFormat, make_batch
from prefixcache.events.publisher import (
    END_OF_REPLAY,
    MAX_SEQ,
    EventPublisher,
    restart_safe_first_seq,
    seq_to_bytes,
)
from prefixcache.events.wire import encode_batch

if TYPE_CHECKING:
    from prefixcache.core.kv_events import KVCacheEvent

logger = logging.getLogger(__name__)

# The background thread's longest idle poll. Publishing, closing and replay requests all
# wake it at once, so this bounds nothing but its idle wake-ups.
_IDLE_POLL_MS = 100


_CLOSE_LINGER_MS = 200


class ZmqEventPublisher(EventPublisher):
    """Non-blocking PUB (+ optional ROUTER replay) publisher of KV event batches.

    Args:
        endpoint: ZMQ address of the live stream, e.g. ``tcp://127.0.0.1:5557``,
            ``tcp://*:5557`` or ``ipc:///tmp/kv-events``. ``tcp://host:*`` picks a free port;
            read the result from ``self.endpoint``.
        replay_endpoint: ZMQ address the ROUTER replay socket binds to, or None for no
            replay.
        topic: prefix sent as the first frame of every live message (subscribers filter
            on it).
        data_parallel_rank: stamped into every batch. vLLM stamps 0 when data
            parallelism is off, and so do we. The endpoints are bound as given;
            ``endpoint.endpoint_for_rank`` derives each replica's own from shared ones.
        block_hash_format: ``"int64"`` (vLLM's default) or ``"bytes"`` (raw digests).
        max_queue_size: batches that may wait for the background thread before the
            oldest is dropped.
        buffer_steps: batches kept for replay.
        hwm: ZMQ send high-water mark of the PUB socket (messages per subscriber).
        bind: True (default) binds the PUB socket, the engine being the stable end that
            subscribers connect to. False connects it instead, to push into a collector
            that binds. (vLLM guesses: it binds only wildcard, ipc and inproc addresses.)
        clear_on_close: publish a last ``AllBlocksCleared`` batch in ``close()`` (see
            there); only a publisher that has published anything does.
        first_seq: the first batch's sequence number; None (default) picks
            ``restart_safe_first_seq()`` (see the module docstring), 0 is vLLM's.
        clear_on_start: publish ``AllBlocksCleared`` as the first batch, and again for
            each subscription until the first other batch, so a subscriber that knew a
            predecessor on this endpoint forgets its blocks.

    Attributes read by the server's ``/metrics``: ``num_published_batches`` (sent on the
    PUB socket) and ``num_dropped_batches`` (lost to a full queue).

    ``publish`` wakes the thread at once (a byte on a pipe the thread polls beside the
    replay socket), so a batch leaves within the time it takes to encode it.

    Socket errors (a taken port, a bad address) raise from the constructor. After that
    every socket belongs to the background thread. ``close()`` sends what is queued,
    stops the thread and releases the sockets; it is bounded by ``close_timeout_s``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int | None = 0,
        block_hash_format: BlockHashFormat = "int64",
        max_queue_size: int = 100_000,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool = True,
        close_timeout_s: float = 2.0,
        clear_on_close: bool = True,
        first_seq: int | None = None,
        clear_on_start: bool = True,
    ) -> None:
        import zmq  # only engines that publish pay for the import

        if block_hash_format not in BLOCK_HASH_FORMATS:
            raise ValueError(f"block_hash_format must be one of {BLOCK_HASH_FORMATS}")
        if max_queue_size < 1 or buffer_steps < 0:
            raise ValueError("max_queue_size must be >= 1 and buffer_steps >= 0")
        if first_seq is None:
            first_seq = restart_safe_first_seq()
        if not 0 <= first_seq <= MAX_SEQ:
            raise ValueError(f"first_seq must be between 0 and {MAX_SEQ}")
        self._topic = topic.encode("utf-8")
        self._data_parallel_rank = data_parallel_rank
        self._block_hash_format: BlockHashFormat = block_hash_format
        self._max_queue_size = max_queue_size
        self._close_timeout_s = close_timeout_s
        self._clear_on_close = clear_on_close

        self._context = zmq.Context()
        # XPUB: a PUB that also reads its peers' subscriptions (see clear_on_start).
        self._pub = self._context.socket(zmq.XPUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not just new topics
            if bind:
                self._pub.bind(endpoint)
                self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            raise

        # (seq, ts, events) waiting for the thread; guarded by _cond.
        self._queue: deque[tuple[int, float, Sequence[KVCacheEvent]]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._first_seq = first_seq
        self._next_seq = first_seq
        # Every batch below this sequence number has been sent (or dropped); guarded by _cond.
        self._done_until_seq = first_seq
        self._closing = False
        self._closed = False
        # (seq, payload) of the last buffer_steps sent batches; only the thread touches it.
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.num_published_batches = 0
        self.num_dropped_batches = 0
        self.num_replay_requests = 0

        # publish() writes a byte here to wake the thread out of its poll.
        self._wake_read_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self._wake_read_fd, False)
        os.set_blocking(self._wake_write_fd, False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_read_fd, zmq.POLLIN)
        self._poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)

        self._thread = threading.Thread(
            target=self._run, name="prefixcache-kv-events", daemon=True
        )
        # True until a batch other than the start's clears is queued; guarded by _cond.
        self._clears_new_subscribers = clear_on_start
        # Whether publish() queued the engine's own events (the start's clear is not).
        self._has_published_events = False
        if clear_on_start:
            with self._cond:
                self._enqueue([AllBlocksCleared()], time.time())
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> None:
        """Queue one step's core events as one batch; never blocks on I/O.

        ``events`` must not be mutated afterwards (``take_events()`` hands over a fresh
        list). ``ts`` defaults to now. An empty ``events`` publishes nothing and uses no
        sequence number. Raises RuntimeError after ``close()``.
        """
        if not events:
            return
        with self._cond:
            if self._closing:
                raise RuntimeError("publish() on a closed ZmqEventPublisher")
            self._clears_new_subscribers = False
            self._has_published_events = True
            self._enqueue(events, time.time() if ts is None else ts)

    def _enqueue(self, events: Sequence[KVCacheEvent], ts: float) -> None:
        """Queue one batch under the next sequence number and wake the thread. The caller
        holds ``_cond``."""
        if len(self._queue) >= self._max_queue_size:
            self._queue.popleft()
            self.num_dropped_batches += 1
        self._queue.append((self._next_seq, ts, events))
        self._next_seq += 1
        self._wake()  # under the lock: close() cannot release the pipe meanwhile

    def wait_until_sent(self, timeout_s: float) -> bool:
        """See ``EventPublisher.wait_until_sent``. False after ``timeout_s`` (a stuck
        thread) and after ``close()``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._next_seq
            while self._done_until_seq < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(remaining)
        return True

    def _wake(self) -> None:
        # A full pipe means the thread has a wake-up pending already.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_write_fd, b"\0")

    def close(self) -> None:
        """Send what is queued, stop the thread, release the sockets. Idempotent.

        When anything was published, a last batch holding ``AllBlocksCleared`` goes out
        first: the engine behind this publisher is going away with its cache, and a router
        must not keep sending requests there for blocks that no longer exist when the
        replica comes back. (An engine that dies without closing leaves that to its
        successor's ``clear_on_start``.)
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._has_published_events and self._clear_on_close:
                self._queue.append((self._next_seq, time.time(), [AllBlocksCleared()]))
                self._next_seq += 1
            self._closing = True
            self._cond.notify_all()  # waiters in wait_until_sent give up
            self._wake()
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            # Sockets are not thread-safe: leave them to the (daemon) thread rather than
            # close them under it.
            logger.warning("KV event publisher thread did not stop within %.1fs",
                           self._close_timeout_s)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        # A short linger lets the last batches reach connected subscribers without letting
        # a dead peer hold shutdown hostage.
        self._pub.close(linger=_CLOSE_LINGER_MS)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
        for fd in (getattr(self, "_wake_read_fd", None), getattr(self, "_wake_write_fd", None)):
            if fd is not None:  # None when the constructor failed before making the pipe
                os.close(fd)

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                pending = list(self._queue)
                self._queue.clear()
                closing = self._closing
                # Dropped batches never come: count them as done.
                done_until = pending[0][0] if pending else self._next_seq
                if done_until > self._done_until_seq:
                    self._done_until_seq = done_until
                    self._cond.notify_all()
            for seq, ts, events in pending:
                try:
                    self._send(seq, ts, events)
                except Exception:
                    # One bad batch must not kill the stream; subscribers see its gap.
                    logger.exception("failed to publish KV event batch %d", seq)
                with self._cond:
                    self._done_until_seq = max(self._done_until_seq, seq + 1)
                    self._cond.notify_all()
            if closing and not pending:
                return
            try:
                self._wait_for_work(wait=not pending and not closing)
            except Exception:
                logger.exception("failed to serve a KV event replay request")

    def _wait_for_work(self, wait: bool) -> None:
        """Poll the wake pipe, the live socket's subscriptions and the replay socket (up to
        ``_IDLE_POLL_MS`` when ``wait``); answer waiting replay requests."""
        ready = dict(self._poller.poll(_IDLE_POLL_MS if wait else 0))
        if self._wake_read_fd in ready:
            try:
                while os.read(self._wake_read_fd, 4096):
                    pass
            except BlockingIOError:
                pass
        if self._pub in ready:
            self._read_subscriptions()
        if self._replay is not None and self._replay in ready:
            self._serve_replay()

    def _read_subscriptions(self) -> None:
        """Drain the XPUB's subscription messages; while the engine has published nothing
        but the start's clears, answer any subscription with one more clear (see the
        module docstring)."""
        import zmq

        num_subscriptions = 0
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            num_subscriptions += message[:1] == b"\x01"
        if num_subscriptions:
            with self._cond:
                if self._clears_new_subscribers and not self._closing:
                    self._enqueue([AllBlocksCleared()], time.time())

    def _send(self, seq: int, ts: float, events: Sequence[KVCacheEvent]) -> None:
        batch = make_batch(events, ts, self._data_parallel_rank, self._block_hash_format)
        payload = encode_batch(batch)
        seq_bytes = seq_to_bytes(seq)
        self._pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
        self._replay_buffer.append((seq, payload))
        self.num_published_batches += 1

    def _serve_replay(self) -> None:
        import zmq

        replay = self._replay
        # Answer every request already waiting, not just one, so a burst of late joiners
        # does not wait one idle period each.
        while replay.poll(0):
            frames = replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3:
                logger.warning("ignoring malformed KV event replay request (%d frames)",
                               len(frames))
                continue
            client_id, _, start_frame = frames
            start_seq = int.from_bytes(start_frame, "big")
            self.num_replay_requests += 1
            topic = self._topic
            for seq, payload in self._replay_buffer:
                if seq >= start_seq:
                    replay.send_multipart((client_id, b"", topic, seq_to_bytes(seq), payload),
                                          copy=False)
            replay.send_multipart((client_id, b"", topic, END_OF_REPLAY, b""))
