"""The ZMQ publisher and subscriber over real sockets (127.0.0.1 and ipc in tmp_path).

Every wait is a poll with a deadline of a few seconds; nothing asserts on elapsed time.
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import zmq

from prefixcache.core import kv_events as core
from prefixcache.events.convert import make_batch
from prefixcache.events.endpoint import endpoint_for_rank
from prefixcache.events.publisher import (
    END_OF_REPLAY,
    NullEventPublisher,
    make_event_publisher,
    seq_from_bytes,
)
from prefixcache.events.subscriber import EventSubscriber
from prefixcache.events.wire import decode_batch, encode_batch
from prefixcache.events.zmq_publisher import ZmqEventPublisher
from tests.events import VLLM_NUMBERING
from tests.processes import free_loopback_ports

TCP_ANY_PORT = "tcp://127.0.0.1:*"
DEADLINE_S = 5.0


def _digest(n: int) -> bytes:
    return hashlib.sha256(n.to_bytes(4, "big")).digest()


def _step_records(step: int) -> list[core.KVCacheEvent]:
    """A small, distinct engine step: two stored blocks, one eviction, sometimes a reset."""
    records: list[core.KVCacheEvent] = [
        core.BlockStored(
            block_hashes=[_digest(2 * step), _digest(2 * step + 1)],
            parent_block_hash=_digest(step - 1) if step else None,
            token_ids=list(range(8 * step, 8 * step + 8)),
            block_size=4,
            extra_keys=[(("cache_salt", f"s{step}"),), None] if step % 2 else None,
        ),
        core.BlockRemoved(block_hashes=[_digest(1000 + step)]),
    ]
    if step % 3 == 2:
        records.append(core.AllBlocksCleared())
    return records


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def _wait_until_subscribed(publisher: ZmqEventPublisher, subscriber: EventSubscriber) -> int:
    """Publish probe batches until one arrives (PUB drops messages for peers still
    connecting); returns how many probes were published, i.e. the next sequence number."""
    num_probes = 0
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        publisher.publish([core.AllBlocksCleared()], ts=0.0)
        num_probes += 1
        if subscriber.recv_live(0.05) is not None:
            return num_probes
    pytest.fail("subscriber never received a probe")


@pytest.fixture
def publisher():
    pub = ZmqEventPublisher(TCP_ANY_PORT, replay_endpoint=TCP_ANY_PORT, topic="kv@engine-0",
                            **VLLM_NUMBERING)
    yield pub
    pub.close()


def test_published_batches_decode_to_the_same_events_in_sequence(publisher):
    with EventSubscriber(publisher.endpoint, topic="kv") as subscriber:
        first_seq = _wait_until_subscribed(publisher, subscriber)
        steps = range(12)
        for step in steps:
            publisher.publish(_step_records(step), ts=1000.0 + step)

        received = []
        deadline = time.monotonic() + DEADLINE_S
        while len(received) < len(steps) and time.monotonic() < deadline:
            message = subscriber.recv_live(0.1)
            if message is not None and message.seq >= first_seq:
                received.append(message)

    assert [r.seq for r in received] == [first_seq + step for step in steps]
    for step, message in zip(steps, received, strict=True):
        expected = make_batch(_step_records(step), ts=1000.0 + step, data_parallel_rank=0)
        # Same bytes means same events, including the nested tuples msgpack turns to lists.
        assert encode_batch(message.batch) == encode_batch(expected)
        assert not message.is_replay


def test_a_batch_is_on_the_wire_when_wait_until_sent_returns(publisher):
    """wait_until_sent returns once the batch is handed to ZMQ (the server relies on it to
    publish a step before it delivers the step's outputs)."""
    with EventSubscriber(publisher.endpoint, topic="kv") as subscriber:
        next_seq = _wait_until_subscribed(publisher, subscriber)
        while subscriber.recv_live(0.05) is not None:  # drain late probes
            pass
        publisher.publish(_step_records(0), ts=1.0)
        assert publisher.wait_until_sent(DEADLINE_S)
        message = None
        deadline = time.monotonic() + DEADLINE_S
        while message is None and time.monotonic() < deadline:
            message = subscriber.recv_live(0.01)
        assert message is not None and message.seq == next_seq
    publisher.close()
    assert publisher.wait_until_sent(0) is True  # nothing is left unsent


def test_live_frames_are_topic_seq_payload():
    publisher = ZmqEventPublisher(TCP_ANY_PORT, topic="kv", data_parallel_rank=None,
                                  **VLLM_NUMBERING)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        frames = None
        deadline = time.monotonic() + DEADLINE_S
        while frames is None and time.monotonic() < deadline:
            publisher.publish(_step_records(0), ts=5.0)
            if sub.poll(50):
                frames = sub.recv_multipart()
        assert frames is not None
        topic, seq_frame, payload = frames
        assert topic == b"kv"
        assert len(seq_frame) == 8
        assert seq_from_bytes(seq_frame) == int.from_bytes(seq_frame, "big") >= 0
        assert payload == encode_batch(make_batch(_step_records(0), ts=5.0))
    finally:
        sub.close(linger=0)
        context.term()
        publisher.close()


def test_topic_filter_keeps_other_topics_out(publisher):
    with EventSubscriber(publisher.endpoint, topic="other") as subscriber:
        for _ in range(20):
            publisher.publish(_step_records(1))
        _wait_for(lambda: publisher.num_published_batches == 20, "20 batches sent")
        assert subscriber.recv_live(0.2) is None


def test_late_subscriber_catches_up_from_replay(publisher):
    for step in range(5):
        publisher.publish(_step_records(step), ts=float(step))
    _wait_for(lambda: publisher.num_published_batches == 5, "5 batches sent")

    with EventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as sub:
        replayed = sub.catch_up(0)
        assert [r.seq for r in replayed] == [0, 1, 2, 3, 4]
        assert all(r.is_replay for r in replayed)
        for step, message in enumerate(replayed):
            expected = make_batch(_step_records(step), ts=float(step), data_parallel_rank=0)
            assert encode_batch(message.batch) == encode_batch(expected)
        assert sub.last_seq == 4

        # The live stream continues after what was replayed, with nothing missed: batch 5
        # may arrive live or, if the SUB connection raced it, through gap filling.
        publisher.publish(_step_records(5), ts=5.0)
        later = []
        deadline = time.monotonic() + DEADLINE_S
        while not later and time.monotonic() < deadline:
            later = sub.receive(0.1)
            if not later:
                publisher.publish(_step_records(6), ts=6.0)
        assert later[0].seq == 5
        assert sub.num_missed_batches == 0


def test_replay_answers_a_req_client(publisher):
    # vLLM's example client is a REQ socket sending the start as 8 bytes big-endian; the
    # ROUTER sees its identity and empty delimiter. (A REQ socket then reads only the first
    # reply; our subscriber uses DEALER to read them all, see the next test.)
    for step in range(4):
        publisher.publish(_step_records(step), ts=float(step))
    _wait_for(lambda: publisher.num_published_batches == 4, "4 batches sent")

    context = zmq.Context()
    req = context.socket(zmq.REQ)
    try:
        req.connect(publisher.replay_endpoint)
        req.send((2).to_bytes(8, "big"))
        assert req.poll(int(DEADLINE_S * 1000)), "replay did not answer"
        topic, seq_frame, payload = req.recv_multipart()
    finally:
        req.close(linger=0)
        context.term()
    assert topic == b"kv@engine-0"
    assert seq_from_bytes(seq_frame) == 2
    assert decode_batch(payload).ts == 2.0


def test_replay_from_a_dealer_ends_with_minus_one(publisher):
    for step in range(4):
        publisher.publish(_step_records(step), ts=float(step))
    _wait_for(lambda: publisher.num_published_batches == 4, "4 batches sent")

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        messages = []
        while not messages or messages[-1][-2] != END_OF_REPLAY:
            assert dealer.poll(int(DEADLINE_S * 1000)), "replay did not answer"
            messages.append(dealer.recv_multipart())
    finally:
        dealer.close(linger=0)
        context.term()
    # [delimiter, topic, seq, payload]: the live frames behind the envelope, as vLLM sends
    # them; vllm-router's replay client drops any answer with fewer than four frames.
    assert all(len(frames) == 4 for frames in messages)
    assert [frames[0] for frames in messages] == [b""] * 4
    assert [frames[1] for frames in messages] == [b"kv@engine-0"] * 4
    assert [seq_from_bytes(frames[2]) for frames in messages] == [1, 2, 3, -1]
    assert messages[-1][3] == b""
    assert [decode_batch(frames[3]).ts for frames in messages[:-1]] == [1.0, 2.0, 3.0]


def test_a_malformed_replayed_batch_is_counted_and_skipped(publisher):
    """A replay answer whose payload does not decode is dropped like a bad live message,
    and the batches around it still arrive."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(TCP_ANY_PORT)
    good = encode_batch(make_batch(_step_records(1), ts=1.0))

    def answer_once():
        client, _, _ = router.recv_multipart()
        for seq, payload in ((0, b"\xc1 not msgpack"), (1, good)):
            router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    server = threading.Thread(target=answer_once, daemon=True)
    server.start()
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with EventSubscriber(publisher.endpoint, replay_endpoint=endpoint) as sub:
            batches = sub.replay(0, timeout_s=DEADLINE_S)
            assert [b.seq for b in batches] == [1]
            assert sub.num_malformed_messages == 1
    finally:
        server.join(DEADLINE_S)
        router.close()


def test_receive_fills_a_gap_from_replay(publisher):
    with EventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as sub:
        next_seq = _wait_until_subscribed(publisher, sub)
        for step in range(4):
            publisher.publish(_step_records(step), ts=float(step))
        first = []
        deadline = time.monotonic() + DEADLINE_S
        while len(first) < 4 and time.monotonic() < deadline:
            message = sub.recv_live(0.1)
            if message is not None and message.seq >= next_seq:
                first.append(message)
        assert len(first) == 4
        # Pretend the last three were lost on the way: the next live batch reveals the
        # gap, and receive() fetches them before handing it over.
        sub.last_seq = first[0].seq
        publisher.publish(_step_records(9), ts=9.0)
        got = []
        while not got and time.monotonic() < deadline:
            got = sub.receive(0.1)
        assert [r.seq for r in got] == [next_seq + 1, next_seq + 2, next_seq + 3, next_seq + 4]
        assert [r.is_replay for r in got] == [True, True, True, False]
        assert sub.num_missed_batches == 0


def test_full_queue_drops_the_oldest_and_counts():
    small = ZmqEventPublisher(TCP_ANY_PORT, replay_endpoint=TCP_ANY_PORT, max_queue_size=3,
                              **VLLM_NUMBERING)
    entered = threading.Event()
    release = threading.Event()
    real_send = small._send

    def blocking_send(seq, ts, events):
        # Hold the background thread inside the first send so the queue fills up.
        entered.set()
        assert release.wait(DEADLINE_S)
        real_send(seq, ts, events)

    small._send = blocking_send
    try:
        small.publish(_step_records(0), ts=0.0)
        assert entered.wait(DEADLINE_S)
        for step in range(1, 6):  # queue holds 3: seq 1 and 2 are pushed out
            small.publish(_step_records(step), ts=float(step))
        assert small.num_dropped_batches == 2
        release.set()
        _wait_for(lambda: small.num_published_batches == 4, "the 4 surviving batches")
        with EventSubscriber(small.endpoint, replay_endpoint=small.replay_endpoint) as sub:
            replayed = sub.replay(0)
        assert [r.seq for r in replayed] == [0, 3, 4, 5]
        assert [r.batch.ts for r in replayed] == [0.0, 3.0, 4.0, 5.0]
    finally:
        release.set()
        small.close()


def _skip_two_numbers(pub: ZmqEventPublisher, sub: EventSubscriber) -> int:
    """Make the publisher's next two sequence numbers go unsent, as if dropped, with the
    subscriber up to date before them; returns the first skipped number."""
    next_seq = _wait_until_subscribed(pub, sub)
    # Drain stray probes so the next receive sees the first real batch.
    while sub.recv_live(0.05) is not None:
        pass
    sub.last_seq = next_seq - 1
    with pub._cond:
        pub._next_seq += 2
    return next_seq


def test_subscriber_counts_batches_lost_to_drops():
    # A dropped batch keeps its sequence number, so a subscriber can tell it never saw it.
    pub = ZmqEventPublisher(TCP_ANY_PORT, replay_endpoint=TCP_ANY_PORT, **VLLM_NUMBERING)
    try:
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            next_seq = _skip_two_numbers(pub, sub)
            pub.publish(_step_records(0), ts=1.0)
            got = []
            deadline = time.monotonic() + DEADLINE_S
            while not got and time.monotonic() < deadline:
                got = sub.receive(0.1)
            assert [r.seq for r in got] == [next_seq + 2]
            assert sub.num_missed_batches == 2
    finally:
        pub.close()


def test_ipc_endpoints_in_tmp_path(tmp_path):
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay",
                            **VLLM_NUMBERING)
    try:
        pub.publish(_step_records(3), ts=3.0)
        _wait_for(lambda: pub.num_published_batches == 1, "one batch sent")
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            (replayed,) = sub.replay(0)
        assert replayed.seq == 0
        expected = make_batch(_step_records(3), ts=3.0, data_parallel_rank=0)
        assert encode_batch(replayed.batch) == encode_batch(expected)
    finally:
        pub.close()


def test_publisher_can_connect_to_a_binding_subscriber(tmp_path):
    endpoint = f"ipc://{tmp_path}/collector"
    with EventSubscriber(endpoint, bind=True) as sub:
        pub = ZmqEventPublisher(endpoint, bind=False, **VLLM_NUMBERING)
        try:
            assert _wait_until_subscribed(pub, sub) >= 1
        finally:
            pub.close()


def test_empty_steps_publish_nothing_and_close_is_clean(publisher):
    publisher.publish([])
    publisher.publish([], ts=1.0)
    for step in range(50):
        publisher.publish(_step_records(step))
    publisher.close()  # sends what was queued and a last AllBlocksCleared, then stops
    assert publisher.num_published_batches == 51
    assert not publisher._thread.is_alive()
    publisher.close()  # idempotent
    with pytest.raises(RuntimeError):
        publisher.publish(_step_records(0))


def test_bind_errors_raise_from_the_constructor(publisher):
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(publisher.endpoint, **VLLM_NUMBERING)  # port already bound


def test_null_publisher_and_factory():
    null = make_event_publisher(None)
    assert isinstance(null, NullEventPublisher)
    null.publish(_step_records(0))
    null.close()
    assert null.num_dropped_batches == 0 and null.num_published_batches == 0
    with make_event_publisher(TCP_ANY_PORT, topic="t", **VLLM_NUMBERING) as pub:
        assert isinstance(pub, ZmqEventPublisher)
    assert not pub._thread.is_alive()


def test_zmq_publisher_is_still_importable_from_its_old_module():
    from prefixcache.events import publisher
    from prefixcache.events.publisher import ZmqEventPublisher as old_name

    assert old_name is ZmqEventPublisher and publisher.ZmqEventPublisher is ZmqEventPublisher
    with pytest.raises(AttributeError):
        publisher.NoSuchPublisher  # noqa: B018 - the lookup is the test


def test_rank_2_binds_both_ports_plus_2_and_stamps_rank_2_into_every_batch():
    rank = 2
    live_port, replay_port = free_loopback_ports(2)
    # The flags all replicas share name ports two below the free ones; rank 2 lands on them.
    shared_endpoint = f"tcp://127.0.0.1:{live_port - rank}"
    shared_replay_endpoint = f"tcp://127.0.0.1:{replay_port - rank}"
    pub = ZmqEventPublisher(endpoint_for_rank(shared_endpoint, rank),
                            replay_endpoint=endpoint_for_rank(shared_replay_endpoint, rank),
                            data_parallel_rank=rank, **VLLM_NUMBERING)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{live_port}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
        # A router knows only the shared flags and the rank: it connects to port + rank.
        with EventSubscriber(f"tcp://127.0.0.1:{live_port}",
                             replay_endpoint=f"tcp://127.0.0.1:{replay_port}") as sub:
            first_seq = _wait_until_subscribed(pub, sub)
            pub.publish(_step_records(1), ts=1.0)
            live = None
            deadline = time.monotonic() + DEADLINE_S
            while live is None and time.monotonic() < deadline:
                message = sub.recv_live(0.1)
                if message is not None and message.seq >= first_seq:
                    live = message
            assert live is not None, "the batch never arrived on port + rank"
            assert live.batch.data_parallel_rank == rank
            expected = make_batch(_step_records(1), ts=1.0, data_parallel_rank=rank)
            assert encode_batch(live.batch) == encode_batch(expected)

            replayed = sub.replay(0)
        # The probes and the step, each stamped with the rank.
        assert [r.seq for r in replayed] == list(range(first_seq + 1))
        assert {r.batch.data_parallel_rank for r in replayed} == {rank}
    finally:
        pub.close()


def test_close_tells_subscribers_the_cache_is_gone():
    """A closing publisher's last batch is AllBlocksCleared, numbered after the others, so
    a router drops this engine's blocks even when the replica comes back counting from 0."""
    pub = ZmqEventPublisher(TCP_ANY_PORT, replay_endpoint=TCP_ANY_PORT, **VLLM_NUMBERING)
    with EventSubscriber(pub.endpoint) as sub:
        next_seq = _wait_until_subscribed(pub, sub)
        pub.publish(_step_records(1), ts=1.0)
        pub.close()
        received = []
        while len(received) < 2:
            batch = sub.recv_live(DEADLINE_S)
            assert batch is not None, "the closing batches never arrived"
            if batch.seq >= next_seq:  # not a late probe
                received.append(batch)
    assert [r.seq for r in received] == [next_seq, next_seq + 1]
    assert [type(e).__name__ for e in received[1].batch.events] == ["AllBlocksCleared"]


def test_a_publisher_that_published_nothing_closes_silently():
    pub = ZmqEventPublisher(TCP_ANY_PORT, **VLLM_NUMBERING)
    pub.close()
    assert pub.num_published_batches == 0


def test_a_publisher_that_published_nothing_sends_only_its_opening_clear():
    pub = ZmqEventPublisher(TCP_ANY_PORT)
    pub.close()
    assert pub.num_published_batches == 1  # the start's clear, no closing one


def test_a_gap_before_a_clear_of_every_block_is_not_counted_as_missed():
    """What a subscriber missed before an AllBlocksCleared no longer matters (a restarted
    publisher opens with one, numbered past its predecessor's batches)."""
    pub = ZmqEventPublisher(TCP_ANY_PORT, replay_endpoint=TCP_ANY_PORT, **VLLM_NUMBERING)
    try:
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            next_seq = _skip_two_numbers(pub, sub)  # as a restart past the old ones would
            pub.publish([core.AllBlocksCleared()], ts=1.0)
            pub.publish(_step_records(0), ts=2.0)
            got = []
            deadline = time.monotonic() + DEADLINE_S
            while len(got) < 2 and time.monotonic() < deadline:
                got += sub.receive(0.1)
            assert [r.seq for r in got] == [next_seq + 2, next_seq + 3]
            assert sub.num_missed_batches == 0
    finally:
        pub.close()


def _event_names(received) -> list[str]:
    return [type(e).__name__ for e in received.batch.events]


def test_a_publisher_restarted_on_the_same_endpoints_numbers_past_the_dead_one():
    """A replica that dies after one batch of blocks and comes back on the same endpoints:
    the new publisher starts with AllBlocksCleared, numbered past every batch of the dead
    one. A subscriber that knew the dead one therefore sees a skip (and replays, getting
    the clear) rather than a number it has seen already, which it would drop."""
    events_port, replay_port = free_loopback_ports(2)
    endpoint = f"tcp://127.0.0.1:{events_port}"
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    dead = ZmqEventPublisher(endpoint, replay_endpoint=replay_endpoint, clear_on_close=False)
    try:
        dead.publish(_step_records(1), ts=1.0)
        assert dead.wait_until_sent(DEADLINE_S)
        with EventSubscriber(endpoint, replay_endpoint=replay_endpoint) as sub:
            dead_batches = sub.replay(0)
    finally:
        dead.close()  # no last clear: as if the process had been killed
    assert _event_names(dead_batches[0]) == ["AllBlocksCleared"]
    assert "BlockStored" in _event_names(dead_batches[-1])

    reborn = ZmqEventPublisher(endpoint, replay_endpoint=replay_endpoint)
    try:
        assert reborn.wait_until_sent(DEADLINE_S)
        with EventSubscriber(endpoint, replay_endpoint=replay_endpoint) as sub:
            first = sub.replay(0)[0]
    finally:
        reborn.close()
    assert first.seq > dead_batches[-1].seq + 1
    assert _event_names(first) == ["AllBlocksCleared"]


@pytest.mark.parametrize("first_seq", [-1, 1 << 63])
def test_first_seq_must_fit_eight_signed_bytes(first_seq):
    with pytest.raises(ValueError, match="first_seq"):
        ZmqEventPublisher(TCP_ANY_PORT, first_seq=first_seq)


def test_until_its_first_blocks_a_publisher_clears_every_new_subscriber_live():
    """The start's clear goes out before a reconnecting router is back; each subscription
    that arrives before the engine's first blocks gets a clear of its own, live. After
    the first blocks, new subscribers get nothing but the engine's own batches."""
    pub = ZmqEventPublisher(TCP_ANY_PORT, replay_endpoint=TCP_ANY_PORT)
    try:
        with EventSubscriber(pub.endpoint) as sub:
            received = sub.recv_live(DEADLINE_S)
        assert received is not None, "a new subscriber got no clear"
        assert _event_names(received) == ["AllBlocksCleared"]

        pub.publish(_step_records(1), ts=1.0)
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            deadline = time.monotonic() + DEADLINE_S
            while sub.recv_live(0.05) is None:  # until this subscriber is connected
                assert time.monotonic() < deadline, "the subscriber never connected"
                pub.publish(_step_records(4), ts=4.0)
            replayed = sub.replay(0)
    finally:
        pub.close()
    names = [_event_names(r) for r in replayed]
    first_blocks = next(i for i, n in enumerate(names) if "BlockStored" in n)
    assert first_blocks >= 2  # the start's clear and the first subscriber's
    assert all(n == ["AllBlocksCleared"] for n in names[:first_blocks])
    assert all("BlockStored" in n for n in names[first_blocks:])
