"""The GGUF loader on tiny files written here from random transformers models.

The test writes each model the way llama.cpp's converter does - Llama Q/K rows permuted per
head, Llama 3 RoPE scaling as a `rope_freqs.weight` tensor, Qwen tensors unpermuted - then
loads it with our loader and compares logits with the original transformers model.
Tolerance atol = rtol = 1e-4 as in test_llama_vs_transformers (float32, order-only
differences of ~1e-7; a wrong permutation or frequency changes logits by >1e-2).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from prefixcache.model.config import RopeScaling
from prefixcache.model.loader_gguf import load_gguf_model
from prefixcache.model.rope import rope_inverse_frequencies
from prefixcache.worker.model_runner import ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence
from tests.model.helpers import all_position_logits, random_token_ids, randomize_vectors

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 96, 48, 80, 4, 2, 2


def tiny_hf_config(config_cls, **extra):
    """A transformers config of ``config_cls`` with this file's tiny shapes."""
    return config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, **extra)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows: interleave each head's halves."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{suffix}"


def write_gguf(path, arch, hf_model, head_dim, rope_freqs=None):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(hf_model.config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(hf_model.config.rms_norm_eps))
    writer.add_vocab_size(VOCAB)
    tied = hf_model.config.tie_word_embeddings
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        values = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = llama_cpp_permute(values, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            values = llama_cpp_permute(values, KV_HEADS)
        writer.add_tensor(gguf_name(name), values)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CASES = {
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        "llama",
        dict(rope_scaling=LLAMA3_ROPE),
    ),
    "qwen2-tied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        "qwen2",
        dict(tie_word_embeddings=True),
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "qwen3", dict(head_dim=16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_file_matches_the_model_it_was_written_from(tmp_path, case):
    config_cls, model_cls, arch, extra = CASES[case]
    torch.manual_seed(0)
    hf_config = tiny_hf_config(config_cls, max_position_embeddings=256, **extra)
    hf_model = model_cls(hf_config).eval()
    randomize_vectors(hf_model)
    head_dim = extra.get("head_dim", HIDDEN // HEADS)
    rope_freqs = None
    if case == "llama3":
        # llama.cpp stores Llama 3 scaling as per-frequency divisors of the base frequencies.
        theta = float(hf_config.rope_parameters["rope_theta"])
        base = rope_inverse_frequencies(head_dim, theta, RopeScaling())
        scaled = rope_inverse_frequencies(head_dim, theta, RopeScaling("llama3", 8.0, 1.0, 4.0, 16))
        rope_freqs = (base / scaled).numpy()
        assert rope_freqs.max() > 1.0  # the scaling really changes frequencies
    write_gguf(tmp_path / "model.gguf", arch, hf_model, head_dim, rope_freqs)

    model, arch_config = load_gguf_model(tmp_path / "model.gguf")
    assert arch_config.family == arch
    assert arch_config.qkv_bias == (arch == "qwen2")
    assert arch_config.qk_norm == (arch == "qwen3")
    assert arch_config.tie_word_embeddings == hf_config.tie_word_embeddings
    assert (arch_config.rope_freq_factors is not None) == (case == "llama3")

    token_ids = random_token_ids(30, seed=5, vocab_size=VOCAB)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0]
    runner = ModelRunner(model, arch_config, num_kv_blocks=10, block_size=4)
    sequence = ScheduledSequence("r", token_ids, 0, [4, 0, 8, 2, 6, 1, 9, 3], True)
    torch.testing.assert_close(
        all_position_logits(runner, sequence), expected, atol=1e-4, rtol=1e-4
    )


def test_unknown_gguf_tensor_is_named(tmp_path):
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(tiny_hf_config(transformers.LlamaConfig))
    writer_path = tmp_path / "model.gguf"
    write_gguf(writer_path, "llama", hf_model, HIDDEN // HEADS)
    # Rewrite with one extra tensor the loader cannot place.
    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    reader = gguf.GGUFReader(str(writer_path))
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        load_gguf_model(tmp_path / "odd.gguf")
