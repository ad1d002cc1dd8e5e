"""prefixcache with LoRA adapters against transformers + peft on the same tiny model:
greedy tokens equal token for token and logits within float tolerance, for the base and
two adapters, alone and mixed in one batch (prefill, chunked prefill and decode)."""

from __future__ import annotations

import copy

import pytest
import torch

from prefixcache import LLM, LoRARequest, SamplingParams
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.worker.scheduled_sequence import ScheduledSequence

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 25, 11, 64, 8],
    [12, 33, 47, 2, 18, 20, 77],
    [9, 9, 31, 14, 56, 71, 13, 10, 44, 39, 28, 15, 61],
    # Long enough that a prefill of it alone takes the per-run path (see lora/slots.py).
    [(7 * i + 3) % 90 + 4 for i in range(40)],
]
NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir, adapter_a_dir, adapter_b_dir):
    """name -> transformers model: the base, and the base with each peft adapter."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    models = {None: base}
    for name, folder in (("adapter-a", adapter_a_dir), ("adapter-b", adapter_b_dir)):
        models[name] = PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
    return models


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_new_tokens: int) -> list[int]:
    token_ids = list(prompt)
    for _ in range(num_new_tokens):
        logits = model(torch.tensor([token_ids])).logits[0, -1]
        token_ids.append(int(logits.argmax()))
    return token_ids[len(prompt):]


@pytest.fixture(scope="module")
def expected(hf_models):
    """(lora name, prompt index) -> transformers' greedy tokens."""
    return {(name, index): hf_greedy(model, prompt, NUM_NEW_TOKENS)
            for name, model in hf_models.items() for index, prompt in enumerate(PROMPTS)}


def test_adapters_change_the_greedy_tokens(expected):
    # Otherwise the equality tests below could pass with the deltas ignored.
    for index in range(len(PROMPTS)):
        assert expected[("adapter-a", index)] != expected[(None, index)]
        assert expected[("adapter-b", index)] != expected[(None, index)]


@pytest.mark.parametrize("name", [None, "adapter-a", "adapter-b"])
def test_each_alone_equals_peft(tiny_model_dir, lora_a, lora_b, expected, name):
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, num_kv_blocks=64,
              block_size=4)
    lora = {None: None, "adapter-a": lora_a, "adapter-b": lora_b}[name]
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS),
                           lora_request=lora)
    for index, output in enumerate(outputs):
        assert output.outputs[0].token_ids == expected[(name, index)]


@pytest.mark.parametrize("chunk", [None, 3])
def test_mixed_batch_equals_peft(tiny_model_dir, lora_a, lora_b, expected, chunk):
    """Every prompt under the base and both adapters, nine requests in one batch: each
    step mixes the three, and with a 3-token budget prompts are prefilled in chunks."""
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, num_kv_blocks=64,
              block_size=4, **options)
    names = [None, "adapter-a", "adapter-b"]
    by_name = {None: None, "adapter-a": lora_a, "adapter-b": lora_b}
    prompts, loras, keys = [], [], []
    for index, prompt in enumerate(PROMPTS):
        for name in names:
            prompts.append(prompt)
            loras.append(by_name[name])
            keys.append((name, index))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS),
                           lora_request=loras)
    for key, output in zip(keys, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[key], key


@torch.inference_mode()
def test_logits_within_tolerance_in_one_mixed_step(tiny_model_dir, lora_a, lora_b,
                                                   hf_models):
    """One step prefilling four sequences (base, A, B, A): each sequence's last-position
    logits equal transformers+peft's within float32 tolerance."""
    engine = LLMEngine.from_options(str(tiny_model_dir), enable_lora=True, max_loras=2,
                                    num_kv_blocks=64, block_size=4)
    adapters = [None, engine.lora_registry.acquire(lora_a),
                engine.lora_registry.acquire(lora_b), engine.lora_registry.acquire(lora_a)]
    sequences, block = [], 0
    for prompt, adapter in zip(PROMPTS, adapters, strict=True):
        num_blocks = -(-len(prompt) // 4)
        sequences.append(ScheduledSequence(
            f"r{block}", prompt, 0, list(range(block, block + num_blocks)), True, adapter))
        block += num_blocks
    logits = engine.runner.execute(sequences)
    names = [None, "adapter-a", "adapter-b", "adapter-a"]
    for row, (prompt, name) in enumerate(zip(PROMPTS, names, strict=True)):
        reference = hf_models[name](torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-3)


def test_lora_request_is_exported():
    request = LoRARequest("x", 3, "/some/folder")
    assert (request.lora_name, request.lora_int_id, request.lora_path) == \
        ("x", 3, "/some/folder")
    assert request.adapter_id == 3


def test_cascade_decode_with_adapters_equals_peft(tiny_model_dir, lora_a, lora_b, hf_models):
    """Requests of one adapter sharing a prompt start decode with cascade attention over
    their shared blocks (the base's and B's same-text requests share no blocks with A's:
    the adapter is in the block hashes); tokens still equal transformers+peft's."""
    shared = [5, 17, 42, 99, 7, 3, 25, 11, 64, 8, 12, 33]  # 3 blocks of 4
    suffixes = [[47, 2], [18, 20, 77], [9, 31]]
    engine = LLMEngine.from_options(str(tiny_model_dir), enable_lora=True, max_loras=2,
                                    num_kv_blocks=128, block_size=4)
    engine.runner.min_shared_prefix_tokens = 4
    num_groups = []
    build = engine.runner.build_step_inputs

    def recording_build(sequences):
        inputs = build(sequences)
        num_groups.append(len(inputs.metadata.decode_shared_prefixes))
        return inputs

    engine.runner.build_step_inputs = recording_build
    by_name = {None: None, "adapter-a": lora_a, "adapter-b": lora_b}
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS)
    # The first of each adapter caches the shared blocks; the rest then hit them.
    for name, lora in by_name.items():
        engine.add_request(f"{name}-warm", shared + [1], params, lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    keys = []
    for name, lora in by_name.items():
        for index, suffix in enumerate(suffixes):
            engine.add_request(f"{name}-{index}", shared + suffix, params, lora_request=lora)
            keys.append((f"{name}-{index}", name, shared + suffix))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert max(num_groups) == 3  # one group per adapter (and the base) in one step
    for request_id, name, prompt in keys:
        assert finals[request_id].num_cached_tokens == 12
        assert finals[request_id].token_ids == \
            hf_greedy(hf_models[name], prompt, NUM_NEW_TOKENS), request_id
