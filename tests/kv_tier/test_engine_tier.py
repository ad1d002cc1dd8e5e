"""Engines sharing a KV tier: what one replica computed, another loads instead of
recomputing, with outputs identical to a cold run's, whatever goes wrong with the tier."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.engine.arg_utils import EngineArgs
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.openai.tenancy import tenant_cache_salt
from tests.entrypoints.tiny_model import build_tiny_model
from tests.kv_tier.replica import BLOCK_SIZE, NUM_KV_BLOCKS, run

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT_LEN = 75  # 9 full blocks of 8, the last prompt token always computed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(5, 300) for _ in range(PROMPT_LEN)] for _ in range(3)]


def engine(model_dir, kv_tier=None, **options) -> LLMEngine:
    return LLMEngine.from_options(model_dir, kv_tier=kv_tier, block_size=BLOCK_SIZE,
                                  num_kv_blocks=NUM_KV_BLOCKS, **options)


def requests_of(prompts, salt=None):
    return [{"prompt": prompt, "cache_salt": salt} for prompt in prompts]


@pytest.fixture(scope="module")
def cold_outputs(model_dir, prompts):
    """Each prompt computed from scratch by an engine without a tier."""
    cold = engine(model_dir)
    return [r["token_ids"] for r in run(cold, requests_of(prompts))]


def fill_tier(model_dir, url, requests) -> None:
    """Replica A: compute ``requests`` and write their blocks to the tier."""
    replica_a = engine(model_dir, url)
    results = run(replica_a, requests)
    assert all(r["num_cached_tokens"] == 0 for r in results)
    replica_a.close()
    stats = replica_a.get_stats()
    assert stats.kv_tier_written_bytes > 0 and stats.kv_tier_errors == 0


def replica_in_another_process(model_dir, url, requests) -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.kv_tier.replica", str(model_dir), url,
         json.dumps(requests)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


NUM_TIER_TOKENS = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_replica_b_loads_what_replica_a_computed(model_dir, prompts, cold_outputs,
                                                 redis_server):
    fill_tier(model_dir, redis_server.url, requests_of(prompts))
    replica_b = replica_in_another_process(model_dir, redis_server.url, requests_of(prompts))
    assert [r["token_ids"] for r in replica_b["results"]] == cold_outputs
    # usage.prompt_tokens_details.cached_tokens comes from num_cached_tokens.
    assert [r["num_cached_tokens"] for r in replica_b["results"]] == \
        [NUM_TIER_TOKENS] * len(prompts)
    stats = replica_b["stats"]
    assert stats["external_prefix_cache_hits"] == NUM_TIER_TOKENS * len(prompts)
    assert stats["external_prefix_cache_queries"] == PROMPT_LEN * len(prompts)
    assert stats["prefix_cache_hits"] == 0
    assert stats["kv_tier_loads"] == len(prompts) and stats["kv_tier_read_bytes"] > 0
    assert stats["kv_tier_invalid_values"] == stats["kv_tier_errors"] == 0
    assert replica_b["leaked_blocks"] == 0


def test_salts_tenants_and_lora_names_do_not_share(model_dir, prompts, cold_outputs,
                                                   redis_server):
    salt_a = tenant_cache_salt("tenant-a", None)
    fill_tier(model_dir, redis_server.url, requests_of(prompts[:1], salt_a))
    replica = engine(model_dir, redis_server.url)
    for salt in (None, "x", tenant_cache_salt("tenant-b", None),
                 tenant_cache_salt("tenant-a", "x")):
        (result,) = run(replica, requests_of(prompts[:1], salt))
        assert result["num_cached_tokens"] == 0, salt
        assert result["token_ids"] == cold_outputs[0]
    assert replica.get_stats().external_prefix_cache_hits == 0
    # The same tenant does share.
    fresh = engine(model_dir, redis_server.url)
    (result,) = run(fresh, requests_of(prompts[:1], salt_a))
    assert result["num_cached_tokens"] == NUM_TIER_TOKENS
    assert result["token_ids"] == cold_outputs[0]


def test_disk_tier_survives_a_restart(model_dir, prompts, cold_outputs, tmp_path):
    url = f"disk:{tmp_path / 'kv'}"
    fill_tier(model_dir, url, requests_of(prompts))
    restarted = engine(model_dir, url)
    results = run(restarted, requests_of(prompts))
    assert [r["token_ids"] for r in results] == cold_outputs
    assert [r["num_cached_tokens"] for r in results] == [NUM_TIER_TOKENS] * len(prompts)
    # The local cache serves the second time; the tier is not read again.
    again = run(restarted, requests_of(prompts))
    assert [r["token_ids"] for r in again] == cold_outputs
    stats = restarted.get_stats()
    assert stats.kv_tier_loads == len(prompts)
    assert stats.prefix_cache_hits == NUM_TIER_TOKENS * len(prompts)
    assert restarted.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS


def test_a_corrupted_value_is_recomputed(model_dir, prompts, cold_outputs, tmp_path):
    url = f"disk:{tmp_path / 'kv'}"
    fill_tier(model_dir, url, requests_of(prompts[:1]))
    replica = engine(model_dir, url)
    tier = replica.kv_tier
    # Flip one byte of the KV payload of block 4 of the prompt.
    probe = engine(model_dir)
    request_hashes = probe.kv_cache_manager.block_hasher.hash_blocks(None, prompts[0])
    path = tier.backend._path(tier.key(request_hashes[4]))
    value = bytearray(path.read_bytes())
    value[-100] ^= 0xFF
    path.write_bytes(bytes(value))
    (result,) = run(replica, requests_of(prompts[:1]))
    assert result["token_ids"] == cold_outputs[0]
    assert result["num_cached_tokens"] == 4 * BLOCK_SIZE  # the blocks before it
    stats = replica.get_stats()
    assert stats.kv_tier_invalid_values == 1
    assert replica.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS


def test_another_models_blocks_are_never_used(model_dir, prompts, cold_outputs, tmp_path,
                                              redis_server):
    other_model = build_tiny_model(tmp_path / "other", seed=1)
    fill_tier(other_model, redis_server.url, requests_of(prompts[:1]))
    replica = engine(model_dir, redis_server.url)
    (result,) = run(replica, requests_of(prompts[:1]))
    assert result["num_cached_tokens"] == 0 and result["token_ids"] == cold_outputs[0]
    # A value of the other model's written under this model's key: refused, recomputed.
    other = engine(other_model, redis_server.url)
    hashes = other.kv_cache_manager.block_hasher.hash_blocks(None, prompts[1])
    foreign_value = other.kv_tier.backend._client.get(other.kv_tier.key(hashes[0]))
    assert foreign_value is None  # prompts[1] not computed yet
    run(other, requests_of(prompts[1:2]))
    other.close()
    foreign_value = other.kv_tier.backend._client.get(other.kv_tier.key(hashes[0]))
    replica.kv_tier.backend._client.set(replica.kv_tier.key(hashes[0]), foreign_value)
    (result,) = run(replica, requests_of(prompts[1:2]))
    assert result["num_cached_tokens"] == 0 and result["token_ids"] == cold_outputs[1]
    assert replica.get_stats().kv_tier_invalid_values == 1


def test_redis_killed_mid_run(model_dir, prompts, cold_outputs, redis_server):
    replica = engine(model_dir, redis_server.url)
    first = run(replica, requests_of(prompts[:1]))
    assert replica.kv_tier.flush()
    redis_server.stop()
    # New prompts: the local cache misses, the tier cannot answer; all recomputed.
    rest = run(replica, requests_of(prompts[1:]))
    assert [r["token_ids"] for r in first + rest] == cold_outputs
    assert all(r["num_cached_tokens"] == 0 for r in rest)
    stats = replica.get_stats()
    assert stats.kv_tier_errors >= 1 and stats.external_prefix_cache_hits == 0
    assert replica.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS
    replica.close()


def test_reset_prefix_cache_may_clear_the_tier(model_dir, prompts, tmp_path):
    url = f"disk:{tmp_path / 'kv'}"
    replica = engine(model_dir, url)
    run(replica, requests_of(prompts[:1]))
    assert replica.kv_tier.flush()
    assert replica.reset_prefix_cache()
    assert replica.kv_tier.lookup(replica_hashes(replica, prompts[0])) == 9
    assert replica.reset_prefix_cache(reset_kv_tier=True)
    assert replica.kv_tier.lookup(replica_hashes(replica, prompts[0])) == 0


def replica_hashes(replica: LLMEngine, prompt: list[int]) -> list[bytes]:
    return replica.kv_cache_manager.block_hasher.hash_blocks(None, prompt)


def test_a_shared_tier_needs_reproducible_hashes(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="random seed in each process"):
        EngineArgs(kv_tier="redis://127.0.0.1:6379/0", hash_algo="xxhash")
    EngineArgs(kv_tier="redis://127.0.0.1:6379/0", hash_algo="xxhash", hash_seed="fleet")
    with pytest.raises(ValueError, match="kv_tier must be"):
        EngineArgs(kv_tier="127.0.0.1:6379")
    with pytest.raises(ValueError, match="maxmemory"):
        EngineArgs(kv_tier="redis://127.0.0.1:6379/0", kv_tier_max_bytes=1000)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_tier="disk:/tmp/x", enable_prefix_caching=False)
