"""Receiving KV event batches: the consumer side of ``zmq_publisher``'s protocol.

Works against our publisher and vLLM's alike. ``EventSubscriber.receive`` hands batches
over in sequence order: when the live stream skips sequence numbers and a replay endpoint
is known, it fetches the missing batches first; whatever replay cannot supply is counted
in ``num_missed_batches`` (a router would then distrust its view of that engine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from prefixcache.events.publisher import END_OF_REPLAY_SEQ, seq_from_bytes
from prefixcache.events.wire import AllBlocksCleared, KVEventBatch, decode_batch


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One batch and where it came from (the live PUB stream, or a replay)."""

    seq: int
    batch: KVEventBatch
    is_replay: bool = False


class EventSubscriber:
    """A SUB socket on a publisher's live stream, plus an optional replay client.

    Args:
        endpoint: the publisher's PUB address; connected to (or bound, with ``bind``, when
            the publisher connects).
        topic: only messages whose topic starts with this are received ("" = all).
        replay_endpoint: the publisher's ROUTER address, or None.

    A malformed address raises ``zmq.ZMQError`` from the constructor (nothing is left
    open). Not thread-safe (ZMQ sockets); use from one thread. Close it, or use ``with``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        bind: bool = False,
    ) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._replay_endpoint = replay_endpoint
        self._replay: zmq.Socket | None = None
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            if bind:
                self._sub.bind(endpoint)
            else:
                self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._connect_replay()  # a bad address fails here, not at the first gap
        except BaseException:
            self.close()
            raise
        self.last_seq: int | None = None
        self.num_missed_batches = 0
        self.num_malformed_messages = 0

    # -- live stream ---------------------------------------------------------------------

    def recv_live(self, timeout_s: float) -> ReceivedBatch | None:
        """The next live message as it arrives (no ordering, no gap filling), or None.

        Messages that are not ``(topic, 8-byte seq, payload)`` or do not decode are
        counted in ``num_malformed_messages`` and skipped.
        """
        if not self._sub.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_malformed_messages += 1
            return None
        try:
            batch = decode_batch(frames[2])
        except Exception:
            self.num_malformed_messages += 1
            return None
        return ReceivedBatch(seq_from_bytes(frames[1]), batch)

    def receive(self, timeout_s: float) -> list[ReceivedBatch]:
        """The batches that follow ``last_seq``, in order; [] if none arrived in time.

        Waits for one live message. Batches at or before ``last_seq`` (already seen, e.g.
        through a replay) are dropped. A gap before the live batch is filled from the
        replay endpoint when there is one; the part replay cannot fill is added to
        ``num_missed_batches``. The first batch ever received defines the start: nothing
        before it counts as missed (ask ``replay`` for history).
        """
        received = self.recv_live(timeout_s)
        if received is None:
            return []
        if self.last_seq is None:
            self.last_seq = received.seq
            return [received]
        if received.seq <= self.last_seq:
            return []
        previous_seq = self.last_seq
        batches: list[ReceivedBatch] = []
        if received.seq > previous_seq + 1 and self._replay_endpoint is not None:
            try:
                replayed = self.replay(previous_seq + 1, timeout_s=max(timeout_s, 1.0))
            except TimeoutError:
                replayed = []
            batches = [r for r in replayed if previous_seq < r.seq < received.seq]
        batches.append(received)
        self.num_missed_batches += _num_missed_that_matter(previous_seq, batches)
        self.last_seq = received.seq
        return batches

    # -- replay --------------------------------------------------------------------------

    def replay(self, from_seq: int, timeout_s: float = 2.0) -> list[ReceivedBatch]:
        """Ask the replay endpoint for every buffered batch with seq >= ``from_seq``.

        Returns them in the publisher's order; ``last_seq`` is left alone (see
        ``catch_up``). Raises ValueError without a replay endpoint and TimeoutError when the
        end-of-replay marker does not arrive within ``timeout_s`` (the replay socket is
        then recreated, so a late answer cannot be mistaken for the next one).
        """
        if self._replay_endpoint is None:
            raise ValueError("this subscriber has no replay endpoint")
        if from_seq < 0:
            raise ValueError("from_seq must be >= 0")
        replay = self._replay if self._replay is not None else self._connect_replay()
        # The empty frame is the delimiter a REQ socket would add; ROUTER expects it.
        replay.send_multipart((b"", from_seq.to_bytes(8, "big")))
        batches: list[ReceivedBatch] = []
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not replay.poll(remaining_ms):
                replay.close(linger=0)
                self._replay = None
                raise TimeoutError(f"no end of replay from {self._replay_endpoint} "
                                   f"within {timeout_s}s")
            frames = replay.recv_multipart()
            # [b"", topic, seq, payload] (vLLM's and ours), or [b"", seq, payload] from
            # publishers that leave the topic out: the seq is always next to last.
            if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                self.num_malformed_messages += 1
                continue
            seq = seq_from_bytes(frames[-2])
            if seq == END_OF_REPLAY_SEQ:
                break
            try:
                batch = decode_batch(frames[-1])
            except Exception:  # counted and skipped, as on the live stream
                self.num_malformed_messages += 1
                continue
            batches.append(ReceivedBatch(seq, batch, is_replay=True))
        return batches

    def _connect_replay(self) -> zmq.Socket:
        self._replay = self._context.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(self._replay_endpoint)
        return self._replay

    def catch_up(self, from_seq: int, timeout_s: float = 2.0) -> list[ReceivedBatch]:
        """``replay(from_seq)``, then continue ``receive`` right after what it returned.

        Afterwards ``receive`` treats everything from ``from_seq`` on as expected: live
        batches already replayed are skipped, and a later gap is filled or counted.
        """
        batches = self.replay(from_seq, timeout_s)
        self.last_seq = batches[-1].seq if batches else from_seq - 1
        return batches

    def close(self) -> None:
        """Release the sockets; idempotent, never waits."""
        if self._context.closed:
            return
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _num_missed_that_matter(previous_seq: int, batches: list[ReceivedBatch]) -> int:
    """Sequence numbers after ``previous_seq`` up to the last of ``batches`` (ascending)
    that none of them holds, not counting those before a batch that clears every block:
    what such a batch follows no longer matters. A restarted publisher opens with one,
    numbered past its predecessor's batches, so a restart is not a loss."""
    start = previous_seq + 1
    num_held = len(batches)
    for index in range(len(batches) - 1, -1, -1):
        if any(isinstance(event, AllBlocksCleared) for event in batches[index].batch.events):
            start, num_held = batches[index].seq, len(batches) - index
            break
    return batches[-1].seq - start + 1 - num_held
