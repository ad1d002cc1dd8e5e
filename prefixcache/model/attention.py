"""Paged attention: the only part of the model that knows where K/V live.

Each step the layer (1) writes the new tokens' keys and values into the layer's paged KV
tensors at their slots, then (2) for every sequence reads all of its keys back through its
slots and computes causal attention of its new queries against them. Reading from the cache
after writing makes a prefill chunk, a decode token and a prefix-cache hit the same operation:
only how many keys were there before differs.

Grouped-query attention never copies keys per query head: the `num_queries_per_kv` query
heads sharing a KV head form a group attending to that head's keys (an expanded view, or
extra query rows of it for decodes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.attention_metadata import AttentionMetadata, KVCache


class PagedAttention(nn.Module):
    """Scaled dot-product attention over a paged KV cache (no parameters)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_queries_per_kv = num_heads // num_kv_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, num_heads, head_dim]; key, value [T, num_kv_heads, head_dim].

        Returns [T, num_heads * head_dim] in the query's dtype.
        """
        num_tokens = query.shape[0]
        kv_heads, group, head_dim = self.num_kv_heads, self.num_queries_per_kv, self.head_dim
        # [num_blocks * block_size, num_kv_heads, head_dim]: slot-addressed views of the pool.
        key_slots_view = kv_cache.key_cache.view(-1, kv_heads, head_dim)
        value_slots_view = kv_cache.value_cache.view(-1, kv_heads, head_dim)
        key_slots_view.index_copy_(0, metadata.slot_mapping, key.to(key_slots_view.dtype))
        value_slots_view.index_copy_(0, metadata.slot_mapping, value.to(value_slots_view.dtype))

        output = query.new_empty(num_tokens, kv_heads, group, head_dim)
        for chunk in metadata.chunks:
            start, end = chunk.token_start, chunk.token_end
            num_queries = end - start
            # [q, kv_heads * group, d] -> [kv_heads, group, q, d]: query head kv * group + g
            # is row (kv, g), so each KV head is a batch entry shared by its group.
            chunk_query = query[start:end].view(num_queries, kv_heads, group, head_dim)
            chunk_query = chunk_query.permute(1, 2, 0, 3)
            if chunk.key_slots is None:
                # [q, kv_heads, d], rounded to the cache dtype like keys read back later, so
                # a cold prompt and a cache hit see the same key values.
                chunk_key = key[start:end].to(key_slots_view.dtype)
                chunk_value = value[start:end].to(value_slots_view.dtype)
            else:
                # [seq_len, kv_heads, d]; index_select is far cheaper than advanced indexing.
                chunk_key = key_slots_view.index_select(0, chunk.key_slots)
                chunk_value = value_slots_view.index_select(0, chunk.key_slots)
            seq_len = chunk_key.shape[0]
            # [seq_len, kv_heads, d] -> [kv_heads, group, seq_len, d], a view (no copy).
            chunk_key = chunk_key.to(query.dtype).transpose(0, 1)[:, None]
            chunk_key = chunk_key.expand(kv_heads, group, seq_len, head_dim)
            chunk_value = chunk_value.to(query.dtype).transpose(0, 1)[:, None]
            chunk_value = chunk_value.expand(kv_heads, group, seq_len, head_dim)
            # 4-D inputs: PyTorch's CPU kernels take a slow generic path for 3-D ones.
            attended = F.scaled_dot_product_attention(
                chunk_query,
                chunk_key,
                chunk_value,
                attn_mask=chunk.causal_mask,
                is_causal=chunk.causal_mask is None,
            )  # [kv_heads, group, q, d]
            output[start:end] = attended.permute(2, 0, 1, 3)  # -> [q, kv_heads, group, d]

        if metadata.decode_token_indices is not None:
            indices = metadata.decode_token_indices
            num_decodes = indices.shape[0]
            # [D, kv_heads, group, d]: the group's query heads are the query rows.
            decode_query = query[indices].view(num_decodes, kv_heads, group, head_dim)
            key_slots = metadata.decode_key_slots  # [D, max_len]
            gathered_shape = (num_decodes, key_slots.shape[1], kv_heads, head_dim)
            # [D * max_len, kv_heads, d] -> [D, max_len, kv_heads, d] -> [D, kv_heads, max_len, d]
            decode_key = key_slots_view.index_select(0, key_slots.view(-1))
            decode_key = decode_key.view(gathered_shape).transpose(1, 2)
            decode_value = value_slots_view.index_select(0, key_slots.view(-1))
            decode_value = decode_value.view(gathered_shape).transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                decode_query,
                decode_key.to(query.dtype),
                decode_value.to(query.dtype),
                attn_mask=metadata.decode_key_mask,
            )  # [D, kv_heads, group, d]
            output.index_copy_(0, indices, attended)
        return output.view(num_tokens, self.num_heads * head_dim)
