"""A router's index, built only from events, agrees with the block pool's cached set.

The story: a small KV cache serves a long random workload of prompts that share
prefixes (some salted, some with a LoRA adapter), prefill then decode, finishing at random;
blocks get evicted; midway everything is freed and the prefix cache is reset. After every
engine step the step's events go through the wire (encode, decode) into an ``EventIndex``,
which must then hold exactly the hashes the pool has cached.
"""

from __future__ import annotations

import random
import time

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.events.convert import block_hash_to_int64, make_batch
from prefixcache.events.index import EventIndex
from prefixcache.events.subscriber import EventSubscriber
from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from prefixcache.events.zmq_publisher import ZmqEventPublisher
from tests.events import VLLM_NUMBERING

BLOCK_SIZE = 4
NUM_BLOCKS = 48


def _pool_hashes(manager: KVCacheManager, block_hash_format: str) -> set:
    keys = manager.block_pool.cached_block_hash_to_block.keys()
    if block_hash_format == "int64":
        return {block_hash_to_int64(h) for h in keys}
    return set(keys)


class _Workload:
    """Drives a KVCacheManager the way a scheduler does, one engine step at a time."""

    def __init__(self, manager: KVCacheManager, rng: random.Random) -> None:
        self.manager = manager
        self.rng = rng
        self.running: list[Request] = []
        self.num_requests = 0
        self.prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 24))]
                         for _ in range(6)]

    def _new_request(self) -> Request:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes))
        prompt += [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        kind = rng.random()
        self.num_requests += 1
        request_id = f"r{self.num_requests}"
        if kind < 0.15:
            return Request(request_id, prompt, cache_salt=rng.choice(["tenant-a", "tenant-b"]))
        if kind < 0.3:
            return Request(request_id, prompt, lora_name="sql", lora_path="/adapters/sql",
                           lora_id=1)
        return Request(request_id, prompt)

    def admit(self) -> None:
        manager = self.manager
        request = self._new_request()
        hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
        new_blocks = manager.allocate_slots(
            request,
            request.num_tokens - num_hit_tokens,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=hit_blocks,
        )
        if new_blocks is None:
            return  # did not fit: nothing changed, the request waits (here: is dropped)
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(self.rng.randrange(1000))
        self.running.append(request)

    def decode(self, request: Request) -> None:
        if self.manager.allocate_slots(request, 1) is None:
            self.finish(request)  # preempted: give its blocks back
            return
        request.num_computed_tokens += 1
        request.append_output_token_ids(self.rng.randrange(1000))

    def finish(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)

    def step(self) -> None:
        rng = self.rng
        if len(self.running) < 6 and rng.random() < 0.5:
            self.admit()
        for request in list(self.running):
            if rng.random() < 0.12:
                self.finish(request)
            else:
                self.decode(request)

    def finish_all(self) -> None:
        for request in list(self.running):
            self.finish(request)


@pytest.mark.parametrize("block_hash_format", ["int64", "bytes"])
def test_index_from_events_matches_the_cached_set(block_hash_format):
    manager = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_events=True)
    workload = _Workload(manager, random.Random(1234))
    index = EventIndex()
    seen_types: set[type] = set()

    def publish_step(ts: float) -> None:
        records = manager.take_events()
        if not records:
            return
        batch = decode_batch(encode_batch(make_batch(records, ts, 0, block_hash_format)))
        seen_types.update(type(event) for event in batch.events)
        index.apply_batch(batch)

    num_steps = 1500
    for step in range(num_steps):
        workload.step()
        if step == num_steps // 2:
            workload.finish_all()
            assert manager.reset_prefix_cache()
        publish_step(float(step))
        assert index.stored_hashes() == _pool_hashes(manager, block_hash_format), step

    workload.finish_all()
    publish_step(float(num_steps))
    assert index.stored_hashes() == _pool_hashes(manager, block_hash_format)
    # The workload really exercised every event kind, and evicted a lot.
    assert seen_types == {BlockStored, BlockRemoved, AllBlocksCleared}
    assert manager.block_pool.num_evictions > 100
    assert index.num_unknown_removals == 0
    assert len(index) > 0


def test_index_counts_copies_and_answers_prefix_hits():
    index = EventIndex()
    index.apply_batch(KVEventBatch(0.0, [
        BlockStored([1, 2, 3], None, list(range(12)), 4, None, "GPU", None),
        BlockStored([2], 1, list(range(4, 8)), 4, None, "GPU", None),  # a second copy of 2
    ]))
    assert index.hash_to_num_copies == {1: 1, 2: 2, 3: 1}
    assert index.num_prefix_hits([1, 2, 3, 4]) == 3
    index.apply(BlockRemoved([2], "GPU"))
    assert 2 in index and index.num_prefix_hits([1, 2, 3]) == 3
    index.apply(BlockRemoved([2], "GPU"))
    assert 2 not in index and index.num_prefix_hits([1, 2, 3]) == 1
    index.apply(BlockRemoved([99], "GPU"))
    assert index.num_unknown_removals == 1
    index.apply(AllBlocksCleared())
    assert len(index) == 0 and list(index) == []
    with pytest.raises(TypeError):
        index.apply("BlockStored")  # type: ignore[arg-type]


def test_index_fed_by_a_real_publisher_matches_the_cached_set():
    # The deployment path end to end: engine steps -> publisher -> replay -> index.
    manager = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_events=True)
    workload = _Workload(manager, random.Random(99))
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                  **VLLM_NUMBERING)
    try:
        num_batches = 0
        for step in range(300):
            workload.step()
            if step == 150:
                workload.finish_all()
                assert manager.reset_prefix_cache()
            events = manager.take_events()
            num_batches += bool(events)
            publisher.publish(events)
        deadline = time.monotonic() + 5.0
        while publisher.num_published_batches < num_batches and time.monotonic() < deadline:
            time.sleep(0.005)
        with EventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as sub:
            replayed = sub.replay(0)
    finally:
        publisher.close()
    assert [r.seq for r in replayed] == list(range(num_batches))
    index = EventIndex()
    index.apply_batches(r.batch for r in replayed)
    assert index.stored_hashes() == _pool_hashes(manager, "int64")
    assert publisher.num_dropped_batches == 0
