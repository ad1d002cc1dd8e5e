"""Paged correctness of the model runner on a tiny random model.

The same sequence computed in one step, in chunks over scattered blocks, token by token, next
to other sequences, or after a prefix-cache hit must give the same logits: the KV cache is an
implementation detail. Tolerance 1e-5 (float32): the paths differ only in kernel choice and
summation order (~1e-7 here); a wrong slot or mask changes logits by far more.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.worker.model_runner import ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence
from tests.model.helpers import all_position_logits, random_token_ids, tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_and_config():
    return tiny_model(seed=0)


def make_runner(model_and_config, num_kv_blocks=32):
    model, config = model_and_config
    return ModelRunner(model, config, num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE)


def one_step_logits(model_and_config, token_ids):
    runner = make_runner(model_and_config)
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    sequence = ScheduledSequence("ref", token_ids, 0, list(range(num_blocks)), True)
    return all_position_logits(runner, sequence)


def test_chunked_prefill_over_scattered_blocks_matches_one_step(model_and_config):
    token_ids = random_token_ids(37, seed=3)
    expected = one_step_logits(model_and_config, token_ids)
    runner = make_runner(model_and_config)
    # Non-contiguous, out-of-order blocks; chunk edges in the middle of blocks.
    block_ids = [17, 3, 29, 8, 0, 22, 11, 5, 30, 14]
    logits = []
    for start, end in [(0, 6), (6, 7), (7, 21), (21, 37)]:
        step = ScheduledSequence("r", token_ids[start:end], start, block_ids, True)
        logits.append(all_position_logits(runner, step))
    torch.testing.assert_close(torch.cat(logits), expected, **TOL)


def test_token_by_token_decode_matches_one_step(model_and_config):
    token_ids = random_token_ids(21, seed=4)
    expected = one_step_logits(model_and_config, token_ids)
    runner = make_runner(model_and_config)
    block_ids = [6, 1, 12, 9, 4, 20]
    rows = [
        runner.execute([ScheduledSequence("r", [token_id], position, block_ids, True)])[0]
        for position, token_id in enumerate(token_ids)
    ]
    torch.testing.assert_close(torch.stack(rows), expected, **TOL)


def test_mixed_batch_sequences_do_not_interfere(model_and_config):
    """A prefill, a later chunk of a second prompt and two decodes share one step."""
    prompts = {
        name: random_token_ids(n, seed=10 + i)
        for i, (name, n) in enumerate([("a", 13), ("b", 19), ("c", 9), ("d", 5)])
    }
    expected = {name: one_step_logits(model_and_config, ids)[-1] for name, ids in prompts.items()}
    runner = make_runner(model_and_config, num_kv_blocks=40)
    tables = {"a": [0, 5, 10, 15], "b": [1, 6, 11, 16, 21], "c": [2, 7, 12], "d": [3, 8]}
    # Bring b, c and d up to their last token first.
    runner.execute(
        [
            ScheduledSequence("b", prompts["b"][:8], 0, tables["b"], False),
            ScheduledSequence("c", prompts["c"][:8], 0, tables["c"], False),
            ScheduledSequence("d", prompts["d"][:4], 0, tables["d"], False),
        ]
    )
    logits = runner.execute(
        [
            ScheduledSequence("c", prompts["c"][8:], 8, tables["c"], True),
            ScheduledSequence("a", prompts["a"], 0, tables["a"], True),
            ScheduledSequence("b", prompts["b"][8:], 8, tables["b"], True),
            ScheduledSequence("d", prompts["d"][4:], 4, tables["d"], True),
        ]
    )
    assert logits.shape == (4, model_and_config[1].vocab_size)
    assert logits.dtype == torch.float32
    for row, name in enumerate(["c", "a", "b", "d"]):
        torch.testing.assert_close(logits[row], expected[name], **TOL)


def test_batched_decodes_of_different_lengths_match_alone(model_and_config):
    lengths = [3, 17, 8, 1]
    prompts = [random_token_ids(n, seed=20 + n) for n in lengths]
    expected = [one_step_logits(model_and_config, ids)[-1] for ids in prompts]
    runner = make_runner(model_and_config)
    tables = [[4, 9], [0, 13, 2, 25, 7], [30, 31], [18]]
    prefills = [
        ScheduledSequence(str(i), ids[:-1], 0, table, False)
        for i, (ids, table) in enumerate(zip(prompts, tables, strict=True))
        if len(ids) > 1
    ]
    runner.execute(prefills)
    decodes = [
        ScheduledSequence(str(i), ids[-1:], len(ids) - 1, table, True)
        for i, (ids, table) in enumerate(zip(prompts, tables, strict=True))
    ]
    logits = runner.execute(decodes)
    torch.testing.assert_close(logits, torch.stack(expected), **TOL)


def test_prefix_cache_hit_reuses_shared_blocks(model_and_config):
    """B shares A's first two full blocks: it computes only its own tail, reading A's KV."""
    shared = random_token_ids(8, seed=30)
    prompt_a = shared + random_token_ids(6, seed=31)
    prompt_b = shared + random_token_ids(7, seed=32)
    runner = make_runner(model_and_config)
    runner.execute([ScheduledSequence("a", prompt_a, 0, [10, 4, 19, 2], True)])
    # B's table starts with A's two full blocks; its own tail goes into fresh blocks.
    hit = runner.execute([ScheduledSequence("b", prompt_b[8:], 8, [10, 4, 7, 23], True)])
    torch.testing.assert_close(hit[0], one_step_logits(model_and_config, prompt_b)[-1], **TOL)


def test_stale_kv_in_a_block_is_overwritten(model_and_config):
    """A freed block reused by another sequence must not leak the old sequence's keys."""
    runner = make_runner(model_and_config)
    runner.execute([ScheduledSequence("old", random_token_ids(8, seed=40), 0, [1, 2], False)])
    new_prompt = random_token_ids(6, seed=41)
    logits = runner.execute([ScheduledSequence("new", new_prompt, 0, [2, 1], True)])
    torch.testing.assert_close(logits[0], one_step_logits(model_and_config, new_prompt)[-1], **TOL)


def test_only_sequences_that_need_logits_are_returned_in_order(model_and_config):
    runner = make_runner(model_and_config)
    ids = {name: random_token_ids(5, seed=50 + i) for i, name in enumerate("xyz")}
    logits = runner.execute(
        [
            ScheduledSequence("x", ids["x"], 0, [0, 1], True),
            ScheduledSequence("y", ids["y"], 0, [2, 3], False),
            ScheduledSequence("z", ids["z"], 0, [4, 5], True),
        ]
    )
    assert logits.shape[0] == 2
    torch.testing.assert_close(logits[0], one_step_logits(model_and_config, ids["x"])[-1], **TOL)
    torch.testing.assert_close(logits[1], one_step_logits(model_and_config, ids["z"])[-1], **TOL)
    assert runner.execute([]).shape == (0, model_and_config[1].vocab_size)


def test_step_inputs_positions_and_slots(model_and_config):
    runner = make_runner(model_and_config)
    inputs = runner.build_step_inputs(
        [
            ScheduledSequence("p", [5, 6, 7], 2, [7, 3], True),  # positions 2, 3, 4
            ScheduledSequence("d", [9], 5, [0, 12], True),  # position 5 -> block 12, offset 1
        ]
    )
    metadata = inputs.metadata
    assert inputs.input_ids.tolist() == [5, 6, 7, 9]
    assert metadata.positions.tolist() == [2, 3, 4, 5]
    assert metadata.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 12 * 4 + 1]
    assert inputs.logits_indices.tolist() == [2, 3]
    (chunk,) = metadata.chunks
    assert (chunk.token_start, chunk.token_end) == (0, 3)
    assert chunk.key_slots.tolist() == [28, 29, 30, 31, 12]
    assert chunk.causal_mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert metadata.decode_token_indices.tolist() == [3]
    assert metadata.decode_key_slots.tolist() == [[0, 1, 2, 3, 48, 49]]
    assert metadata.decode_key_mask is None  # one decode: no padding, so no mask


@pytest.mark.parametrize(
    ("sequence", "message"),
    [
        (ScheduledSequence("r", [], 0, [0], True), "no tokens"),
        (ScheduledSequence("r", [1] * 9, 0, [0, 1], True), "need 3 blocks"),
        (ScheduledSequence("r", [1, 2], 0, [32], True), "block ids must be in"),
        (ScheduledSequence("r", [1], 256, [0] * 65, True), "maximum position"),
    ],
)
def test_invalid_sequences_are_rejected(model_and_config, sequence, message):
    runner = make_runner(model_and_config, num_kv_blocks=32)
    with pytest.raises(ValueError, match=message):
        runner.execute([sequence])


def test_kv_tensors_are_allocated_per_layer_in_the_requested_dtype(model_and_config):
    model, config = model_and_config
    runner = ModelRunner(model, config, num_kv_blocks=7, block_size=BLOCK_SIZE)
    assert len(runner.kv_caches) == config.num_layers
    for kv_cache in runner.kv_caches:
        assert kv_cache.key_cache.shape == (7, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        assert kv_cache.value_cache.shape == kv_cache.key_cache.shape
        assert kv_cache.key_cache.dtype == torch.float32
    bf16_runner = ModelRunner(model, config, 3, BLOCK_SIZE, dtype=torch.bfloat16)
    assert bf16_runner.kv_caches[0].key_cache.dtype == torch.bfloat16


def test_bfloat16_model_tracks_float32(model_and_config):
    """bfloat16 keeps 8 mantissa bits (relative error ~4e-3 per rounding); over two layers
    the logits stay within 0.1 of float32 and the top token agrees on this tiny model."""
    model, config = model_and_config
    token_ids = random_token_ids(30, seed=60)
    expected = one_step_logits(model_and_config, token_ids)[-1]
    bf16_model, _ = tiny_model(seed=0)
    bf16_model = bf16_model.to(torch.bfloat16)
    runner = ModelRunner(bf16_model, config, num_kv_blocks=8, block_size=BLOCK_SIZE)
    logits = runner.execute([ScheduledSequence("r", token_ids, 0, list(range(8)), True)])[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)
    assert int(logits.argmax()) == int(expected.argmax())
