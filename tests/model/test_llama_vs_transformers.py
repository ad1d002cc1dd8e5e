"""Our decoder against Hugging Face transformers on tiny random checkpoints.

Each test builds a random transformers model, saves it with `save_pretrained`, loads the
folder with our HF loader and compares logits at every position in float32.

Tolerance: atol = rtol = 1e-4. Both sides run the same float32 math; they differ only in
operation order (our fused QKV / gate-up matmuls, SDPA kernel choice, RoPE angles computed in
float64), which moves logits by ~1e-7 here. A real defect - a missing bias or norm, a RoPE
rotation off by one position, a wrong GQA head mapping - moves them by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from prefixcache.model.loader_hf import load_hf_model
from prefixcache.worker.model_runner import ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence
from tests.model.helpers import all_position_logits, random_token_ids, randomize_vectors

ATOL = RTOL = 1e-4
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama3-rope-untied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=False),
    ),
    "llama-attention-bias-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True, tie_word_embeddings=True),
    ),
    "qwen2-qkv-bias-tied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    "qwen3-qk-norm-head-dim": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=16, tie_word_embeddings=False),
    ),
}


def save_random_hf_model(tmp_path, config_cls, model_cls, extra, **save_kwargs):
    torch.manual_seed(0)
    hf_model = model_cls(config_cls(**COMMON, **extra)).eval()
    randomize_vectors(hf_model)
    hf_model.save_pretrained(tmp_path, **save_kwargs)
    return hf_model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    config_cls, model_cls, extra = CASES[case]
    hf_model = save_random_hf_model(tmp_path, config_cls, model_cls, extra)
    model, arch_config = load_hf_model(tmp_path)
    token_ids = random_token_ids(40, seed=1, vocab_size=VOCAB)

    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0]  # [40, vocab]
    runner = ModelRunner(model, arch_config, num_kv_blocks=12, block_size=4)
    sequence = ScheduledSequence("r", token_ids, 0, [9, 2, 7, 0, 11, 4, 1, 8, 3, 10], True)
    actual = all_position_logits(runner, sequence)

    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def test_config_features_are_read(tmp_path):
    """The cases above exercise what they claim: scaling, biases, norms, tying."""
    configs = {}
    for case, (config_cls, _, extra) in CASES.items():
        from prefixcache.model.config import ModelArchConfig

        hf_config = config_cls(**COMMON, **extra).to_dict()
        configs[case] = ModelArchConfig.from_hf_config(hf_config)
    assert configs["llama3-rope-untied"].rope_scaling.rope_type == "llama3"
    assert configs["llama3-rope-untied"].rope_theta == 500000.0
    assert configs["llama3-rope-untied"].tie_word_embeddings is False
    assert (
        configs["llama-attention-bias-tied"].qkv_bias,
        configs["llama-attention-bias-tied"].o_bias,
    ) == (True, True)
    assert (configs["qwen2-qkv-bias-tied"].qkv_bias, configs["qwen2-qkv-bias-tied"].o_bias) == (
        True,
        False,
    )
    assert configs["qwen2-qkv-bias-tied"].tie_word_embeddings is True
    assert configs["qwen3-qk-norm-head-dim"].qk_norm is True
    assert configs["qwen3-qk-norm-head-dim"].head_dim == 16


def test_sharded_checkpoint_matches_single_file(tmp_path):
    config_cls, model_cls, extra = CASES["llama3-rope-untied"]
    hf_model = save_random_hf_model(tmp_path, config_cls, model_cls, extra, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, arch_config = load_hf_model(tmp_path)
    token_ids = random_token_ids(12, seed=2, vocab_size=VOCAB)

    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0, -1:]
    runner = ModelRunner(model, arch_config, num_kv_blocks=4, block_size=4)
    actual = runner.execute([ScheduledSequence("r", token_ids, 0, [3, 1, 2], True)])

    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
