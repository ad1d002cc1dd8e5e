"""KV blocks as bytes, for the second KV tier (:mod:`prefixcache.kv_tier`): the worker's
half of the tier, the only part that touches tensors.

A block's payload is its K and V in every layer, in this order and layout (version
:data:`~prefixcache.kv_tier.KV_LAYOUT_VERSION`)::

    [layer 0 K, layer 0 V, layer 1 K, ...], each [block_size, num_kv_heads, head_dim]

in the KV cache's dtype, native byte order. :func:`kv_layout` describes it, with a digest
of the weights, for the tier's fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from prefixcache.kv_tier import KVLayout
from prefixcache.model.attention_metadata import KVCache
from prefixcache.model.config import ModelArchConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes: equal for equal
    weights however they were loaded, different for any other weights."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        tensor = parameter.detach().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def kv_layout(model: torch.nn.Module, arch_config: ModelArchConfig, block_size: int,
              dtype: torch.dtype, hash_algo: str, none_hash: bytes) -> KVLayout:
    """The tier layout of a KV cache of ``model`` in ``dtype``, with blocks hashed by
    ``hash_algo`` from ``none_hash`` (the chain's root, which encodes the seed)."""
    return KVLayout(
        model_digest=weights_digest(model) + ":" + repr(arch_config),
        dtype=_DTYPE_NAMES[dtype], dtype_size=torch.empty((), dtype=dtype).element_size(),
        num_layers=arch_config.num_layers, num_kv_heads=arch_config.num_kv_heads,
        head_dim=arch_config.head_dim, block_size=block_size, hash_algo=hash_algo,
        none_hash=none_hash.hex())


def read_kv_blocks(kv_caches: Sequence[KVCache], block_ids: Sequence[int]) -> list[bytes]:
    """Each block's payload (see the module docstring), copied out of the cache."""
    index = torch.tensor(block_ids, dtype=torch.int64)
    # 2 * num_layers tensors of [n, block_size, heads, head_dim] -> [n, 2L, bs, h, d]
    stacked = torch.stack([tensor.index_select(0, index) for cache in kv_caches
                           for tensor in (cache.key_cache, cache.value_cache)], dim=1)
    rows = stacked.contiguous().view(torch.uint8).view(len(block_ids), -1).numpy()
    return [row.tobytes() for row in rows]


def write_kv_blocks(kv_caches: Sequence[KVCache], block_ids: Sequence[int],
                    payloads: Sequence[bytes | memoryview]) -> None:
    """Copy each payload into its block (ValueError if a payload's size is wrong)."""
    if not block_ids:
        return
    key = kv_caches[0].key_cache
    block_shape = key.shape[1:]
    block_nbytes = 2 * len(kv_caches) * key[0].numel() * key.element_size()
    buffer = bytearray(block_nbytes * len(block_ids))
    view = memoryview(buffer)
    for i, payload in enumerate(payloads):
        payload = memoryview(payload).cast("B")
        if payload.nbytes != block_nbytes:
            raise ValueError(f"a KV block payload is {block_nbytes} bytes here, got "
                             f"{payload.nbytes}")
        view[i * block_nbytes:(i + 1) * block_nbytes] = payload
    # [n * block bytes] -> [n, 2L, bs, h, d] in the cache's dtype
    data = torch.frombuffer(buffer, dtype=torch.uint8).view(key.dtype).view(
        len(block_ids), 2 * len(kv_caches), *block_shape)
    index = torch.tensor(block_ids, dtype=torch.int64)
    for layer, cache in enumerate(kv_caches):
        cache.key_cache.index_copy_(0, index, data[:, 2 * layer])
        cache.value_cache.index_copy_(0, index, data[:, 2 * layer + 1])
