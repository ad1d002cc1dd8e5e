"""How many KV blocks fit in a memory budget."""

from __future__ import annotations

import torch

from prefixcache.model.config import ModelArchConfig


def kv_cache_bytes_per_block(
    arch_config: ModelArchConfig, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers: a K and a V row per token, layer and KV head."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    element_bytes = torch.empty((), dtype=dtype).element_size()
    per_token_per_layer = 2 * arch_config.num_kv_heads * arch_config.head_dim * element_bytes
    return arch_config.num_layers * block_size * per_token_per_layer


def num_kv_blocks_for_memory(
    kv_cache_memory_bytes: int,
    arch_config: ModelArchConfig,
    block_size: int,
    dtype: torch.dtype,
) -> int:
    """The most blocks whose K/V tensors fit in `kv_cache_memory_bytes` (at least 1).

    Raises ValueError when not even one block fits, naming the bytes one block needs.
    """
    per_block_bytes = kv_cache_bytes_per_block(arch_config, block_size, dtype)
    num_blocks = kv_cache_memory_bytes // per_block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={kv_cache_memory_bytes} is too small: one block of "
            f"{block_size} tokens needs {per_block_bytes} bytes for this model and dtype"
        )
    return int(num_blocks)
