"""Load a GGUF file (llama.cpp's format) with the `gguf` package.

Quantized tensors are dequantized to float32 with `gguf.quants.dequantize`, renamed to
Hugging Face names and loaded like a Hugging Face checkpoint. llama.cpp's converter permutes
the rows of each head of Llama's Q and K projections (its RoPE rotates adjacent pairs; the
Hugging Face layout rotates the two halves of a head); `unpermute_qk_rows` undoes that so one
model implementation serves both formats. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from prefixcache.model.config import ModelArchConfig
from prefixcache.model.gguf_file import (
    dequantize_tensor,
    is_q4_block_tensor,
    open_gguf,
    read_gguf_metadata,
    read_q4_blocks,
)
from prefixcache.model.llama import LlamaForCausalLM, load_hf_state_dict

# GGUF tensor name -> Hugging Face name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3 files store their RoPE scaling as per-frequency divisors in this tensor.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head row permutation of a Q or K weight (or bias).

    Within each head, llama.cpp stores row 2j from the head's first half and row 2j+1 from
    its second half (interleaved pairs); Hugging Face stores the halves one after the other.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # [heads * half * 2, ...] -> [heads, half, 2, ...] -> [heads, 2, half, ...] -> back
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(rows, *weight.shape[1:])
    )


def gguf_arch_config(reader: Any, metadata: dict[str, Any] | None = None) -> ModelArchConfig:
    """The `ModelArchConfig` of an open GGUF file."""
    metadata = read_gguf_metadata(reader) if metadata is None else metadata
    tensor_names = frozenset(t.name for t in reader.tensors)
    freq_factors = None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            freq_factors = tuple(float(x) for x in dequantize_tensor(tensor).reshape(-1))
    tokens = metadata.get("tokenizer.ggml.tokens")
    return ModelArchConfig.from_gguf_metadata(
        metadata,
        tensor_names=tensor_names,
        rope_freq_factors=freq_factors,
        vocab_size=len(tokens) if tokens else None,
    )


def iter_gguf_hf_tensors(
    reader: Any, arch_config: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor), dequantized and un-permuted, one at a time.

    Raises ValueError naming any tensor this loader does not know how to place.
    """
    unpermute = arch_config.family == "llama"
    for tensor in reader.tensors:
        name = tensor.name
        if name == ROPE_FREQS_TENSOR:
            continue  # already folded into arch_config.rope_freq_factors
        hf_name = _hf_name(name)
        values = torch.from_numpy(dequantize_tensor(tensor))
        if unpermute and ".self_attn.q_proj." in hf_name:
            values = unpermute_qk_rows(values, arch_config.num_heads)
        elif unpermute and ".self_attn.k_proj." in hf_name:
            values = unpermute_qk_rows(values, arch_config.num_kv_heads)
        yield hf_name, values


def iter_gguf_q4_blocks(
    reader: Any, arch_config: ModelArchConfig
) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Yield (Hugging Face name, (q, scale, zero)) for every Q4_0/Q4_1 weight of the file,
    its 4-bit values as stored (see `read_q4_blocks`), rows un-permuted like
    `iter_gguf_hf_tensors`'s, so that they line up with the dense weights."""
    unpermute = arch_config.family == "llama"
    for tensor in reader.tensors:
        if not is_q4_block_tensor(tensor):
            continue
        hf_name = _hf_name(tensor.name)
        blocks = tuple(torch.from_numpy(array) for array in read_q4_blocks(tensor))
        if unpermute and ".self_attn.q_proj." in hf_name:
            blocks = tuple(unpermute_qk_rows(part, arch_config.num_heads) for part in blocks)
        elif unpermute and ".self_attn.k_proj." in hf_name:
            blocks = tuple(unpermute_qk_rows(part, arch_config.num_kv_heads) for part in blocks)
        yield hf_name, blocks


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not supported by this loader")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def load_gguf_model(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Build and load the model in a GGUF file; eval mode, CPU, parameters in `dtype`."""
    reader = open_gguf(path)
    arch_config = gguf_arch_config(reader)
    model = LlamaForCausalLM.empty(arch_config)
    load_hf_state_dict(model, iter_gguf_hf_tensors(reader, arch_config))
    return model.to(dtype).eval(), arch_config
