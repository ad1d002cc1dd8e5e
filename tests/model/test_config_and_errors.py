"""ModelArchConfig parsing and the loaders' errors for unsupported or incomplete models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from prefixcache.model.config import ModelArchConfig, RopeScaling
from prefixcache.model.loader import load_model
from prefixcache.model.loader_gguf import load_gguf_model, unpermute_qk_rows
from prefixcache.model.loader_hf import load_hf_model

LLAMA_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_classic_llama3_config_json_is_parsed():
    config = ModelArchConfig.from_hf_config(LLAMA_CONFIG)
    assert config.family == "llama"
    assert config.head_dim == 12  # hidden_size / num_attention_heads when not given
    assert config.num_queries_per_kv == 2
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert (config.qkv_bias, config.o_bias, config.qk_norm) == (False, False, False)


@pytest.mark.parametrize("model_type", ["mistral", "gpt2", "mixtral"])
def test_unsupported_architecture_is_named(model_type):
    hf_config = {**LLAMA_CONFIG, "model_type": model_type, "architectures": ["SomethingElse"]}
    with pytest.raises(ValueError, match=f"unsupported model architecture '{model_type}'"):
        ModelArchConfig.from_hf_config(hf_config)


def test_unsupported_rope_scaling_is_named():
    hf_config = {**LLAMA_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelArchConfig.from_hf_config(hf_config)


def test_sliding_window_is_rejected():
    hf_config = {**LLAMA_CONFIG, "model_type": "qwen2", "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding-window"):
        ModelArchConfig.from_hf_config(hf_config)


def test_inconsistent_head_counts_are_rejected():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelArchConfig.from_hf_config({**LLAMA_CONFIG, "num_key_value_heads": 3})


def test_missing_required_field_is_named():
    hf_config = {k: v for k, v in LLAMA_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelArchConfig.from_hf_config(hf_config)


def test_unsupported_gguf_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'"):
        ModelArchConfig.from_gguf_metadata({"general.architecture": "gemma2"})


def test_missing_gguf_metadata_is_named():
    metadata = {"general.architecture": "llama", "llama.embedding_length": 48}
    with pytest.raises(ValueError, match="llama.attention.head_count"):
        ModelArchConfig.from_gguf_metadata(metadata)


def test_unpermute_inverts_llama_cpp_permutation():
    num_heads, head_dim, columns = 3, 8, 5
    weight = torch.arange(num_heads * head_dim * columns, dtype=torch.float32)
    weight = weight.view(num_heads * head_dim, columns)
    # llama.cpp's convert script: within each head, interleave the two halves' rows.
    permuted = (
        weight.view(num_heads, 2, head_dim // 2, columns)
        .transpose(1, 2)
        .reshape(num_heads * head_dim, columns)
    )
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk_rows(permuted, num_heads), weight)
    bias = torch.arange(num_heads * head_dim, dtype=torch.float32)
    permuted_bias = bias.view(num_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(unpermute_qk_rows(permuted_bias, num_heads), bias)


def write_config(folder, **changes):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **changes}))


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_hf_model(tmp_path / "nope")


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf_model(tmp_path)


def test_missing_weights(tmp_path):
    write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no weights found .*model\.safetensors"):
        load_hf_model(tmp_path)


def test_missing_shard(tmp_path):
    write_config(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_hf_model(tmp_path)


def test_unsupported_architecture_in_folder(tmp_path):
    write_config(tmp_path, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="gpt_neox"):
        load_hf_model(tmp_path)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    write_config(tmp_path, num_hidden_layers=1, tie_word_embeddings=True)
    save_file({"model.embed_tokens.weight": torch.zeros(96, 48)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \d+ weight\(s\): .*input_layernorm"):
        load_hf_model(tmp_path)
    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(96, 48),
            "model.layers.0.mlp.up_proj.bias": torch.zeros(80),
        },
        tmp_path / "model.safetensors",
    )
    with pytest.raises(ValueError, match="unexpected weight.*up_proj.bias"):
        load_hf_model(tmp_path)


def test_wrong_weight_shape_is_named(tmp_path):
    write_config(tmp_path, tie_word_embeddings=True)
    save_file({"model.embed_tokens.weight": torch.zeros(95, 48)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(95, 48\)"):
        load_hf_model(tmp_path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf_model(tmp_path / "model.gguf")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(tmp_path / "model.gguf")
