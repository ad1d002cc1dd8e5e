"""Greedy outputs do not depend on how the engine got there: prefix caching on or off,
chunked prefill, preemption and recomputation, shared prefixes hit inside one batch — all
token-for-token identical to one request at a time without any cache, and to Hugging Face
``generate``."""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache.engine.sampling_params import SamplingParams
from tests.engine.helpers import (
    assert_all_blocks_free,
    random_tokens,
    run_batch,
    run_to_completion,
    solo_token_ids,
)

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_prompts(vocab_size: int) -> list[list[int]]:
    """Eight prompts: five share a 22-token system prefix (two of them also a longer
    document prefix), three are unrelated; lengths 9..46."""
    rng = random.Random(7)
    system = random_tokens(rng, 22, vocab_size)
    document = random_tokens(rng, 13, vocab_size)
    return [
        system + random_tokens(rng, 5, vocab_size),
        system + document + random_tokens(rng, 3, vocab_size),
        random_tokens(rng, 9, vocab_size),
        system + document + random_tokens(rng, 11, vocab_size),
        system + random_tokens(rng, 1, vocab_size),
        random_tokens(rng, 30, vocab_size),
        system + random_tokens(rng, 8, vocab_size),
        random_tokens(rng, 17, vocab_size),
    ]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return make_prompts(tiny_model.arch_config.vocab_size)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """Each prompt alone on a fresh engine with no prefix cache: the ground truth."""
    return solo_token_ids(tiny_model, prompts, GREEDY, BLOCK_SIZE)




def test_reference_matches_hugging_face_generate(tiny_model_dir, prompts, reference):
    from transformers import LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    for prompt, expected in zip(prompts[:3], reference[:3], strict=True):
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                min_new_tokens=GREEDY.max_tokens, pad_token_id=0,
            )
        assert generated[0, len(prompt):].tolist() == expected


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7], ids=["whole", "chunked"])
def test_batch_equals_reference(make_engine, prompts, reference, enable_prefix_caching,
                                max_num_batched_tokens):
    engine = make_engine(enable_prefix_caching=enable_prefix_caching, block_size=BLOCK_SIZE,
                         max_num_batched_tokens=max_num_batched_tokens)
    outputs = run_batch(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert all(o.finish_reason == "length" for o in outputs)
    stats = engine.get_stats()
    if enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
        assert all(o.num_cached_tokens == 0 for o in outputs)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_under_preemption_equals_reference(make_engine, prompts, reference,
                                           enable_prefix_caching):
    # 24 blocks of 4 = 96 token slots; the eight requests need up to 58 tokens each.
    engine = make_engine(enable_prefix_caching=enable_prefix_caching, block_size=BLOCK_SIZE,
                         num_kv_blocks=24, max_num_batched_tokens=16)
    outputs = run_batch(engine, prompts, GREEDY)
    assert engine.get_stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference
    assert_all_blocks_free(engine)


def test_cached_repeat_equals_reference(make_engine, prompts, reference):
    """Every prompt again after the batch: served mostly from the cache, same tokens."""
    engine = make_engine(block_size=BLOCK_SIZE)
    run_batch(engine, prompts, GREEDY)
    hits_before = engine.get_stats().prefix_cache_hits
    outputs = run_batch(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    for prompt, output in zip(prompts, outputs, strict=True):
        # The whole prompt but its last token is cached, in whole blocks.
        assert output.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert engine.get_stats().prefix_cache_hits - hits_before == \
        sum(o.num_cached_tokens for o in outputs)


def test_shared_prefix_hits_inside_one_batch(make_engine, tiny_model):
    """Two requests with a shared prefix added together: the second hits the first's
    blocks in the very step that computes them, and both decode correctly."""
    rng = random.Random(3)
    vocab_size = tiny_model.arch_config.vocab_size
    shared = random_tokens(rng, 18, vocab_size)
    first = shared + random_tokens(rng, 4, vocab_size)
    second = shared + random_tokens(rng, 6, vocab_size)
    engine = make_engine(block_size=BLOCK_SIZE)
    engine.add_request("first", first, GREEDY)
    engine.add_request("second", second, GREEDY)
    step_outputs = engine.step()
    first_step = {o.request_id: o for o in step_outputs}
    assert set(first_step) == {"first", "second"}
    assert first_step["first"].num_cached_tokens == 0
    assert first_step["second"].num_cached_tokens == 18 // BLOCK_SIZE * BLOCK_SIZE
    finals = run_to_completion(engine, step_outputs)

    alone = make_engine(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    alone.add_request("second", second, GREEDY)
    assert finals["second"].token_ids == run_to_completion(alone)["second"].token_ids


def test_nested_cascade_attention_equals_reference(make_engine, prompts, reference,
                                                   monkeypatch):
    """With cascade attention from one block of sharing, the prompts' nested prefixes (five
    share the system prompt, two of them also the document) decode in nested groups — and
    the tokens do not change. (The unrelated prompts are left out: a long loner makes
    cascade not worth it for the whole step.)"""
    from prefixcache.worker import model_runner

    sharing = [i for i, prompt in enumerate(prompts) if prompt[:22] == prompts[0][:22]]
    assert len(sharing) == 5

    engine = make_engine(block_size=BLOCK_SIZE)
    engine.runner.min_shared_prefix_tokens = BLOCK_SIZE
    nested_steps = []
    build = model_runner.ModelRunner.build_step_inputs

    def spy(runner, sequences):
        inputs = build(runner, sequences)
        groups = [set(group.decode_rows.tolist())
                  for group in inputs.metadata.decode_shared_prefixes]
        if any(inner < outer for inner in groups for outer in groups):
            nested_steps.append(groups)  # a group nested in another, used this step
        return inputs

    monkeypatch.setattr(model_runner.ModelRunner, "build_step_inputs", spy)
    outputs = run_batch(engine, [prompts[i] for i in sharing], GREEDY)
    assert [o.token_ids for o in outputs] == [reference[i] for i in sharing]
    assert nested_steps, "no step used a nested group"
    assert_all_blocks_free(engine)
