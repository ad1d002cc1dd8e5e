"""Weight-only quantized decode: the 4-bit blocks read from GGUF files, the two weight formats,
the per-step choice between dense and quantized weights, and `quantization` resolution.

The tiny GGUF files here are written with the `gguf` package's own Q4_0/Q4_1 quantizers, as
llama.cpp's converter writes Llama files (Q/K rows permuted per head).
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from prefixcache.model.gguf_file import open_gguf, read_q4_blocks
from prefixcache.model.loader_gguf import gguf_arch_config, iter_gguf_q4_blocks, load_gguf_model
from prefixcache.model.quantization import (
    decode_weight_bytes,
    quantize_for_decode,
    resolve_quantization,
)
from prefixcache.model.quantized_linear import (
    DecodeQuantizedLinear,
    Int4GroupWeight,
    Int8ChannelWeight,
    RescoredDecodeHead,
)
from tests.model.test_gguf_loader import gguf_name, llama_cpp_permute

Q4_TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}
# A tiny Llama whose projections fit the int4 kernel (inputs a multiple of 32).
VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 96, 64, 96, 4, 2, 2


def _write_raw_tensor(path, values: np.ndarray, qtype) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = quantize(values, qtype)
    writer.add_tensor("w", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", list(Q4_TYPES))
def test_q4_blocks_are_the_files_own_values(tmp_path, kind):
    qtype = Q4_TYPES[kind]
    values = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    _write_raw_tensor(tmp_path / "w.gguf", values, qtype)
    tensor = open_gguf(tmp_path / "w.gguf").tensors[0]

    q, scale, zero = read_q4_blocks(tensor)
    assert q.shape == (48, 96) and scale.shape == zero.shape == (48, 3)
    assert q.min() >= 0 and q.max() <= 15
    rebuilt = (q.astype(np.float32) - 8).reshape(48, 3, 32) * scale[..., None] + zero[..., None]
    expected = dequantize(quantize(values, qtype), qtype)
    # Exactly gguf's own dequantization, up to float32 rounding of d * q + m.
    np.testing.assert_allclose(rebuilt.reshape(48, 96), expected, rtol=0, atol=1e-6)


def test_read_q4_blocks_refuses_other_types(tmp_path):
    values = np.zeros((16, 32), dtype=np.float32)
    _write_raw_tensor(tmp_path / "w.gguf", values, gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="Q8_0, not Q4_0/Q4_1"):
        read_q4_blocks(open_gguf(tmp_path / "w.gguf").tensors[0])


@pytest.mark.parametrize("out_features", [32, 40])  # 40: padded to the packing's 16 rows
def test_int4_weight_computes_its_groups(out_features):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, 64, generator=generator)
    # PyTorch's kernel (tests/kernels/test_quantized_gemv.py checks the C++ one).
    quantized = Int4GroupWeight.from_float(weight, use_kernel=False)
    # The same rounding by hand: groups of 32, min -> 0, max -> 15.
    groups = weight.view(out_features, 2, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    q = torch.round((groups - low) / step)
    scale = step.to(torch.bfloat16).float()
    zero = (low + 8 * step).to(torch.bfloat16).float()
    expected_weight = ((q - 8) * scale + zero).view(out_features, 64)
    x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)

    out = quantized.matmul(x)
    assert out.shape == (3, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ expected_weight.T, atol=0.05, rtol=0.01)
    # Rounding error of 4 bits: far from the dense weight's result, yet correlated with it.
    assert (expected_weight - weight).abs().max() <= step.max() / 2 + 1e-3


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        Int4GroupWeight.from_float(torch.randn(16, 48))


def test_int8_weight_rounds_each_row_to_its_own_scale():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 48, generator=generator) * torch.arange(1, 25)[:, None]
    quantized = Int8ChannelWeight.from_float(weight, use_kernel=False)  # PyTorch's kernel
    dequantized = quantized.dequantize()
    row_max = weight.abs().amax(dim=1, keepdim=True)
    assert ((dequantized - weight).abs() <= row_max / 254 * 1.01).all()
    x = torch.randn(2, 48, generator=generator).to(torch.bfloat16)
    torch.testing.assert_close(
        quantized.matmul(x).float(), x.float() @ dequantized.T, atol=0.5, rtol=0.01
    )


def test_int8_needs_whole_input_vectors():
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8ChannelWeight.from_float(torch.randn(16, 40))


def test_decode_linear_picks_weights_by_token_count():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 64, generator=generator)
    bias = torch.randn(32, generator=generator)
    linear = DecodeQuantizedLinear(weight, bias, Int8ChannelWeight.from_float(weight), 4)
    few = torch.randn(4, 64, generator=generator)
    many = torch.randn(5, 64, generator=generator)
    # More rows than the limit: exactly the dense layer.
    assert torch.equal(linear(many), F.linear(many, weight, bias))
    # Up to the limit: the quantized weight, bias added in the input's dtype.
    quantized = linear.quantized
    expected = quantized.matmul(few) + bias
    assert torch.equal(linear(few), expected)
    assert linear(few).dtype == torch.float32
    assert not torch.equal(linear(few), F.linear(few, weight, bias))


def test_rescored_head_recomputes_the_leading_logits_from_the_dense_weight():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(512, 64, generator=generator)
    x = torch.randn(3, 64, generator=generator)
    quantized = Int8ChannelWeight.from_float(weight)
    head = RescoredDecodeHead(weight, quantized, max_quantized_tokens=4, num_rescored=8)
    logits = head(x)
    dense = F.linear(x, weight)
    plain = quantized.matmul(x)
    leading = plain.topk(8, dim=1).indices
    # The leading logits are the dense head's; greedy picks the dense head's token.
    torch.testing.assert_close(logits.gather(1, leading), dense.gather(1, leading))
    assert torch.equal(logits.argmax(1), dense.argmax(1))
    assert (logits.gather(1, leading) != plain.gather(1, leading)).all()  # recomputed
    # The others keep the quantized head's values.
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, leading, False)
    assert torch.equal(logits[rest], plain[rest])
    # Steps above the limit are exactly the dense head.
    many = torch.randn(5, 64, generator=generator)
    assert torch.equal(head(many), F.linear(many, weight))
    with pytest.raises(ValueError, match="num_rescored"):
        RescoredDecodeHead(weight, quantized, 4, 0)


@pytest.mark.parametrize(
    ("requested", "q4", "quantized_file", "expected"),
    [
        ("auto", True, True, "int4"),
        ("auto", False, True, "int8"),
        ("auto", False, False, "none"),
        ("none", True, True, "none"),
        ("int8", True, True, "int8"),
        ("int4", False, False, "int4"),
    ],
)
def test_resolve_quantization(requested, q4, quantized_file, expected):
    resolved = resolve_quantization(requested, has_q4_blocks=q4, is_quantized_file=quantized_file)
    assert resolved == expected


@pytest.mark.parametrize("bad", ["fp8", "", None, "INT4"])
def test_unknown_quantization_is_refused(bad):
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        resolve_quantization(bad, has_q4_blocks=True, is_quantized_file=True)


def write_q4_llama_gguf(path, seed: int = 0, qtype=gguf.GGMLQuantizationType.Q4_1) -> None:
    """A tiny random Llama GGUF: projections in `qtype`, embedding/head in Q8_0 (as
    llama.cpp's Q4_1 files keep them), norms F32; Q/K rows permuted like llama.cpp's."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "lm_head.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        shapes.update({
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            prefix + "mlp.gate_proj.weight": (FFN, HIDDEN),
            prefix + "mlp.up_proj.weight": (FFN, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, FFN),
        })
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(gguf_name(name), (1 + 0.2 * rng.standard_normal(shape)).astype(
                np.float32))
            continue
        values = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if name == "lm_head.weight":
            values *= 20  # logits spread over units: no near-ties for greedy argmax
        if ".q_proj." in name:
            values = llama_cpp_permute(values, HEADS)
        elif ".k_proj." in name:
            values = llama_cpp_permute(values, KV_HEADS)
        kind = gguf.GGMLQuantizationType.Q8_0 if "layers" not in name else qtype
        raw = quantize(values, kind)
        writer.add_tensor(gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def int4_model_from_gguf(path):
    """(dense model, the same with int4 decode copies from the file's blocks, arch config)."""
    dense, arch_config = load_gguf_model(path)
    quantized = copy.deepcopy(dense)
    blocks = dict(iter_gguf_q4_blocks(open_gguf(path), arch_config))
    quantize_for_decode(quantized, "int4", blocks, max_quantized_tokens=8)
    return dense, quantized, arch_config


@pytest.mark.parametrize("kind", list(Q4_TYPES))
def test_int4_projections_are_the_files_blocks_fused_and_unpermuted(tmp_path, kind):
    write_q4_llama_gguf(tmp_path / "m.gguf", qtype=Q4_TYPES[kind])
    dense, quantized, arch_config = int4_model_from_gguf(tmp_path / "m.gguf")
    assert gguf_arch_config(open_gguf(tmp_path / "m.gguf")).num_layers == LAYERS
    x = torch.randn(3, max(HIDDEN, FFN), generator=torch.Generator().manual_seed(3))
    for layer_dense, layer_quantized in zip(dense.model.layers, quantized.model.layers,
                                            strict=True):
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            reference = layer_dense.get_submodule(path)
            module = layer_quantized.get_submodule(path)
            assert isinstance(module.quantized, Int4GroupWeight)
            inputs = x[:, : reference.in_features]
            expected = F.linear(inputs, reference.weight)  # the dequantized file, float32
            # Only bfloat16 rounding (activations, scales, zero points) apart; a row in the
            # wrong place (fusion order, un-permutation) would be off by O(1).
            torch.testing.assert_close(module(inputs), expected, atol=0.03, rtol=0.02)
    # Q8_0 head: int8 per row, rounded from the dequantized file.
    assert isinstance(quantized.decode_lm_head.quantized, Int8ChannelWeight)
    assert decode_weight_bytes(quantized) > 0 and decode_weight_bytes(dense) == 0


def test_none_changes_nothing(tmp_path):
    write_q4_llama_gguf(tmp_path / "m.gguf")
    dense, arch_config = load_gguf_model(tmp_path / "m.gguf")
    before = {name: param.clone() for name, param in dense.named_parameters()}
    quantize_for_decode(dense, "none")
    assert dense.decode_lm_head is None
    assert all(isinstance(module, torch.nn.Linear) or not isinstance(
        module, DecodeQuantizedLinear) for module in dense.modules())
    assert all(torch.equal(param, before[name]) for name, param in dense.named_parameters())
