"""Decodes through the paged attention kernel equal decodes through gathered key slots.

A runner with the kernel and one without share a model (head size 64, one the kernel is
built for); both fill their caches identically and decode one step of sequences of
different lengths, alone and mixed with prefill chunks. Float32 logits agree to 1e-5 (the
paths differ only in summation order) and match the whole sequence computed at once. With
shared prefixes, cascade attention keeps the decodes it groups.
"""

from __future__ import annotations

import logging

import pytest
import torch

from prefixcache.kernels.paged_attention import load_paged_attention
from prefixcache.worker.model_runner import MAX_KERNEL_CHUNK_TOKENS, ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence
from tests.model.helpers import all_position_logits, random_token_ids, tiny_model

pytestmark = pytest.mark.skipif(
    not load_paged_attention(), reason="no C++ toolchain to build the kernel")

TOL = dict(atol=1e-5, rtol=1e-5)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_and_config():
    return tiny_model(seed=3, head_dim=64)


def make_runner(model_and_config, kernel, min_shared_prefix_tokens=10**9):
    model, config = model_and_config
    return ModelRunner(model, config, num_kv_blocks=64, block_size=BLOCK_SIZE,
                       min_shared_prefix_tokens=min_shared_prefix_tokens,
                       paged_attention_kernel=kernel)


def fill_and_decode(runner, sequences, extra_steps=()):
    """Prefill every sequence but its last token, then one step of their last tokens
    (with `extra_steps` inserted first); returns (logits, metadata) of that step."""
    for i, (token_ids, table) in enumerate(sequences):
        runner.execute([ScheduledSequence(f"fill{i}", token_ids[:-1], 0, table, False)])
    steps = [*extra_steps] + [
        ScheduledSequence(str(i), token_ids[-1:], len(token_ids) - 1, table, True)
        for i, (token_ids, table) in enumerate(sequences)
    ]
    with torch.inference_mode():
        inputs = runner.build_step_inputs(steps)
        logits = runner.model(inputs.input_ids, runner.kv_caches, inputs.metadata,
                              inputs.logits_indices, inputs.lora)
    return logits, inputs.metadata


def whole_sequence_logits(model_and_config, token_ids):
    runner = make_runner(model_and_config, kernel=False)
    table = list(range(-(-len(token_ids) // BLOCK_SIZE)))
    return all_position_logits(runner, ScheduledSequence("ref", token_ids, 0, table, True))[-1]


SEQUENCES = [
    (random_token_ids(2, seed=1), [5]),
    (random_token_ids(9, seed=2), [9, 2, 7]),
    (random_token_ids(40, seed=3), list(range(20, 30))),
    (random_token_ids(16, seed=4), [40, 31, 33, 44]),
]


def test_runner_uses_the_kernel_for_head_size_64(model_and_config):
    assert make_runner(model_and_config, kernel=True).uses_paged_attention_kernel
    small, config = tiny_model(seed=3)  # head size 12: not one the kernel is built for
    runner = ModelRunner(small, config, num_kv_blocks=8, block_size=4,
                         paged_attention_kernel=True)
    assert not runner.uses_paged_attention_kernel


def test_decodes_of_different_lengths_equal_the_gathered_path(model_and_config):
    kernel_logits, metadata = fill_and_decode(make_runner(model_and_config, True), SEQUENCES)
    gathered_logits, plain = fill_and_decode(make_runner(model_and_config, False), SEQUENCES)
    assert metadata.decode_paged is not None and metadata.decode_key_slots is None
    assert plain.decode_paged is None
    assert metadata.decode_paged.seq_lens.tolist() == [len(ids) for ids, _ in SEQUENCES]
    torch.testing.assert_close(kernel_logits, gathered_logits, **TOL)
    expected = torch.stack([whole_sequence_logits(model_and_config, ids)
                            for ids, _ in SEQUENCES])
    torch.testing.assert_close(kernel_logits, expected, **TOL)


def test_decodes_mixed_with_prefill_chunks(model_and_config):
    chunks = [
        ScheduledSequence("fresh", random_token_ids(6, seed=7), 0, [50, 51], True),
    ]
    kernel_logits, metadata = fill_and_decode(
        make_runner(model_and_config, True), SEQUENCES, chunks)
    gathered_logits, _ = fill_and_decode(
        make_runner(model_and_config, False), SEQUENCES, chunks)
    assert metadata.chunks and metadata.decode_paged is not None
    torch.testing.assert_close(kernel_logits, gathered_logits, **TOL)


def test_short_chunks_after_context_join_the_kernel_batch(model_and_config):
    """A 3-token question on a cached 12-token document is attended by the kernel with the
    decodes (no chunk of its own); a chunk longer than MAX_KERNEL_CHUNK_TOKENS is not."""
    document = random_token_ids(12, seed=12)
    question = random_token_ids(3, seed=13)
    long_tail = random_token_ids(MAX_KERNEL_CHUNK_TOKENS + 1, seed=14)

    def run(kernel):
        runner = make_runner(model_and_config, kernel)
        runner.execute([ScheduledSequence("doc", document, 0, [60, 61, 62], False)])
        extra = [ScheduledSequence("question", question, 12, [60, 61, 62, 63], True),
                 ScheduledSequence("long", long_tail, 12, [60, 61, 62, 56, 57, 58], True)]
        return fill_and_decode(runner, SEQUENCES, extra)

    kernel_logits, metadata = run(kernel=True)
    gathered_logits, _ = run(kernel=False)
    assert len(metadata.chunks) == 1  # the long tail
    batch = metadata.decode_paged
    assert batch.query_start.tolist() == [0, 3, 4, 5, 6, 7]
    assert batch.seq_lens.tolist() == [15] + [len(ids) for ids, _ in SEQUENCES]
    torch.testing.assert_close(kernel_logits, gathered_logits, **TOL)
    expected = whole_sequence_logits(model_and_config, document + question)
    torch.testing.assert_close(kernel_logits[0], expected, **TOL)


def test_cascade_groups_keep_their_own_path(model_and_config):
    prompt = random_token_ids(8, seed=9)
    sharing = [(prompt + random_token_ids(3, seed=10), [1, 2, 3]),
               (prompt + random_token_ids(2, seed=11), [1, 2, 4])]
    kernel_logits, metadata = fill_and_decode(
        make_runner(model_and_config, True, min_shared_prefix_tokens=1), sharing)
    assert metadata.decode_shared_prefixes and metadata.decode_paged is None
    gathered_logits, _ = fill_and_decode(make_runner(model_and_config, False), sharing)
    torch.testing.assert_close(kernel_logits, gathered_logits, **TOL)


def test_compiled_decode_steps_call_the_kernel(model_and_config):
    """Under torch.compile the kernel is an opaque operator that the compiled step still
    calls, once per layer, giving the eager gathered path's logits."""
    model, config = model_and_config
    runner = ModelRunner(model, config, num_kv_blocks=64, block_size=BLOCK_SIZE,
                         min_shared_prefix_tokens=10**9, compile_decode=True,
                         paged_attention_kernel=True)
    runner.compile_decode_steps(max_num_seqs=len(SEQUENCES))
    for i, (token_ids, table) in enumerate(SEQUENCES):
        runner.execute([ScheduledSequence(f"fill{i}", token_ids[:-1], 0, table, False)])
    steps = [ScheduledSequence(str(i), token_ids[-1:], len(token_ids) - 1, table, True)
             for i, (token_ids, table) in enumerate(SEQUENCES)]
    with torch.profiler.profile() as profile:
        compiled_logits = runner.execute(steps)
    calls = [event for event in profile.events()
             if event.name == "prefixcache::paged_attention"]
    assert runner.compiled_decode._compiled is not None, "compiling failed"
    assert runner.compiled_decode._has_run
    assert len(calls) == config.num_layers
    gathered_logits, _ = fill_and_decode(make_runner(model_and_config, False), SEQUENCES)
    torch.testing.assert_close(compiled_logits, gathered_logits, atol=1e-4, rtol=1e-4)


def test_compiling_ahead_covers_every_later_decode_step(model_and_config):
    """After `compile_decode_steps`, steps of any number of decodes and short chunks, at
    any context length, run without compiling again."""
    from torch._dynamo.utils import counters

    model, config = model_and_config
    runner = ModelRunner(model, config, num_kv_blocks=64, block_size=BLOCK_SIZE,
                         min_shared_prefix_tokens=10**9, compile_decode=True,
                         paged_attention_kernel=True)
    runner.compile_decode_steps(max_num_seqs=2)
    assert runner.compiled_decode.step_sizes_to_compile(16) == [1, 2]  # float weights
    compiles = counters["stats"]["unique_graphs"]
    for i, (token_ids, table) in enumerate(SEQUENCES):
        runner.execute([ScheduledSequence(f"fill{i}", token_ids[:-1], 0, table, False)])
    decodes = [ScheduledSequence(str(i), ids[-1:], len(ids) - 1, table, True)
               for i, (ids, table) in enumerate(SEQUENCES)]
    question = ScheduledSequence("question", random_token_ids(3, seed=5), 37,
                                 SEQUENCES[2][1], True)
    for step in ([decodes[2]], decodes, [question], [question, decodes[0]], decodes[:2]):
        runner.execute(step)
    assert counters["stats"]["unique_graphs"] == compiles
    assert runner.compiled_decode._compiled is not None


def test_a_step_shape_not_compiled_ahead_is_compiled_then(model_and_config, caplog):
    """After the startup compile a step checks only the guards that choose among the
    graphs; a step that needs a graph not compiled then still gets one (with a warning),
    and the right logits."""
    model, config = model_and_config
    runner = ModelRunner(model, config, num_kv_blocks=64, block_size=BLOCK_SIZE,
                         min_shared_prefix_tokens=10**9, compile_decode=True,
                         paged_attention_kernel=True)
    runner.compiled_decode.step_sizes_to_compile = lambda max_step_tokens: [1]
    runner.compile_decode_steps(max_num_seqs=4)  # the 1-token graph only
    for i, (token_ids, table) in enumerate(SEQUENCES):
        runner.execute([ScheduledSequence(f"fill{i}", token_ids[:-1], 0, table, False)])
    steps = [ScheduledSequence(str(i), token_ids[-1:], len(token_ids) - 1, table, True)
             for i, (token_ids, table) in enumerate(SEQUENCES)]
    with caplog.at_level(logging.WARNING):
        compiled_logits = runner.execute(steps)
    assert "not compiled at startup" in caplog.text
    assert runner.compiled_decode._compiled is not None
    gathered_logits, _ = fill_and_decode(make_runner(model_and_config, False), SEQUENCES)
    torch.testing.assert_close(compiled_logits, gathered_logits, atol=1e-4, rtol=1e-4)
