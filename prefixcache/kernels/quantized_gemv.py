"""C++ kernels for weight-only quantized matmuls of a few rows (decode steps), optional.

A decode step multiplies one activation row per sequence by every weight of the model.
PyTorch's weight-only CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
unpack the weights to floats; these kernels (`quantized_gemv.cpp`, next to this file)
instead round the activations to integers and multiply in integers with AVX-512 VNNI, as
llama.cpp computes its quantized formats, reading each weight byte once for all rows.

What they compute: each activation row is rounded per block of 32 inputs to
`x_hat = scale * round(x / scale)` with `scale = max|x| / ACTIVATION_MAX` (15-bit
integers, round half to even; a block of zeros stays zero), and the result is
`x_hat @ w.T` for the dequantized weight `w`, accumulated in float32 and returned in x's
dtype (float32 or bfloat16):

- `int4_gemv`: `w = d * q + m` per group of 32 inputs, `q` in 0..15, `d` and `m` rounded
  to float16 (GGUF Q4_1; Q4_0 is `m = -8 d`).
- `int8_gemv`: `w = q * s`, `q` int8 (-128..127) with one float32 scale `s` per output row.

Weights are repacked once by `pack_int4` / `pack_int8` into the kernels' own layouts.
`load_quantized_gemv()` builds the kernels on first use (cached on disk by PyTorch) and
returns False when they cannot be used: no compiler, a build error, a CPU without AVX-512
VNNI, or `PREFIXCACHE_QUANTIZED_GEMV=0` in the environment; the reason is logged once and
callers keep PyTorch's kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from prefixcache.kernels.cpp_build import build_kernel_library

logger = logging.getLogger(__name__)

#: Inputs per block: int4 groups and activation rounding blocks.
BLOCK_SIZE = 32
#: The largest activation integer (see the module docstring).
ACTIVATION_MAX = 16256
#: Output rows per tile of the packed layouts.
TILE_ROWS = 16
#: Set to 0 to keep PyTorch's weight-only kernels.
DISABLE_ENV = "PREFIXCACHE_QUANTIZED_GEMV"

_SOURCE = Path(__file__).with_name("quantized_gemv.cpp")
_EXTENSION_NAME = "prefixcache_quantized_gemv"


@functools.cache
def load_quantized_gemv() -> bool:
    """Build (or load the cached build of) the kernels; True when they can be used."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        logger.info("%s=0: decode matmuls use PyTorch's weight-only kernels", DISABLE_ENV)
        return False
    try:
        start = time.perf_counter()
        build_kernel_library(_EXTENSION_NAME, _SOURCE)
        torch.library.register_fake("prefixcache::int4_gemv")(_fake_int4_gemv)
        torch.library.register_fake("prefixcache::int8_gemv")(_fake_int8_gemv)
        supported = torch.ops.prefixcache.quantized_gemv_supported()
    except Exception as exc:  # noqa: BLE001 - any build failure means PyTorch's kernels
        logger.warning("the quantized matmul kernels could not be built, decode uses "
                       "PyTorch's weight-only kernels: %s: %s", type(exc).__name__, exc)
        return False
    if not supported:
        logger.info("this CPU lacks AVX-512 VNNI: decode uses PyTorch's weight-only kernels")
        return False
    logger.debug("quantized matmul kernels ready in %.1f s", time.perf_counter() - start)
    return True


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The layout of `int4_gemv` for `w = d * q + m`: q [N, K] integers in 0..15, d and m
    [N, K / 32] floats (rounded to float16). Returns uint8 [ceil(N / 16), K / 32, 320]."""
    out_features, in_features = q.shape
    if in_features % BLOCK_SIZE != 0 or in_features == 0:
        raise ValueError(f"int4 weights need in_features ({in_features}) to be a positive "
                         f"multiple of {BLOCK_SIZE}")
    num_blocks = in_features // BLOCK_SIZE
    if d.shape != (out_features, num_blocks) or m.shape != d.shape:
        raise ValueError(f"d and m must be [{out_features}, {num_blocks}], got "
                         f"{tuple(d.shape)} and {tuple(m.shape)}")
    num_padding_rows = -out_features % TILE_ROWS
    q = F.pad(q.to(torch.uint8), (0, 0, 0, num_padding_rows))
    num_tiles = q.shape[0] // TILE_ROWS
    # [tiles, lane, block, chunk, half, byte]: input 32 * block + 8 * chunk + 4 * half + byte.
    q = q.view(num_tiles, TILE_ROWS, num_blocks, 4, 2, 4)
    nibbles = q[..., 0, :] | (q[..., 1, :] << 4)  # [tiles, lane, block, chunk, byte]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, 256)

    def per_lane_float16(values: torch.Tensor) -> torch.Tensor:
        values = F.pad(values.to(torch.float16), (0, 0, 0, num_padding_rows))
        values = values.view(num_tiles, TILE_ROWS, num_blocks).transpose(1, 2).contiguous()
        return values.view(torch.uint8)  # [tiles, blocks, 32]

    return torch.cat((nibbles, per_lane_float16(d), per_lane_float16(m)), dim=2).contiguous()


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of `int8_gemv` for `w = q * scales[:, None]`: q [N, K] int8, scales [N].
    Returns (uint8 [ceil(N / 16), ceil(K / 32), 512], float32 [16 * tiles] scales)."""
    if q.dtype != torch.int8 or q.dim() != 2 or q.numel() == 0:
        raise ValueError(f"q must be a non-empty 2-d int8 tensor, got {q.dtype} "
                         f"{tuple(q.shape)}")
    out_features, in_features = q.shape
    if scales.shape != (out_features,):
        raise ValueError(f"scales must be [{out_features}], got {tuple(scales.shape)}")
    num_padding_rows = -out_features % TILE_ROWS
    # Padding inputs hold q = 0: they add nothing whatever the activations.
    q = F.pad(q, (0, -in_features % BLOCK_SIZE, 0, num_padding_rows))
    num_tiles, num_blocks = q.shape[0] // TILE_ROWS, q.shape[1] // BLOCK_SIZE
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)  # the kernel's unsigned operand
    # [tiles, lane, block, chunk, byte]: input 32 * block + 4 * chunk + byte.
    shifted = shifted.view(num_tiles, TILE_ROWS, num_blocks, 8, 4)
    packed = shifted.permute(0, 2, 3, 1, 4).reshape(num_tiles, num_blocks, 512).contiguous()
    row_scales = F.pad(scales.float(), (0, num_padding_rows)).contiguous()
    return packed, row_scales


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 -> [M, out_features] in x's dtype (see the module
    docstring); `packed` from `pack_int4`. Raises RuntimeError for inconsistent shapes or
    dtypes. Requires `load_quantized_gemv()` to have returned True."""
    return torch.ops.prefixcache.int4_gemv(x, packed, out_features)


def int8_gemv(
    x: torch.Tensor, packed: torch.Tensor, row_scales: torch.Tensor, out_features: int
) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 -> [M, out_features] in x's dtype (see the module
    docstring); `packed` and `row_scales` from `pack_int8`. Raises RuntimeError for
    inconsistent shapes or dtypes. Requires `load_quantized_gemv()` to have returned True."""
    return torch.ops.prefixcache.int8_gemv(x, packed, row_scales, out_features)


def _fake_int4_gemv(x, packed, out_features):
    """The output's shape and dtype, for tracing (torch.compile)."""
    return x.new_empty(x.shape[0], out_features)


def _fake_int8_gemv(x, packed, row_scales, out_features):
    """The output's shape and dtype, for tracing (torch.compile)."""
    return x.new_empty(x.shape[0], out_features)


def unpack_int8(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 [out_features, in_features] values `pack_int8` packed."""
    num_tiles, num_blocks, _ = packed.shape
    lanes = packed.view(num_tiles, num_blocks, 8, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)
    shifted = lanes.reshape(num_tiles * TILE_ROWS, num_blocks * BLOCK_SIZE)
    return (shifted[:out_features, :in_features].to(torch.int16) - 128).to(torch.int8)
