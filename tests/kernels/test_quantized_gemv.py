"""The C++ quantized matmul kernels against the same arithmetic in float64.

The reference rounds the activations exactly as the kernels state they do (per block of 32
inputs, to multiples of max|x| / ACTIVATION_MAX, in float32), dequantizes the weights
(int4: float16 d and m; int8: q times the row scale), and multiplies in float64. What is
left is float32 accumulation (relative 1e-5 of the sum of |terms|); a wrong nibble, lane,
block, row or scale moves results by far more.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from prefixcache.kernels import quantized_gemv
from prefixcache.kernels.quantized_gemv import (
    ACTIVATION_MAX,
    BLOCK_SIZE,
    int4_gemv,
    int8_gemv,
    load_quantized_gemv,
    pack_int4,
    pack_int8,
)
from prefixcache.model.quantized_linear import Int4GroupWeight, Int8ChannelWeight

pytestmark = pytest.mark.skipif(
    not load_quantized_gemv(), reason="no C++ toolchain or no AVX-512 VNNI for the kernels")


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels round it, float64."""
    rows, in_features = x.shape
    padded = F.pad(x.float(), (0, -in_features % BLOCK_SIZE)).view(rows, -1, BLOCK_SIZE)
    scale = padded.abs().amax(dim=-1, keepdim=True) / ACTIVATION_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(padded / safe).clamp(-ACTIVATION_MAX, ACTIVATION_MAX)
    x_hat = values.double() * scale.double()
    return x_hat.view(rows, -1)[:, :in_features]


def int4_case(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = in_features // BLOCK_SIZE
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    d = torch.rand(out_features, num_blocks, generator=generator) * 0.1 + 0.01
    m = -torch.rand(out_features, num_blocks, generator=generator)
    weight = (q.double().view(out_features, num_blocks, BLOCK_SIZE)
              * d.half().double()[..., None] + m.half().double()[..., None])
    return q, d, m, weight.view(out_features, in_features)


def int8_case(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), generator=generator,
                      dtype=torch.int8)
    scales = torch.rand(out_features, generator=generator) + 0.5
    return q, scales, q.double() * scales.double()[:, None]


def check(out, x, weight):
    x_hat = rounded_activations(x)
    expected = x_hat @ weight.T
    magnitude = x_hat.abs() @ weight.abs().T
    assert out.shape == expected.shape and out.dtype == x.dtype
    if x.dtype == torch.bfloat16:
        # The float32 result rounded once to bfloat16.
        torch.testing.assert_close(out, expected.to(torch.bfloat16), atol=1e-3, rtol=1e-2)
    else:
        assert ((out.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all()


def with_threads(num_threads, fn):
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


# (out_features, in_features): whole tiles, a partial last tile, K not a multiple of 64,
# and the default model's shapes.
INT4_SHAPES = [(16, 32), (37, 96), (3, 64), (576, 1536), (960, 576)]


@pytest.mark.parametrize(("out_features", "in_features"), INT4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_its_arithmetic_for_1_to_8_rows(out_features, in_features, dtype):
    q, d, m, weight = int4_case(out_features, in_features)
    packed = pack_int4(q, d, m)
    generator = torch.Generator().manual_seed(1)
    for num_rows in range(1, 9):
        x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
        check(int4_gemv(x, packed, out_features), x, weight)


@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (37, 100), (50, 48),
                                                           (129, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_its_arithmetic_for_1_to_8_rows(out_features, in_features, dtype):
    q, scales, weight = int8_case(out_features, in_features)
    packed, row_scales = pack_int8(q, scales)
    generator = torch.Generator().manual_seed(2)
    for num_rows in range(1, 9):
        x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
        check(int8_gemv(x, packed, row_scales, out_features), x, weight)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_results_do_not_depend_on_the_thread_count(num_threads):
    q, d, m, weight = int4_case(1000, 576)
    packed = pack_int4(q, d, m)
    q8, scales, weight8 = int8_case(2000, 576)
    packed8, row_scales = pack_int8(q8, scales)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(3))
    check(with_threads(num_threads, lambda: int4_gemv(x, packed, 1000)), x, weight)
    check(with_threads(num_threads, lambda: int8_gemv(x, packed8, row_scales, 2000)), x,
          weight8)


def test_more_than_8_rows_and_awkward_activations():
    q, d, m, weight = int4_case(40, 128)
    packed = pack_int4(q, d, m)
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(4))
    x[0, :32] = 0  # a block of zeros
    x[1, 40:70] *= 1e4  # blocks with large values next to small ones
    x[2, 5] = -x[2, :32].abs().max() * 3  # the block maximum negative
    check(int4_gemv(x, packed, 40), x, weight)


def test_weights_on_the_kernel_compute_what_the_kernel_states():
    q, d, m, weight = int4_case(37, 96)
    # Int4GroupWeight takes PyTorch's spelling: w = (q - 8) * scale + zero.
    int4 = Int4GroupWeight(q, d, m + 8 * d, group_size=32, use_kernel=True)
    assert int4.uses_kernel and int4.nbytes == 3 * 3 * 320  # 3 tiles, 3 blocks
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    out = int4.matmul(x)
    assert out.dtype == torch.float32
    # zero - 8 * scale recomputes m up to float32 rounding, below float16's.
    torch.testing.assert_close(out.double(), rounded_activations(x) @ weight.T,
                               atol=1e-4, rtol=1e-4)
    dense = torch.randn(50, 48, generator=torch.Generator().manual_seed(6))
    int8 = Int8ChannelWeight.from_float(dense, use_kernel=True)
    plain = Int8ChannelWeight.from_float(dense, use_kernel=False)
    assert int8.uses_kernel and not plain.uses_kernel
    assert torch.equal(int8.dequantize(), plain.dequantize())  # the same weights
    assert int8.nbytes == 4 * 2 * 512 + 4 * 16 * 4  # 4 tiles, 2 blocks, float32 scales
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    check(int8.matmul(x), x, int8.dequantize().double())


def test_compiled_graphs_call_the_kernel():
    q, d, m, weight = int4_case(40, 64)
    int4 = Int4GroupWeight(q, d, m + 8 * d, group_size=32, use_kernel=True)
    q8, scales, _ = int8_case(24, 32)
    int8 = Int8ChannelWeight(q8, scales, use_kernel=True)

    def step(x):
        return int8.matmul(int4.matmul(x)[:, :32].relu())

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(compiled(x), step(x), atol=0, rtol=0)


def test_bad_inputs_raise_clear_errors():
    q, d, m, _ = int4_case(20, 64)
    packed = pack_int4(q, d, m)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int4_gemv(x.double(), packed, 20)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int4_gemv(x.to(torch.int32), packed, 20)
    with pytest.raises(RuntimeError, match=r"\[rows, in_features\]"):
        int4_gemv(x[0], packed, 20)
    with pytest.raises(RuntimeError, match="at least one row"):
        int4_gemv(x[:0], packed, 20)
    with pytest.raises(RuntimeError, match="inputs"):
        int4_gemv(torch.randn(2, 96), packed, 20)
    with pytest.raises(RuntimeError, match="out_features"):
        int4_gemv(x, packed, 40)
    with pytest.raises(RuntimeError, match="uint8"):
        int4_gemv(x, packed.float(), 20)
    with pytest.raises(RuntimeError, match="uint8"):
        int4_gemv(x, packed[..., :300], 20)
    q8, scales, _ = int8_case(20, 40)
    packed8, row_scales = pack_int8(q8, scales)
    with pytest.raises(RuntimeError, match="inputs"):
        int8_gemv(torch.randn(2, 70), packed8, row_scales, 20)
    with pytest.raises(RuntimeError, match="row_scales"):
        int8_gemv(torch.randn(2, 40), packed8, row_scales[:16], 20)
    with pytest.raises(RuntimeError, match="row_scales"):
        int8_gemv(torch.randn(2, 40), packed8, row_scales.double(), 20)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(q[:, :48], d, m)
    with pytest.raises(ValueError, match="d and m"):
        pack_int4(q, d[:, :1], m)
    with pytest.raises(ValueError, match="int8"):
        pack_int8(q8.float(), scales)
    with pytest.raises(ValueError, match="scales"):
        pack_int8(q8, scales[:3])


def test_disabling_by_environment_keeps_pytorch_kernels(monkeypatch, caplog):
    monkeypatch.setenv(quantized_gemv.DISABLE_ENV, "0")
    with caplog.at_level(logging.INFO, logger=quantized_gemv.__name__):
        assert quantized_gemv.load_quantized_gemv.__wrapped__() is False
    assert quantized_gemv.DISABLE_ENV in caplog.text
    monkeypatch.setattr(quantized_gemv, "load_quantized_gemv", lambda: False)
    assert not Int4GroupWeight.from_float(torch.randn(16, 64)).uses_kernel
    assert not Int8ChannelWeight.from_float(torch.randn(16, 64)).uses_kernel


def test_a_failed_build_is_logged_and_reported(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.delenv(quantized_gemv.DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    with caplog.at_level(logging.WARNING, logger=quantized_gemv.__name__):
        assert quantized_gemv.load_quantized_gemv.__wrapped__() is False
    assert "could not be built" in caplog.text and "no C++ compiler" in caplog.text
