"""The model runner: owns the paged KV tensors and executes one batched step.

It decides nothing. The scheduler says which tokens of which sequences to compute
(`ScheduledSequence`), the KV cache manager has already said which blocks hold them; the
runner turns that into packed model inputs and attention metadata - in `build_step_inputs`,
the one place positions, slots, block tables and shared prefixes are derived - runs the model
and returns the logits of the sequences that will sample.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.kernels.paged_attention import KERNEL_HEAD_DIMS, load_paged_attention
from prefixcache.lora.slots import LoRASlots, LoRAStepBatch
from prefixcache.model.attention_metadata import (
    AttentionMetadata,
    ChunkAttention,
    KVCache,
    PagedKernelBatch,
    SharedPrefixGroup,
)
from prefixcache.model.config import ModelArchConfig
from prefixcache.model.llama import LlamaForCausalLM
from prefixcache.worker import kv_transfer
from prefixcache.worker.compiled_decode import CompiledDecode
from prefixcache.worker.scheduled_sequence import ScheduledSequence

logger = logging.getLogger(__name__)

# One layer of SmolLM2-135M shapes (float32, 2 threads): cascade decode attention broke even
# with the plain padded batch at roughly 64-128 shared tokens for 32 decodes, later for fewer
# (each group adds a handful of small kernels); 256 keeps small batches on the plain path.
DEFAULT_MIN_SHARED_PREFIX_TOKENS = 256

# Chunks after context of at most this many tokens (a new question on a cached document)
# join the decodes when the paged attention kernel attends them: the kernel reads the
# context in place once for all of the chunk's rows, and such a step is compilable.
MAX_KERNEL_CHUNK_TOKENS = 8


@dataclass(slots=True)
class StepInputs:
    """Packed model inputs for one step (see `AttentionMetadata` for the layout)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num sequences with needs_logits] int64, input order
    lora: LoRAStepBatch | None = None  # the adapters' deltas; None if no token uses one


class ModelRunner:
    """Runs `model` over a paged KV cache of `num_kv_blocks` blocks of `block_size` tokens.

    Per layer it allocates a K and a V tensor of shape
    [num_kv_blocks, block_size, num_kv_heads, head_dim] in `dtype` (default: the model's
    parameter dtype). Block ids handed in by callers index the first dimension.

    Decodes whose block tables start with at least `min_shared_prefix_tokens` tokens' worth of
    the same blocks get cascade attention over that shared prefix (see `SharedPrefixGroup`),
    in nested groups where subsets share more (`_find_shared_prefixes`), provided it at
    least halves the longest run of keys each decode reads on its own; below either,
    reading the prefix once saves less than the extra attention and merge cost.

    With `max_loras` set, sequences may carry a LoRA adapter: each step activates its
    sequences' adapters in `max_loras` slots (`LoRASlots`) and every token gets its own
    adapter's delta; a step may mix the base model and up to `max_loras` adapters.

    With `compile_decode`, steps of decodes alone run through `torch.compile` (see
    `compiled_decode`); every other step, and every step if compiling fails, runs eagerly.
    With `paged_attention_kernel`, decodes outside cascade groups attend through the C++
    paged attention kernel (`prefixcache.kernels.paged_attention`) when it builds and the
    model's head size is one it supports; otherwise through gathered key slots.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        arch_config: ModelArchConfig,
        num_kv_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        min_shared_prefix_tokens: int = DEFAULT_MIN_SHARED_PREFIX_TOKENS,
        max_loras: int | None = None,
        compile_decode: bool = False,
        paged_attention_kernel: bool = False,
    ) -> None:
        if num_kv_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_kv_blocks and block_size must be positive, got {num_kv_blocks}, {block_size}"
            )
        if min_shared_prefix_tokens < 1:
            raise ValueError(
                f"min_shared_prefix_tokens must be at least 1, got {min_shared_prefix_tokens}"
            )
        self.min_shared_prefix_tokens = min_shared_prefix_tokens
        self.model = model
        self.arch_config = arch_config
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.dtype = dtype if dtype is not None else next(model.parameters()).dtype
        shape = (num_kv_blocks, block_size, arch_config.num_kv_heads, arch_config.head_dim)
        self.kv_caches = [
            KVCache(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(arch_config.num_layers)
        ]
        self.lora_slots = LoRASlots(arch_config, max_loras) if max_loras is not None else None
        # [block_size]: offsets within a block, reused to expand block tables into slots.
        self._block_offsets = torch.arange(block_size, dtype=torch.int64)
        self.compiled_decode = CompiledDecode(model) if compile_decode else None
        self.uses_paged_attention_kernel = (
            paged_attention_kernel and arch_config.head_dim in KERNEL_HEAD_DIMS
            and load_paged_attention()
        )

    @torch.inference_mode()
    def execute(self, sequences: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Compute one step; returns float32 logits [num sequences with needs_logits, vocab]
        in input order (an empty [0, vocab] tensor if none needs logits)."""
        if not sequences:
            return torch.empty(0, self.arch_config.vocab_size)
        inputs = self.build_step_inputs(sequences)
        args = (inputs.input_ids, self.kv_caches, inputs.metadata, inputs.logits_indices,
                inputs.lora)
        if self.compiled_decode is not None \
                and CompiledDecode.is_compilable(inputs.metadata, inputs.lora):
            return self.compiled_decode.run(self.model, *args)
        return self.model(*args)

    def compile_decode_steps(self, max_num_seqs: int) -> None:
        """With `compile_decode`, compile now every graph that steps of up to
        `max_num_seqs` sequences will use, so that no request waits for a compile.

        Runs dummy steps of decodes at position 0 of block 0, whose K/V they overwrite:
        call it before any request has written to the cache.
        """
        if self.compiled_decode is None:
            return
        # With the kernel a sequence may bring up to MAX_KERNEL_CHUNK_TOKENS rows.
        rows_per_sequence = MAX_KERNEL_CHUNK_TOKENS if self.uses_paged_attention_kernel else 1
        for num_tokens in self.compiled_decode.step_sizes_to_compile(
                max_num_seqs * rows_per_sequence):
            start = time.perf_counter()
            self.execute([ScheduledSequence(f"compile-{i}", [0], 0, [0], True)
                          for i in range(num_tokens)])
            logger.info("compiled the decode step graph for %d token(s) in %.1f s", num_tokens,
                        time.perf_counter() - start)
        if self.uses_paged_attention_kernel:
            # Every compilable step then has the same structure (rows for the kernel, no
            # mask, no chunk on its own), so the graphs differ only in the token count
            # guards that choose among them.
            self.compiled_decode.mark_all_graphs_compiled()

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The KV of ``block_ids`` as payloads for the KV tier (see `kv_transfer`)."""
        return kv_transfer.read_kv_blocks(self.kv_caches, block_ids)

    def write_kv_blocks(self, block_ids: Sequence[int], payloads: Sequence) -> None:
        """Fill ``block_ids`` with KV tier payloads, before a step that reads them."""
        kv_transfer.write_kv_blocks(self.kv_caches, block_ids, payloads)

    def build_step_inputs(self, sequences: Sequence[ScheduledSequence]) -> StepInputs:
        """Derive token ids, positions, slot mapping and per-sequence key slots.

        Raises ValueError if a sequence has no tokens, a block table too short for its
        tokens, a block id outside the pool, or runs past the model's maximum position; or
        carries a LoRA adapter when the runner has no slots, or more adapters than slots.
        """
        block_size = self.block_size
        max_positions = self.arch_config.max_position_embeddings
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        chunks: list[ChunkAttention] = []
        decode_rows: list[int] = []
        decode_block_tables: list[list[int]] = []
        decode_seq_lens: list[int] = []
        decode_query_rows: list[int] = []  # per sequence on the decode path: its rows
        logits_rows: list[int] = []
        lora = self._lora_step_batch(sequences)

        for seq in sequences:
            num_new = len(seq.token_ids)
            start = seq.start_position
            end = start + num_new
            if num_new == 0:
                raise ValueError(f"request {seq.request_id}: no tokens scheduled")
            if start < 0 or end > max_positions:
                raise ValueError(
                    f"request {seq.request_id}: positions {start}..{end - 1} exceed the "
                    f"model's maximum position {max_positions - 1}"
                )
            num_needed_blocks = -(-end // block_size)
            if len(seq.block_ids) < num_needed_blocks:
                raise ValueError(
                    f"request {seq.request_id}: {end} tokens need {num_needed_blocks} blocks, "
                    f"block table has {len(seq.block_ids)}"
                )
            block_ids = seq.block_ids[:num_needed_blocks]
            if min(block_ids) < 0 or max(block_ids) >= self.num_kv_blocks:
                raise ValueError(
                    f"request {seq.request_id}: block ids must be in [0, {self.num_kv_blocks})"
                )
            row = len(input_ids)
            input_ids.extend(seq.token_ids)
            positions.append(torch.arange(start, end, dtype=torch.int64))
            if num_new == 1:
                # Decodes (and 1-token chunks) are attended together as one padded batch.
                slot = block_ids[start // block_size] * block_size + start % block_size
                slot_mapping.append(torch.tensor([slot], dtype=torch.int64))
                decode_rows.append(row)
                decode_block_tables.append(block_ids)
                decode_seq_lens.append(end)
                decode_query_rows.append(1)
            elif (self.uses_paged_attention_kernel and start > 0
                  and num_new <= MAX_KERNEL_CHUNK_TOKENS):
                slot_mapping.append(self._block_slots(block_ids)[start:end])
                decode_rows.extend(range(row, row + num_new))
                decode_block_tables.append(block_ids)
                decode_seq_lens.append(end)
                decode_query_rows.append(num_new)
            else:
                seq_slots = self._block_slots(block_ids)[:end]  # the slot of every position
                slot_mapping.append(seq_slots[start:])
                if start == 0:
                    chunks.append(ChunkAttention(row, row + num_new, None, None))
                else:
                    # Query i (position start + i) sees keys 0..start + i.
                    key_positions = torch.arange(end)
                    query_positions = torch.arange(start, end)
                    causal_mask = key_positions[None, :] <= query_positions[:, None]  # [q, end]
                    chunks.append(ChunkAttention(row, row + num_new, seq_slots, causal_mask))
            if seq.needs_logits:
                logits_rows.append(row + num_new - 1)

        metadata = AttentionMetadata(
            positions=torch.cat(positions),
            slot_mapping=torch.cat(slot_mapping),
            chunks=chunks,
        )
        if decode_rows:
            self._add_decode_metadata(metadata, decode_rows, decode_block_tables,
                                      decode_seq_lens, decode_query_rows)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            metadata=metadata,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            lora=lora,
        )

    def _lora_step_batch(self, sequences: Sequence[ScheduledSequence]) -> LoRAStepBatch | None:
        """Activate the sequences' adapters and build the step's deltas; None if no
        sequence uses an adapter."""
        adapters = list(dict.fromkeys(
            seq.lora_adapter for seq in sequences if seq.lora_adapter is not None))
        if not adapters:
            return None
        if self.lora_slots is None:
            raise ValueError("a sequence uses a LoRA adapter but the runner has no LoRA "
                             "slots (max_loras unset)")
        adapter_to_slot = self.lora_slots.activate(adapters)
        # [T]: each token's slot, -1 for the base model; sequences are packed in order.
        token_slots = torch.tensor(
            [-1 if seq.lora_adapter is None else adapter_to_slot[seq.lora_adapter]
             for seq in sequences], dtype=torch.int64,
        ).repeat_interleave(torch.tensor([len(seq.token_ids) for seq in sequences]))
        return self.lora_slots.step_batch(token_slots)

    def _block_slots(self, block_ids: list[int]) -> torch.Tensor:
        """The slots of every position in `block_ids`, in order: [len(block_ids) * block_size]."""
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        # [num_blocks, 1] * block_size + [block_size] -> [num_blocks, block_size] -> flat
        return (blocks[:, None] * self.block_size + self._block_offsets).view(-1)

    def _add_decode_metadata(
        self,
        metadata: AttentionMetadata,
        decode_rows: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        num_query_rows: list[int],
    ) -> None:
        """Decode rows, shared-prefix groups and each decode's remaining (suffix) key slots.

        `block_tables[i]` holds exactly the blocks of sequence i's `seq_lens[i]` tokens,
        whose last `num_query_rows[i]` are computed this step: one for a decode, more for
        a short chunk the paged attention kernel attends (then the step has no cascade
        groups, which hold single-row decodes only).
        """
        block_size = self.block_size
        shared_prefixes = (self._find_shared_prefixes(block_tables, seq_lens)
                           if max(num_query_rows) == 1 else [])
        num_skipped_blocks = [0] * len(block_tables)
        for rows, _, end_block in shared_prefixes:
            for row in rows:
                # Nested groups come after their outer group: the last one seen is deepest.
                num_skipped_blocks[row] = end_block
        suffix_lens = [
            seq_len - skip * block_size
            for seq_len, skip in zip(seq_lens, num_skipped_blocks, strict=True)
        ]
        if shared_prefixes and 2 * max(suffix_lens) > max(seq_lens):
            # Every decode reads the padded suffix batch, so a long decode outside the groups
            # (or long suffixes) leaves cascade reading about as much as the plain path, with
            # a slower unfused attention on top: use it only when it halves the padded batch.
            shared_prefixes = []
            num_skipped_blocks = [0] * len(block_tables)
            suffix_lens = seq_lens
        # A shared prefix is whole blocks, so each suffix starts at a block boundary.
        suffix_tables = [
            table[skip:] for table, skip in zip(block_tables, num_skipped_blocks, strict=True)
        ]
        max_blocks = max(len(table) for table in suffix_tables)
        max_len = max(suffix_lens)
        # Pad with block 0: its slots are valid indices, and the mask hides them.
        padded = [table + [0] * (max_blocks - len(table)) for table in suffix_tables]
        tables = torch.tensor(padded, dtype=torch.int64)  # [D, max_blocks]
        metadata.decode_token_indices = torch.tensor(decode_rows, dtype=torch.int64)
        if self.uses_paged_attention_kernel and not shared_prefixes:
            metadata.decode_paged = PagedKernelBatch(
                block_tables=tables,
                query_start=torch.tensor([0, *itertools.accumulate(num_query_rows)],
                                         dtype=torch.int64),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            )
            return
        # [D, max_blocks, block_size] -> [D, max_blocks * block_size] -> [D, max_len]
        key_slots = (
            (tables[:, :, None] * block_size + self._block_offsets)
            .view(len(decode_rows), -1)[:, :max_len]
            .contiguous()
        )  # flattened by attention, so kept contiguous
        lens = torch.tensor(suffix_lens, dtype=torch.int64)
        key_mask = torch.arange(max_len)[None, :] < lens[:, None]  # [D, max_len]
        # Unpadded (every suffix max_len long) the plain path needs no mask at all.
        metadata.decode_key_slots = key_slots
        if shared_prefixes or min(suffix_lens) < max_len:
            metadata.decode_key_mask = key_mask[:, None, None, :]  # [D, 1, 1, max_len]
        metadata.decode_shared_prefixes = tuple(
            SharedPrefixGroup(
                decode_rows=torch.tensor(rows, dtype=torch.int64),
                key_slots=self._block_slots(block_tables[rows[0]][start_block:end_block]),
            )
            for rows, start_block, end_block in shared_prefixes
        )

    def _find_shared_prefixes(
        self, block_tables: list[list[int]], seq_lens: list[int]
    ) -> list[tuple[list[int], int, int]]:
        """Groups of decodes as (rows ascending, start block, end block): the members' tables
        hold the same blocks at positions start..end-1. Outer groups come before the groups
        nested in them.

        The block tables form a tree (the prefix cache gives requests with the same prompt
        start the same block ids). Walking it from the root, every branch point that two or
        more decodes pass through starts a set of members, whose common blocks run to their
        next branch point - cut to the whole blocks before every member's current position,
        whose key must stay in its own suffix. The run becomes a group if it holds at least
        `min_shared_prefix_tokens` tokens; a shorter run is not worth a group of its own
        (each adds a few small kernels) and is left to the groups below it to include, or,
        where there are none, to the members' suffixes. So with every decode sharing a
        system prompt and subsets of them a document after it, the system prompt is read
        once, each document once, and each decode reads only its own tail.
        """
        block_size = self.block_size
        min_blocks = -(-self.min_shared_prefix_tokens // block_size)
        # The current position of a sequence of length n is n - 1, in block (n - 1) // size.
        shareable_blocks = [(seq_len - 1) // block_size for seq_len in seq_lens]
        shared_prefixes: list[tuple[list[int], int, int]] = []
        # (rows that hold the same blocks before `depth`, depth, first block not yet in one
        # of their groups); a stack, children pushed in reverse, for outer-first order.
        pending = [(list(range(len(block_tables))), 0, 0)]
        while pending:
            rows, depth, uncovered_from = pending.pop()
            branches: dict[int, list[int]] = {}
            for row in rows:
                if shareable_blocks[row] > depth:
                    branches.setdefault(block_tables[row][depth], []).append(row)
            children = []
            for members in branches.values():
                if len(members) < 2:
                    continue
                tables = [block_tables[row] for row in members]
                limit = min(shareable_blocks[row] for row in members)
                # The common prefix of the lexicographically smallest and largest tables is
                # the common prefix of all of them (two C-level scans, not one per table).
                lowest, highest = min(tables), max(tables)
                end = depth + 1
                while end < limit and lowest[end] == highest[end]:
                    end += 1
                start = uncovered_from
                if end - start >= min_blocks:
                    shared_prefixes.append((members, start, end))
                    start = end
                children.append((members, end, start))
            pending.extend(reversed(children))
        return shared_prefixes
