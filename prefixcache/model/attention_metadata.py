"""What the paged attention layer needs to know about one batched step.

The model runner builds one `AttentionMetadata` per step (once, not per layer) and passes it
explicitly through the model to every attention layer. Tokens of the step are laid out
sequence after sequence ("packed"): sequence i owns rows `[token_start, token_end)` of every
[num_tokens, ...] tensor.

Vocabulary: a *slot* is one token's row in a layer's paged KV tensor,
`slot = block_id * block_size + offset_in_block`; a sequence's *context* is the tokens already
in the KV cache before this step; its *length* is context + the tokens computed this step.
A *shared prefix* is a run of leading blocks that several decode sequences' block tables hold
in common (the prefix cache hands the same block ids to requests with the same prompt start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ChunkAttention:
    """One sequence computing several tokens this step (a prompt or a prefill chunk).

    `key_slots` [seq_len] are the slots of all its keys, positions 0..seq_len-1, in order -
    its block table expanded to tokens. None when the sequence has no context: its keys are
    exactly this step's keys, so attention reads them directly and masks causally.
    `causal_mask` [num_query_tokens, seq_len] bool (True = may attend) is set with
    `key_slots`: query i sits at position context_len + i and sees keys 0..context_len + i.
    """

    token_start: int
    token_end: int
    key_slots: torch.Tensor | None
    causal_mask: torch.Tensor | None


@dataclass(slots=True)
class SharedPrefixGroup:
    """Decode sequences whose keys over one run of positions are the same slots.

    - `decode_rows` [num_members] int64, num_members >= 2: the group's rows of the decode
      batch (indices into `AttentionMetadata.decode_token_indices`), ascending.
    - `key_slots` [num_shared_tokens] int64: the shared slots, in position order. Whole
      blocks only, and strictly before every member's current position, so each member still
      has at least its current token's key outside its groups (its suffix is never empty).

    A top-level group's run starts at position 0. Groups nest: a subset of a group's members
    may form a further group whose run starts where the outer one's ends (every decode shares
    a system prompt, some of them also the document after it). A decode's groups therefore
    cover consecutive runs from position 0, and its own keys (`decode_key_slots`) follow the
    last of them. Attention reads each group's keys once for all its members instead of once
    per member.
    """

    decode_rows: torch.Tensor
    key_slots: torch.Tensor

    @property
    def num_shared_tokens(self) -> int:
        return self.key_slots.shape[0]


@dataclass(slots=True)
class PagedKernelBatch:
    """Sequences for the paged attention kernel (`prefixcache.kernels.paged_attention`),
    which reads keys through block tables instead of gathered slots.

    - `block_tables` [num_sequences, max_blocks] int64: each sequence's blocks in position
      order, padded with block 0 past its last.
    - `query_start` [num_sequences + 1] int64: sequence s owns query rows
      `query_start[s]:query_start[s + 1]`.
    - `seq_lens` [num_sequences] int64: each sequence's keys, this step's included.
    """

    block_tables: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of paged attention, built by the model runner.

    - `positions` [num_tokens] int64: each token's absolute position in its sequence (RoPE).
    - `slot_mapping` [num_tokens] int64: where each token's new K/V is written.
    - `chunks`: sequences with more than one query token, attended one at a time.
    - `decode_token_indices` [num_decodes] int64: rows of single-token sequences, which are
      attended together as one padded batch (`None` when there are none); with
      `decode_paged`, also the rows of short chunks after context, which the kernel
      attends with the decodes.
    - `decode_shared_prefixes`: groups of decodes with a common run of shared keys (cascade
      attention), outer groups before the groups nested in them; empty when none is worth
      it. A decode in no group attends to all of its keys through `decode_key_slots`.
    - `decode_key_slots` [num_decodes, max_suffix_len] int64: slots of each decode's keys
      after its groups' shared runs (all of its keys when in no group), in position order,
      padded with slot 0.
    - `decode_key_mask` [num_decodes, 1, 1, max_suffix_len] bool: True for real keys;
      None when there are no shared prefixes and no padding (every row all real keys).
    - `decode_paged`: the decodes (one query row each) and short chunks after context
      (several) as one `PagedKernelBatch`, set instead of `decode_key_slots` and
      `decode_key_mask` when the runner uses the paged attention kernel and there are no
      shared prefixes.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    chunks: list[ChunkAttention]
    decode_token_indices: torch.Tensor | None = None
    decode_key_slots: torch.Tensor | None = None
    decode_key_mask: torch.Tensor | None = None
    decode_shared_prefixes: tuple[SharedPrefixGroup, ...] = ()
    decode_paged: PagedKernelBatch | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(slots=True)
class KVCache:
    """One layer's paged K and V: each [num_blocks, block_size, num_kv_heads, head_dim]."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
