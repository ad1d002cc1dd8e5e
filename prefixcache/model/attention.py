"""Paged attention: the only part of the model that knows where K/V live.

Each step the layer (1) writes the new tokens' keys and values into the layer's paged KV
tensors at their slots, then (2) for every sequence reads all of its keys back through its
slots and computes causal attention of its new queries against them. Reading from the cache
after writing makes a prefill chunk, a decode token and a prefix-cache hit the same operation:
only how many keys were there before differs.

Grouped-query attention never copies keys per query head: the `num_queries_per_kv` query
heads sharing a KV head form a group attending to that head's keys (an expanded view, or
extra query rows of it for decodes).

Decodes whose block tables start with the same blocks (a prefix-cache hit on a common prompt)
use cascade attention: the shared keys are read once per group and attended by all members'
queries in one matmul, each decode attends to its own remaining keys, and the partial results
are merged by their log-sum-exp. Groups nest (every decode shares a system prompt, subsets of
them a document after it), each level a further run of keys. The metadata says which decodes
share what; without shared prefixes the decodes take one padded batch over all of their keys,
or, when the runner uses it, the paged attention kernel, which reads the keys in place
through the block tables instead of gathering them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.kernels.paged_attention import paged_attention
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

        output = query.new_empty(num_tokens, kv_heads, group, head_dim) if metadata.chunks else None
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
            # [seq_len, kv_heads, d] -> [1, kv_heads, seq_len, d], a view (no copy).
            chunk_key = chunk_key.to(query.dtype).transpose(0, 1)[None]
            chunk_value = chunk_value.to(query.dtype).transpose(0, 1)[None]
            if chunk.causal_mask is None:
                # A fresh prompt: each KV head's keys broadcast to its group ([kv_heads,
                # group, seq_len, d] views), so the kernel's own causal masking applies.
                # 4-D inputs: PyTorch's CPU kernels take a slow generic path for 3-D ones.
                attended = F.scaled_dot_product_attention(
                    chunk_query,
                    chunk_key[0, :, None].expand(kv_heads, group, seq_len, head_dim),
                    chunk_value[0, :, None].expand(kv_heads, group, seq_len, head_dim),
                    is_causal=True,
                )  # [kv_heads, group, q, d]
            else:
                # After context the mask is explicit, so the group's query heads can be
                # extra query rows of their KV head, as for decodes: the kernel reads each
                # key once per KV head instead of once per query head.
                folded_query = chunk_query.reshape(1, kv_heads, group * num_queries, head_dim)
                attended = F.scaled_dot_product_attention(
                    folded_query,
                    chunk_key,
                    chunk_value,
                    attn_mask=chunk.causal_mask.repeat(group, 1),  # row g * q + i is query i
                ).view(kv_heads, group, num_queries, head_dim)
            output[start:end] = attended.permute(2, 0, 1, 3)  # -> [q, kv_heads, group, d]

        if metadata.decode_token_indices is not None:
            indices = metadata.decode_token_indices
            # Without chunks every token is a decode, in order: no gather, no scatter.
            all_decodes = not metadata.chunks
            # [D, kv_heads * group, d] -> [D, kv_heads, group, d]: the group's query heads are
            # the query rows.
            decode_query = query if all_decodes else query.index_select(0, indices)
            decode_query = decode_query.view(-1, kv_heads, group, head_dim)
            if metadata.decode_paged is not None:
                batch = metadata.decode_paged
                attended = paged_attention(
                    decode_query.float().contiguous(), kv_cache.key_cache,
                    kv_cache.value_cache, batch.block_tables, batch.query_start,
                    batch.seq_lens, head_dim**-0.5,
                )  # [D, kv_heads, group, d] float32
            elif metadata.decode_shared_prefixes:
                attended = self._cascade_decode(
                    decode_query, key_slots_view, value_slots_view, metadata
                )
            else:
                key_slots = metadata.decode_key_slots  # [D, max_len]
                # [D, max_len, kv_heads, d] -> [D, kv_heads, max_len, d], views
                attended = F.scaled_dot_product_attention(
                    decode_query,
                    _gather_rows(key_slots_view, key_slots, query.dtype).transpose(1, 2),
                    _gather_rows(value_slots_view, key_slots, query.dtype).transpose(1, 2),
                    attn_mask=metadata.decode_key_mask,
                )
            if all_decodes:
                return attended.to(query.dtype).reshape(num_tokens, self.num_heads * head_dim)
            output.index_copy_(0, indices, attended.to(output.dtype))  # [D, kv_heads, group, d]
        return output.view(num_tokens, self.num_heads * head_dim)

    def _cascade_decode(
        self,
        decode_query: torch.Tensor,
        key_slots_view: torch.Tensor,
        value_slots_view: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Decode attention split at each group's shared prefix; [D, kv_heads, group, d] float32.

        Softmax over a union of key sets is the log-sum-exp-weighted mix of the softmaxes over
        its parts, so each decode attends (a) to its own suffix (`decode_key_slots`), in one
        padded batch, and (b) to the shared keys of every group it is in - each group's read
        once and attended by all members' query heads in one matmul - and the parts are
        merged one group at a time. Computed in float32 so that the merges add no rounding of
        their own in lower-precision models.
        """
        kv_heads, group, head_dim = self.num_kv_heads, self.num_queries_per_kv, self.head_dim
        # Scaling the queries (not the scores) is the cheaper way to SDPA's default 1/sqrt(d).
        scaled_query = decode_query.float() * head_dim**-0.5  # [D, kv_heads, group, d]
        suffix_key = _gather_rows(key_slots_view, metadata.decode_key_slots, torch.float32)
        suffix_value = _gather_rows(value_slots_view, metadata.decode_key_slots, torch.float32)
        # Every row keeps at least its current token's key, so no row is all -inf.
        attended, lse = _attend_padded_with_lse(
            scaled_query, suffix_key, suffix_value, metadata.decode_key_mask
        )  # [D, kv_heads, group, d], [D, kv_heads, group]

        for prefix in metadata.decode_shared_prefixes:
            rows = prefix.decode_rows
            num_members = rows.shape[0]
            # [n, kv_heads, group, d] -> [kv_heads, n, group, d] -> [kv_heads, n * group, d]:
            # every member's query heads of one KV head become rows of one matmul.
            prefix_query = scaled_query.index_select(0, rows).transpose(0, 1)
            prefix_query = prefix_query.reshape(kv_heads, num_members * group, head_dim)
            # [num_shared, kv_heads, d] -> [kv_heads, num_shared, d]
            prefix_key = key_slots_view.index_select(0, prefix.key_slots).float().transpose(0, 1)
            prefix_value = value_slots_view.index_select(0, prefix.key_slots).float()
            prefix_value = prefix_value.transpose(0, 1)
            prefix_scores = prefix_query @ prefix_key.transpose(1, 2)  # [kv, n * group, shared]
            prefix_attended, prefix_lse = _attend_with_lse(prefix_scores, prefix_value)
            # [kv_heads, n * group, d] -> [kv_heads, n, group, d] -> [n, kv_heads, group, d]
            prefix_attended = prefix_attended.view(kv_heads, num_members, group, head_dim)
            prefix_attended = prefix_attended.transpose(0, 1)
            # [kv_heads, n * group] -> [kv_heads, n, group] -> [n, kv_heads, group]
            prefix_lse = prefix_lse.view(kv_heads, num_members, group).transpose(0, 1)
            merged, merged_lse = _merge_partial_attention(
                attended.index_select(0, rows),
                lse.index_select(0, rows),
                prefix_attended,
                prefix_lse,
            )
            attended.index_copy_(0, rows, merged)
            # Kept current because groups nest: a member's next group merges into this.
            lse.index_copy_(0, rows, merged_lse)
        return attended


def _gather_rows(
    slots_view: torch.Tensor, key_slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Keys (or values) at `key_slots` [D, max_len] of `slots_view` [num_slots, kv_heads, d],
    as [D, max_len, kv_heads, d] in `dtype`."""
    num_rows, max_len = key_slots.shape
    # index_select is far cheaper than advanced indexing.
    gathered = slots_view.index_select(0, key_slots.view(-1))  # [D * max_len, kv_heads, d]
    return gathered.view(num_rows, max_len, *slots_view.shape[1:]).to(dtype)


def _attend_with_lse(
    scores: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of `scores` [..., q, k] applied to `value` [..., k, d]: ([..., q, d], the
    log-sum-exp of each score row [..., q]), the pair partial results are merged by."""
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [..., q, 1]
    probs = torch.exp(scores - lse)
    return probs @ value, lse.squeeze(-1)


def _merge_partial_attention(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets from each one's result [..., d] and log-sum-exp
    [...]: each result weighted by its share of the total softmax mass. Returns the merged
    result and the log-sum-exp over the union, so a third part can be merged in. Subtracting
    the larger log-sum-exp keeps the exponentials in range."""
    max_lse = torch.maximum(first_lse, second_lse)
    first_weight = torch.exp(first_lse - max_lse).unsqueeze(-1)  # [..., 1]
    second_weight = torch.exp(second_lse - max_lse).unsqueeze(-1)
    total_weight = first_weight + second_weight
    merged = (first * first_weight + second * second_weight) / total_weight
    return merged, max_lse + torch.log(total_weight.squeeze(-1))


def _attend_padded_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention with its log-sum-exp, one bmm per KV head.

    `query` [D, kv_heads, group, d] (already scaled); `key`, `value` [D, max_len, kv_heads, d]
    as gathered; `key_mask` [D, 1, 1, max_len] (True = real key, at least one per row).
    Returns ([D, kv_heads, group, d], [D, kv_heads, group]). Per head, `key[:, :, h]` is a
    strided [D, max_len, d] view bmm reads in place; a 4-D matmul batched over (D, kv_heads)
    would first copy every gathered key and value into that batch order.
    """
    num_kv_heads = query.shape[1]
    scores = torch.stack(
        [torch.bmm(query[:, h], key[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)],
        dim=1,
    )  # [D, kv_heads, group, max_len]
    scores.masked_fill_(~key_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [D, kv_heads, group, 1]
    probs = torch.exp(scores - lse)
    attended = torch.stack(
        [torch.bmm(probs[:, h], value[:, :, h]) for h in range(num_kv_heads)], dim=1
    )  # [D, kv_heads, group, d]
    return attended, lse.squeeze(-1)
