"""Cascade (shared-prefix) decode attention equals the plain padded decode path.

Decodes whose block tables start with the same blocks attend to those shared keys once per
group and merge with their own suffix by log-sum-exp. Each story fills the KV cache the way
the engine does (a prompt's blocks, then cache hits computing only their tails), then runs
one decode step twice on the same cache: with cascade attention (`min_shared_prefix_tokens`
= 1) and with it disabled. Tolerance 1e-5 on float32 logits: the two paths differ only in
summation order and the merge (~1e-7 here); a wrong slot, mask or weight moves logits by
far more. Both are also checked against the whole sequence computed in one step.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.worker.model_runner import ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence
from tests.model.helpers import all_position_logits, random_token_ids, tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)
BLOCK_SIZE = 4
NO_CASCADE = 10**9  # a min_shared_prefix_tokens no group reaches

# Two "system prompts" of whole blocks, each written once into its own blocks.
PROMPT_P = random_token_ids(12, seed=100)  # blocks 10, 11, 12
PROMPT_Q = random_token_ids(8, seed=101)  # blocks 13, 14
P_BLOCKS = [10, 11, 12]
Q_BLOCKS = [13, 14]


@pytest.fixture(scope="module")
def model_and_config():
    return tiny_model(seed=0)


def make_runner(model_and_config, min_shared_prefix_tokens=1):
    model, config = model_and_config
    return ModelRunner(
        model,
        config,
        num_kv_blocks=48,
        block_size=BLOCK_SIZE,
        min_shared_prefix_tokens=min_shared_prefix_tokens,
    )


def reference_last_logits(model_and_config, token_ids):
    """Logits of the last token with the whole sequence computed in one step, no sharing."""
    runner = make_runner(model_and_config, NO_CASCADE)
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    sequence = ScheduledSequence("ref", token_ids, 0, list(range(num_blocks)), True)
    return all_position_logits(runner, sequence)[-1]


def fill_cache(runner, sequences):
    """Write the prompts P and Q, then each sequence's own tokens but its last, starting after
    its cached prefix as a prefix-cache hit would. `sequences`: (token_ids, table, num_cached).
    """
    runner.execute(
        [
            ScheduledSequence("P", PROMPT_P, 0, P_BLOCKS, False),
            ScheduledSequence("Q", PROMPT_Q, 0, Q_BLOCKS, False),
        ]
    )
    for i, (token_ids, table, num_cached) in enumerate(sequences):
        if len(token_ids) - 1 > num_cached:
            tail = token_ids[num_cached:-1]
            runner.execute([ScheduledSequence(f"fill{i}", tail, num_cached, table, False)])


def decode_steps(sequences):
    return [
        ScheduledSequence(str(i), token_ids[-1:], len(token_ids) - 1, table, True)
        for i, (token_ids, table, _) in enumerate(sequences)
    ]


@torch.inference_mode()
def cascade_and_plain(runner, steps, cascade_min_tokens=1):
    """Run one step's inputs twice on the same cache: cascade enabled (groups of at least
    `cascade_min_tokens` tokens), then disabled.

    Re-running a step rewrites the same K/V into the same slots, so both read one cache.
    Returns (cascade logits, plain logits, cascade metadata).
    """
    results = []
    for min_tokens in (cascade_min_tokens, NO_CASCADE):
        runner.min_shared_prefix_tokens = min_tokens
        inputs = runner.build_step_inputs(steps)
        logits = runner.model(
            inputs.input_ids, runner.kv_caches, inputs.metadata, inputs.logits_indices
        )
        results.append((logits, inputs.metadata))
    (cascade, metadata), (plain, plain_metadata) = results
    assert plain_metadata.decode_shared_prefixes == ()
    return cascade, plain, metadata


def groups_of(metadata):
    """[(decode rows, shared slots)] of a step's shared-prefix groups."""
    return [
        (group.decode_rows.tolist(), group.key_slots.tolist())
        for group in metadata.decode_shared_prefixes
    ]


def slots(block_ids):
    return [block * BLOCK_SIZE + offset for block in block_ids for offset in range(BLOCK_SIZE)]


def check_story(model_and_config, sequences, cascade_min_tokens=1):
    """Fill, decode with and without cascade, compare; returns the cascade metadata."""
    runner = make_runner(model_and_config)
    fill_cache(runner, sequences)
    cascade, plain, metadata = cascade_and_plain(
        runner, decode_steps(sequences), cascade_min_tokens)
    torch.testing.assert_close(cascade, plain, **TOL)
    expected = [reference_last_logits(model_and_config, ids) for ids, _, _ in sequences]
    torch.testing.assert_close(cascade, torch.stack(expected), **TOL)
    return metadata


def test_all_sequences_share_a_prefix(model_and_config):
    sequences = [
        (PROMPT_P + random_token_ids(5, seed=1), P_BLOCKS + [20, 21], 12),
        (PROMPT_P + random_token_ids(9, seed=2), P_BLOCKS + [22, 23, 24], 12),
        (PROMPT_P + random_token_ids(2, seed=3), P_BLOCKS + [25], 12),
    ]
    metadata = check_story(model_and_config, sequences)
    assert groups_of(metadata) == [([0, 1, 2], slots(P_BLOCKS))]
    # Each decode's own keys start right after the shared blocks.
    assert metadata.decode_key_slots[:, :4].tolist() == [slots([20]), slots([22]), slots([25])]
    assert metadata.decode_key_mask.view(3, -1).sum(dim=1).tolist() == [5, 9, 2]


def test_two_prefixes_and_a_loner(model_and_config):
    """Subsets share different prefixes (two system prompts); one decode shares nothing."""
    sequences = [
        (PROMPT_P + random_token_ids(3, seed=4), P_BLOCKS + [20], 12),
        (PROMPT_Q + random_token_ids(6, seed=5), Q_BLOCKS + [21, 22], 8),
        (random_token_ids(7, seed=6), [23, 24], 0),
        (PROMPT_P + random_token_ids(6, seed=7), P_BLOCKS + [25, 26], 12),
        (PROMPT_Q + random_token_ids(1, seed=8), Q_BLOCKS + [27], 8),
    ]
    metadata = check_story(model_and_config, sequences)
    assert groups_of(metadata) == [([0, 3], slots(P_BLOCKS)), ([1, 4], slots(Q_BLOCKS))]
    # The loner attends to all of its 7 keys outside any group.
    assert metadata.decode_key_slots[2, :7].tolist() == slots([23, 24])[:7]
    assert metadata.decode_key_mask.view(5, -1).sum(dim=1).tolist() == [3, 6, 7, 6, 1]


# Two "documents" after the system prompt P, each written once by its first reader.
DOC_1 = random_token_ids(8, seed=200)  # blocks 16, 17
DOC_2 = random_token_ids(8, seed=201)  # blocks 18, 19
DOC_1_BLOCKS = [16, 17]
DOC_2_BLOCKS = [18, 19]


def test_groups_nest_a_system_prompt_then_documents(model_and_config):
    """All decodes share P; two pairs also share a document after it: the pairs' groups
    take the document's keys only, so P is read once and each document once."""
    sequences = [
        (PROMPT_P + DOC_1 + random_token_ids(3, seed=40), P_BLOCKS + DOC_1_BLOCKS + [20], 12),
        (PROMPT_P + DOC_2 + random_token_ids(2, seed=41), P_BLOCKS + DOC_2_BLOCKS + [21], 12),
        (PROMPT_P + DOC_1 + random_token_ids(5, seed=42),
         P_BLOCKS + DOC_1_BLOCKS + [22, 23], 20),
        (PROMPT_P + random_token_ids(4, seed=43), P_BLOCKS + [24], 12),
        (PROMPT_P + DOC_2 + random_token_ids(6, seed=44),
         P_BLOCKS + DOC_2_BLOCKS + [25, 26], 20),
    ]
    metadata = check_story(model_and_config, sequences)
    assert groups_of(metadata) == [
        ([0, 1, 2, 3, 4], slots(P_BLOCKS)),
        ([0, 2], slots(DOC_1_BLOCKS)),
        ([1, 4], slots(DOC_2_BLOCKS)),
    ]
    # Each decode reads only what follows its deepest group.
    assert metadata.decode_key_mask.view(5, -1).sum(dim=1).tolist() == [3, 2, 5, 4, 6]
    assert metadata.decode_key_slots[:, 0].tolist() == [
        slots([20])[0], slots([21])[0], slots([22])[0], slots([24])[0], slots([25])[0]]


def test_a_shared_run_below_the_minimum_is_folded_into_the_groups_below_it(model_and_config):
    """P alone (12 tokens) is below a 16-token minimum, so it is no group of its own: each
    document group then starts at position 0 and covers P as well."""
    sequences = [
        (PROMPT_P + DOC_1 + random_token_ids(3, seed=45), P_BLOCKS + DOC_1_BLOCKS + [20], 12),
        (PROMPT_P + DOC_2 + random_token_ids(2, seed=46), P_BLOCKS + DOC_2_BLOCKS + [21], 12),
        (PROMPT_P + DOC_1 + random_token_ids(1, seed=47), P_BLOCKS + DOC_1_BLOCKS + [22], 20),
        (PROMPT_P + DOC_2 + random_token_ids(4, seed=48), P_BLOCKS + DOC_2_BLOCKS + [23], 20),
    ]
    metadata = check_story(model_and_config, sequences, cascade_min_tokens=16)
    assert groups_of(metadata) == [
        ([0, 2], slots(P_BLOCKS + DOC_1_BLOCKS)),
        ([1, 3], slots(P_BLOCKS + DOC_2_BLOCKS)),
    ]
    assert metadata.decode_key_mask.view(4, -1).sum(dim=1).tolist() == [3, 2, 1, 4]


def test_a_shared_run_below_the_minimum_with_no_group_below_stays_in_the_suffixes(
        model_and_config):
    """Two decodes share P and one more block, 16 tokens: at a 20-token minimum there is no
    group, and every key is read through the suffixes."""
    sequences = [
        (PROMPT_P + DOC_1[:4] + [5], P_BLOCKS + [16, 20], 12),
        (PROMPT_P + DOC_1[:4] + [6, 7], P_BLOCKS + [16, 21], 16),
    ]
    metadata = check_story(model_and_config, sequences, cascade_min_tokens=20)
    assert metadata.decode_shared_prefixes == ()
    assert metadata.decode_key_mask.view(2, -1).sum(dim=1).tolist() == [17, 18]


def test_no_sequences_share(model_and_config):
    sequences = [
        (random_token_ids(9, seed=9), [20, 21, 22], 0),
        (random_token_ids(14, seed=10), [23, 24, 25, 26], 0),
    ]
    metadata = check_story(model_and_config, sequences)
    assert metadata.decode_shared_prefixes == ()


def test_suffix_is_only_the_current_token_at_a_block_boundary(model_and_config):
    """The shared prefix ends exactly where the decode's current token starts a new block."""
    sequences = [
        (PROMPT_P + random_token_ids(1, seed=11), P_BLOCKS + [20], 12),
        (PROMPT_P + random_token_ids(1, seed=12), P_BLOCKS + [21], 12),
        (PROMPT_P + random_token_ids(4, seed=13), P_BLOCKS + [22], 12),
    ]
    metadata = check_story(model_and_config, sequences)
    assert groups_of(metadata) == [([0, 1, 2], slots(P_BLOCKS))]
    assert metadata.decode_key_mask.view(3, -1).sum(dim=1).tolist() == [1, 1, 4]


def test_shared_block_holding_a_current_position_stays_in_the_suffix(model_and_config):
    """A block that holds some decode's current position is never shared: the last token of
    P is decoded in P's own last block while another decode shares all of P's blocks."""
    sequences = [
        (PROMPT_P, P_BLOCKS, 0),  # current position 11: block 12, offset 3
        (PROMPT_P + random_token_ids(3, seed=14), P_BLOCKS + [20], 12),
    ]
    metadata = check_story(model_and_config, sequences)
    assert groups_of(metadata) == [([0, 1], slots(P_BLOCKS[:2]))]
    assert metadata.decode_key_slots[0, :4].tolist() == slots([12])


def test_group_below_the_minimum_is_not_used(model_and_config):
    model, config = model_and_config
    runner = ModelRunner(model, config, 48, BLOCK_SIZE, min_shared_prefix_tokens=13)
    steps = decode_steps(
        [
            (PROMPT_P + [1, 2], P_BLOCKS + [20], 12),
            (PROMPT_P + [3], P_BLOCKS + [21], 12),
        ]
    )
    assert runner.build_step_inputs(steps).metadata.decode_shared_prefixes == ()
    runner.min_shared_prefix_tokens = 12
    assert len(runner.build_step_inputs(steps).metadata.decode_shared_prefixes) == 1
    with pytest.raises(ValueError, match="min_shared_prefix_tokens"):
        ModelRunner(model, config, 48, BLOCK_SIZE, min_shared_prefix_tokens=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 2), (6, 2), (4, 4), (4, 1)],
    ids=["gqa-2", "gqa-3", "mha", "mqa"],
)
def test_grouped_query_shapes(num_heads, num_kv_heads):
    model_and_config = tiny_model(seed=1, num_heads=num_heads, num_kv_heads=num_kv_heads)
    sequences = [
        (PROMPT_P + random_token_ids(5, seed=15), P_BLOCKS + [20, 21], 12),
        (PROMPT_Q + random_token_ids(2, seed=16), Q_BLOCKS + [22], 8),
        (PROMPT_P + random_token_ids(2, seed=17), P_BLOCKS + [23], 12),
        (PROMPT_Q + random_token_ids(7, seed=18), Q_BLOCKS + [24, 25], 8),
    ]
    metadata = check_story(model_and_config, sequences)
    assert len(metadata.decode_shared_prefixes) == 2


def test_mixed_batch_with_prefill_chunks_and_shared_prefix_decodes(model_and_config):
    """A fresh prompt, a cache hit computing its tail and two sharing decodes in one step."""
    decoders = [
        (PROMPT_P + random_token_ids(5, seed=19), P_BLOCKS + [20, 21], 12),
        (PROMPT_P + random_token_ids(3, seed=20), P_BLOCKS + [22], 12),
    ]
    fresh = random_token_ids(6, seed=21)
    hit = PROMPT_Q + random_token_ids(5, seed=22)
    runner = make_runner(model_and_config)
    fill_cache(runner, decoders)
    a_decode, b_decode = decode_steps(decoders)
    steps = [
        ScheduledSequence("fresh", fresh, 0, [30, 31], True),
        a_decode,
        ScheduledSequence("hit", hit[8:], 8, Q_BLOCKS + [32, 33], True),
        b_decode,
    ]
    cascade, plain, metadata = cascade_and_plain(runner, steps)
    # Rows of the decode batch, not of the step: the decodes are step rows 6 and 12.
    assert metadata.decode_token_indices.tolist() == [6, 12]
    assert groups_of(metadata) == [([0, 1], slots(P_BLOCKS))]
    torch.testing.assert_close(cascade, plain, **TOL)
    expected = [
        reference_last_logits(model_and_config, ids) for ids in (fresh, decoders[0][0], hit)
    ] + [reference_last_logits(model_and_config, decoders[1][0])]
    torch.testing.assert_close(cascade, torch.stack(expected), **TOL)


def test_cascade_is_skipped_unless_it_halves_the_padded_batch(model_and_config):
    """A loner as long as the sharers keeps the padded batch long: the plain path runs."""
    sequences = [
        (PROMPT_P + random_token_ids(2, seed=23), P_BLOCKS + [20], 12),
        (PROMPT_P + random_token_ids(3, seed=24), P_BLOCKS + [21], 12),
        (random_token_ids(9, seed=25), [22, 23, 24], 0),  # 2 * 9 > 15 keys
    ]
    metadata = check_story(model_and_config, sequences)
    assert metadata.decode_shared_prefixes == ()
    assert metadata.decode_key_mask.view(3, -1).sum(dim=1).tolist() == [14, 15, 9]


@torch.inference_mode()
def test_greedy_decode_loop_is_unchanged_by_cascade(model_and_config):
    """Eight greedy decode steps of three sequences sharing P, across a block boundary,
    produce the same tokens (and logits) with cascade attention as without."""
    tails = [random_token_ids(n, seed=30 + n) for n in (1, 2, 3)]
    own_blocks = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31]]

    def run(min_shared_prefix_tokens):
        runner = make_runner(model_and_config, min_shared_prefix_tokens)
        sequences = [
            (PROMPT_P + tail, P_BLOCKS + blocks, 12)
            for tail, blocks in zip(tails, own_blocks, strict=True)
        ]
        fill_cache(runner, sequences)
        token_ids = [list(ids) for ids, _, _ in sequences]
        tables = [table for _, table, _ in sequences]
        all_logits, num_cascade_steps = [], 0
        for _ in range(8):
            pairs = zip(token_ids, tables, strict=True)
            steps = decode_steps([(ids, table, 0) for ids, table in pairs])
            inputs = runner.build_step_inputs(steps)
            num_cascade_steps += bool(inputs.metadata.decode_shared_prefixes)
            logits = runner.model(
                inputs.input_ids, runner.kv_caches, inputs.metadata, inputs.logits_indices
            )
            all_logits.append(logits)
            for ids, token_id in zip(token_ids, logits.argmax(dim=-1).tolist(), strict=True):
                ids.append(token_id)
        return token_ids, torch.stack(all_logits), num_cascade_steps

    cascade_ids, cascade_logits, num_cascade_steps = run(1)
    plain_ids, plain_logits, num_plain_cascade_steps = run(NO_CASCADE)
    assert (num_cascade_steps, num_plain_cascade_steps) == (8, 0)
    assert cascade_ids == plain_ids
    torch.testing.assert_close(cascade_logits, plain_logits, **TOL)
