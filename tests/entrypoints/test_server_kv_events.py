"""``serve --kv-events-endpoint``: the server publishes its engine's KV events (issue 6)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from prefixcache.events.subscriber import EventSubscriber
from prefixcache.events.wire import AllBlocksCleared, BlockStored
from tests.entrypoints.conftest import MODEL_NAME, ServerProcess, assert_clean_exit, scrape

BLOCK_SIZE = 4
TOPIC = "kv@tiny"


@pytest.fixture(scope="module")
def events_server(tiny_model_dir):
    process = ServerProcess(
        tiny_model_dir, "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "64",
        "--kv-events-endpoint", "tcp://127.0.0.1:*",
        "--kv-events-replay-endpoint", "tcp://127.0.0.1:*", "--kv-events-topic", TOPIC,
        "--kv-events-block-hash-format", "bytes")
    ready = next(line for line in process.log if "ready:" in line)
    match = re.search(r"KV events on (tcp://\S+), replay on (tcp://[^\s)]+)", ready)
    assert match, ready
    process.endpoints = match.groups()
    yield process
    assert_clean_exit(process)


def replay_until(subscriber: EventSubscriber, predicate, timeout_s: float = 20):
    """Replay from 0 until ``predicate(events)`` holds (publishing is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batches = subscriber.replay(0, timeout_s=5)
        events = [event for received in batches for event in received.batch.events]
        if predicate(events):
            return batches, events
        if time.monotonic() > deadline:
            raise AssertionError(f"events never matched; got {events}")
        time.sleep(0.05)


def cleared_after_blocks(events) -> bool:
    """An AllBlocksCleared after stored blocks (the publisher also opens with one)."""
    stored = [i for i, e in enumerate(events) if isinstance(e, BlockStored)]
    return bool(stored) and any(isinstance(e, AllBlocksCleared) for e in events[stored[0]:])


def stored_tokens(events) -> list[list[int]]:
    return [e.token_ids for e in events if isinstance(e, BlockStored)]


def test_requests_publish_stored_blocks_and_reset_publishes_clear(events_server):
    endpoint, replay_endpoint = events_server.endpoints
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # two full blocks, then a partial one
    with httpx.Client(base_url=events_server.url, timeout=60) as http, \
            EventSubscriber(endpoint, topic=TOPIC, replay_endpoint=replay_endpoint) as sub:
        response = http.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "cache_salt": "team-x"})
        assert response.status_code == 200
        _, events = replay_until(sub, lambda ev: any(
            tokens[:8] == prompt[:8] for tokens in stored_tokens(ev)))
        stored = next(e for e in events
                      if isinstance(e, BlockStored) and e.token_ids[:8] == prompt[:8])
        assert stored.block_size == BLOCK_SIZE
        assert stored.parent_block_hash is None
        # --kv-events-block-hash-format bytes: raw sha256 digests, not 64-bit integers.
        assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.block_hashes)
        assert stored.extra_keys[0] == ("team-x",)  # open mode: the salt as sent

        assert http.post("/reset_prefix_cache").json() == {"success": True}
        batches, events = replay_until(sub, cleared_after_blocks)
        metrics = scrape(http)
        assert metrics["prefixcache:kv_events_published_total"] >= len(batches) > 0
        assert metrics["prefixcache:kv_events_dropped_total"] == 0
        # Consecutive, from the publisher's first number (its start: see events.zmq_publisher).
        assert [b.seq for b in batches] == list(range(batches[0].seq,
                                                      batches[0].seq + len(batches)))
