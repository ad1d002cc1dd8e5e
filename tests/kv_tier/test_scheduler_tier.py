"""The scheduler with a tier behind the block pool, without a model: which blocks it
loads, where they go, and that extra keys (LoRA, salts) keep their partitions."""

from __future__ import annotations

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.scheduler import Scheduler, SchedulerConfig
from prefixcache.kv_tier import KVLayout, KVTier, open_backend

BLOCK_SIZE = 4
LAYOUT = KVLayout(model_digest="m", dtype="float32", num_layers=1, num_kv_heads=1,
                  head_dim=2, block_size=BLOCK_SIZE, hash_algo="sha256", none_hash="00",
                  dtype_size=4)


class CountingTier:
    """A KVTier that counts the scheduler's calls."""

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier
        self.num_lookups = 0
        self.num_loads = 0

    def lookup(self, block_hashes):
        self.num_lookups += 1
        return self.tier.lookup(block_hashes)

    def load(self, block_hashes, block_token_ids):
        self.num_loads += 1
        return self.tier.load(block_hashes, block_token_ids)


def make_tier(tmp_path) -> KVTier:
    return KVTier(open_backend(f"disk:{tmp_path}"), LAYOUT)


def store_request_blocks(tier: KVTier, manager: KVCacheManager, request: Request) -> None:
    """Put every full block of ``request`` in the tier, payload = the block's index."""
    request.attach_block_hasher(manager.block_hasher)
    for i, block_hash in enumerate(request.block_hashes):
        tokens = request.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        assert tier.store(block_hash, tokens, bytes([i]) * LAYOUT.block_nbytes)
    assert tier.flush()


def scheduler_with(tier, num_blocks: int = 16) -> Scheduler:
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, tier)


def test_external_blocks_are_allocated_after_local_hits_and_cost_no_budget(tmp_path):
    tier = make_tier(tmp_path)
    scheduler = scheduler_with(tier)
    manager = scheduler.kv_cache_manager
    prompt = list(range(100, 118))  # 4 full blocks + 2 tokens
    store_request_blocks(tier, manager, Request("stored", prompt))
    # Block 0 is also cached locally, by an earlier request.
    local = Request("local", prompt[:5])
    scheduler.add_request(local)
    scheduler.schedule()
    scheduler.finish_request("local", local.status.FINISHED_STOPPED)

    scheduler.add_request(Request("r", prompt))
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.num_hit_tokens == 4
    assert scheduled.num_external_tokens == 12
    assert scheduled.start_position == 16 and scheduled.num_new_tokens == 2
    table = manager.get_block_ids("r")
    assert [b.block_id for b in scheduled.external_blocks] == table[1:4]
    assert [bytes(b.payload)[0] for b in scheduled.external_blocks] == [1, 2, 3]
    # Loaded blocks are cached locally at once, like computed ones.
    assert manager.block_pool.get_cached_block(scheduled.request.block_hashes[3]) \
        .block_id == table[3]
    scheduler.finish_request("r", scheduled.request.status.FINISHED_STOPPED)
    assert manager.num_free_blocks == 16


def test_a_request_waiting_for_room_is_loaded_once(tmp_path):
    counting = CountingTier(make_tier(tmp_path))
    scheduler = scheduler_with(counting, num_blocks=6)
    manager = scheduler.kv_cache_manager
    prompt = list(range(200, 217))  # 5 blocks: 4 in the tier
    store_request_blocks(counting.tier, manager, Request("stored", prompt))
    scheduler.add_request(Request("big", list(range(20))))  # holds 5 of 6 blocks
    scheduler.schedule()
    scheduler.add_request(Request("r", prompt))
    for _ in range(3):
        output = scheduler.schedule()
        assert [s.request.request_id for s in output.scheduled] == ["big"] or \
            not output.scheduled
    assert counting.num_loads == 1
    scheduler.finish_request("big", scheduler.requests["big"].status.FINISHED_STOPPED)
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.num_external_tokens == 16 and counting.num_loads == 1


@pytest.mark.parametrize("reader", [
    {"lora_name": "b", "lora_path": "/b"},
    {"lora_name": "a", "lora_path": "/other"},
    {},
    {"cache_salt": "s"},
])
def test_extra_keys_keep_their_partitions(tmp_path, reader):
    tier = make_tier(tmp_path)
    scheduler = scheduler_with(tier)
    prompt = list(range(300, 313))
    writer = Request("w", prompt, lora_name="a", lora_path="/a")
    store_request_blocks(tier, scheduler.kv_cache_manager, writer)
    scheduler.add_request(Request("same", prompt, lora_name="a", lora_path="/a"))
    scheduler.add_request(Request("other", prompt, **reader))
    same, other = scheduler.schedule().scheduled
    assert same.num_external_tokens == 12
    assert other.num_external_tokens == 0


def test_skip_reading_prefix_cache_skips_the_tier_too(tmp_path):
    counting = CountingTier(make_tier(tmp_path))
    scheduler = scheduler_with(counting)
    prompt = list(range(400, 413))
    store_request_blocks(counting.tier, scheduler.kv_cache_manager, Request("w", prompt))
    scheduler.add_request(Request("r", prompt, skip_reading_prefix_cache=True))
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.num_external_tokens == 0 and counting.num_lookups == 0
