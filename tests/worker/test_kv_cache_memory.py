import pytest
import torch

from prefixcache.model.config import ModelArchConfig
from prefixcache.worker.kv_cache_memory import kv_cache_bytes_per_block, num_kv_blocks_for_memory

# SmolLM2-135M's attention shapes: 30 layers, 3 KV heads of 64.
SMOLLM2 = ModelArchConfig(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
)


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    # 2 (K, V) * 30 layers * 16 tokens * 3 heads * 64 dims * 2 bytes
    assert kv_cache_bytes_per_block(SMOLLM2, 16, torch.bfloat16) == 368_640
    assert kv_cache_bytes_per_block(SMOLLM2, 16, torch.float32) == 737_280


def test_num_blocks_is_the_floor_of_the_budget():
    assert num_kv_blocks_for_memory(368_640 * 10, SMOLLM2, 16, torch.bfloat16) == 10
    assert num_kv_blocks_for_memory(368_640 * 11 - 1, SMOLLM2, 16, torch.bfloat16) == 10
    assert num_kv_blocks_for_memory(1 << 30, SMOLLM2, 16, torch.float32) == 1456


def test_budget_below_one_block_is_an_error():
    with pytest.raises(ValueError, match="368640 bytes"):
        num_kv_blocks_for_memory(368_639, SMOLLM2, 16, torch.bfloat16)
