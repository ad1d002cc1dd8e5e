"""The engine's features with quantized decode: prefix caching, chunked prefill, preemption
and cascade attention give the same greedy tokens as each prompt alone without a cache.

Which steps are few-token ones depends on the batch, so a sequence's tokens are computed
by a mix of dense and quantized steps. To test that quantized steps read and write the right
KV slots (not 4-bit rounding, tested in tests/model), the dense weights here are set to the
quantized weights' own values, and the tiny model's output head has large weights (no
near-ties for argmax). The paths still differ by the kernels' bfloat16 activations, which
after a dozen tokens flipped one near-tie in this prompt set: 8 tokens each are compared.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model.loader import load_model
from prefixcache.model.quantized_linear import DecodeQuantizedLinear
from tests.engine.helpers import (
    assert_all_blocks_free,
    run_batch,
    solo_token_ids,
)
from tests.engine.test_greedy_equivalence import make_prompts
from tests.entrypoints.tiny_model import build_tiny_model

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized_model(request, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    loaded = load_model(model_dir, quantization=request.param, max_quantized_tokens=8)
    with torch.no_grad():
        for module in loaded.model.modules():
            if isinstance(module, DecodeQuantizedLinear):
                # The weight the kernel computes with, read back through it (bfloat16).
                identity = torch.eye(module.weight.shape[1], dtype=torch.bfloat16)
                module.weight.copy_(module.quantized.matmul(identity).t())
    return loaded


@pytest.fixture(scope="module")
def prompts(quantized_model):
    return make_prompts(quantized_model.arch_config.vocab_size)


@pytest.fixture(scope="module")
def reference(quantized_model, prompts):
    return solo_token_ids(quantized_model, prompts, GREEDY, BLOCK_SIZE)




def make_engine(model, **options):
    options.setdefault("num_kv_blocks", 256)
    return LLMEngine.from_options(model, block_size=BLOCK_SIZE, **options)


def test_model_has_quantized_copies(quantized_model):
    linears = [m for m in quantized_model.model.modules() if isinstance(m, DecodeQuantizedLinear)]
    # 4 projections per layer and the head.
    assert len(linears) == 4 * quantized_model.arch_config.num_layers + 1
    engine = make_engine(quantized_model)
    assert engine.quantization == quantized_model.quantization
    assert engine.decode_weight_bytes > 0
    with pytest.raises(ValueError, match="does not match the loaded model"):
        make_engine(quantized_model, quantization="none")


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_batch_and_chunked_prefill_equal_reference(quantized_model, prompts, reference,
                                                   enable_prefix_caching):
    engine = make_engine(quantized_model, enable_prefix_caching=enable_prefix_caching,
                         max_num_batched_tokens=16)  # chunks of 16: some dense, some not
    outputs = run_batch(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert_all_blocks_free(engine)


def test_cached_repeat_equals_reference(quantized_model, prompts, reference):
    engine = make_engine(quantized_model)
    run_batch(engine, prompts, GREEDY)
    outputs = run_batch(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_under_preemption_equals_reference(quantized_model, prompts, reference):
    engine = make_engine(quantized_model, num_kv_blocks=24, max_num_batched_tokens=16)
    outputs = run_batch(engine, prompts, GREEDY)
    assert engine.get_stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference
    assert_all_blocks_free(engine)


def test_cascade_attention_equals_reference(quantized_model, prompts, reference, monkeypatch):
    from prefixcache.worker import model_runner

    sharing = [i for i, prompt in enumerate(prompts) if prompt[:22] == prompts[0][:22]]
    engine = make_engine(quantized_model)
    engine.runner.min_shared_prefix_tokens = BLOCK_SIZE
    cascade_steps = []
    build = model_runner.ModelRunner.build_step_inputs

    def spy(runner, sequences):
        inputs = build(runner, sequences)
        if inputs.metadata.decode_shared_prefixes:
            cascade_steps.append(inputs.metadata.num_tokens)
        return inputs

    monkeypatch.setattr(model_runner.ModelRunner, "build_step_inputs", spy)
    outputs = run_batch(engine, [prompts[i] for i in sharing], GREEDY)
    assert [o.token_ids for o in outputs] == [reference[i] for i in sharing]
    # Cascade steps of few tokens, i.e. on the quantized weights, did happen.
    assert any(num_tokens <= 8 for num_tokens in cascade_steps)
    assert_all_blocks_free(engine)
