"""Weight-only quantized copies of linear layers, used for steps with few tokens.

A decode step multiplies one row per sequence by every weight of the model: it is bound by
the bytes of weights read, not by arithmetic, so reading 4-bit or 8-bit weights instead of
16- or 32-bit ones makes it faster. A prefill step multiplies hundreds of rows by the same
weights and is bound by arithmetic, where the dense kernels are far faster than the
weight-only ones. `DecodeQuantizedLinear` therefore keeps both: the dense weight of the
`nn.Linear` it replaces, and a quantized copy used when the input has at most
`max_quantized_tokens` rows. Every dense layer of a step sees the step's token count, so the
choice is made per step.

Two formats, each computed by one of two implementations, chosen when the weight is built:
the C++ kernels of `prefixcache.kernels.quantized_gemv` where they load (they round the
activations to 15-bit integers per block of 32 inputs and multiply in integers; see that
module for exactly what they compute), else PyTorch's CPU kernels with bfloat16 activations (the
kernels' float32 paths are generic loops, slower than the dense matmul). Either way
`matmul` takes and returns x's dtype.

- `Int4GroupWeight`: 4-bit values `q` in 0..15 in groups of `group_size` consecutive inputs,
  each group with a scale and a zero point: `w = (q - 8) * scale + zero`
  (`torch.ops.aten._weight_int4pack_mm_for_cpu`). A GGUF Q4_1 block (`w = d * q + m`) is
  exactly this with `scale = d` and `zero = m + 8 * d`; Q4_0 (`w = d * (q - 8)`) has
  `zero = 0`. PyTorch's kernel rounds scales and zeros to bfloat16, its parameter dtype;
  the C++ kernel keeps `d = scale` and `m = zero - 8 * scale` as float16 (GGUF's own).
- `Int8ChannelWeight`: int8 values with one scale per output row, rounded to bfloat16
  (symmetric, `w = q * scale`; `torch.ops.aten._weight_int8pack_mm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.kernels import quantized_gemv

# The activation and parameter dtype of the weight-only kernels (see the module docstring).
KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZE = 32
# `_convert_weight_to_int4pack_for_cpu` packs output rows in tiles of this many.
_INT4_ROW_MULTIPLE = 16
# `_weight_int8pack_mm` needs whole vectors of this many inputs.
_INT8_INPUT_MULTIPLE = 16


class Int4GroupWeight:
    """A [out_features, in_features] weight as packed 4-bit groups (see module docstring).

    Built from `q` [N, K] integers in 0..15, `scale` and `zero` [N, K // group_size] floats.
    `use_kernel` picks the C++ kernel (default: when `load_quantized_gemv()` says it works
    and groups are 32 inputs) over PyTorch's. Output rows are padded to a multiple of 16
    (either packing's tile) with zero weights, and the padding is cut from the result.
    """

    __slots__ = ("group_size", "out_features", "packed", "scales_and_zeros", "uses_kernel")

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        use_kernel: bool | None = None,
    ) -> None:
        out_features, in_features = q.shape
        if in_features % group_size != 0:
            raise ValueError(
                f"int4 weights need in_features ({in_features}) to be a multiple of the "
                f"group size {group_size}"
            )
        num_groups = in_features // group_size
        if scale.shape != (out_features, num_groups) or zero.shape != scale.shape:
            raise ValueError(
                f"scale and zero must be [{out_features}, {num_groups}], got "
                f"{tuple(scale.shape)} and {tuple(zero.shape)}"
            )
        self.group_size = group_size
        self.out_features = out_features
        if use_kernel is None:
            use_kernel = (group_size == quantized_gemv.BLOCK_SIZE
                          and quantized_gemv.load_quantized_gemv())
        self.uses_kernel = use_kernel
        if use_kernel:
            scale = scale.float()
            self.packed = quantized_gemv.pack_int4(q, scale, zero.float() - 8 * scale)
            self.scales_and_zeros = None
            return
        num_padding_rows = -out_features % _INT4_ROW_MULTIPLE
        if num_padding_rows:
            q = F.pad(q, (0, 0, 0, num_padding_rows), value=8)  # (q - 8) * 0 + 0 = 0
            scale = F.pad(scale, (0, 0, 0, num_padding_rows))
            zero = F.pad(zero, (0, 0, 0, num_padding_rows))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # [N, groups, 2] -> [groups, N, 2]: the kernel's layout.
        self.scales_and_zeros = (
            torch.stack((scale, zero), dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] float -> [M, out_features] in x's dtype."""
        if self.uses_kernel:
            return _in_kernel_dtype(x, lambda rows: quantized_gemv.int4_gemv(
                rows, self.packed, self.out_features))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_and_zeros
        )
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        if self.uses_kernel:
            return _nbytes(self.packed)
        return _nbytes(self.packed) + _nbytes(self.scales_and_zeros)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
        use_kernel: bool | None = None,
    ) -> Int4GroupWeight:
        """Round `weight` [N, K] to 4 bits per group of `group_size` inputs, asymmetric
        (each group's minimum and maximum map to 0 and 15, as GGUF's Q4_1 does)."""
        out_features, in_features = weight.shape
        if in_features % group_size != 0:
            raise ValueError(
                f"int4 weights need in_features ({in_features}) to be a multiple of the "
                f"group size {group_size}"
            )
        grouped = weight.float().reshape(out_features, -1, group_size)  # [N, groups, g]
        low = grouped.amin(dim=-1)
        high = grouped.amax(dim=-1)
        step = (high - low) / 15
        safe_step = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.round((grouped - low[..., None]) / safe_step[..., None]).clamp_(0, 15)
        return cls(q.reshape(out_features, in_features), step, low + 8 * step, group_size,
                   use_kernel)


class Int8ChannelWeight:
    """A [out_features, in_features] weight as int8 with one scale per output row.

    `use_kernel` picks the C++ kernel (default: when `load_quantized_gemv()` says it works)
    over PyTorch's; the scales are rounded to bfloat16 either way."""

    __slots__ = ("in_features", "out_features", "packed", "q", "row_scales", "scales",
                 "uses_kernel")

    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, use_kernel: bool | None = None
    ) -> None:
        if q.shape[1] % _INT8_INPUT_MULTIPLE != 0:
            # The kernel reads inputs in vectors of 16 and overruns other sizes (a crash).
            raise ValueError(
                f"int8 weights need in_features ({q.shape[1]}) to be a multiple of "
                f"{_INT8_INPUT_MULTIPLE}"
            )
        self.out_features, self.in_features = q.shape
        self.uses_kernel = (quantized_gemv.load_quantized_gemv() if use_kernel is None
                            else use_kernel)
        q = q.to(torch.int8)
        scales = scales.to(KERNEL_DTYPE)
        if self.uses_kernel:
            self.packed, self.row_scales = quantized_gemv.pack_int8(q, scales.float())
            self.q = self.scales = None
        else:
            self.q, self.scales = q.contiguous(), scales.contiguous()
            self.packed = self.row_scales = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] float -> [M, out_features] in x's dtype."""
        if self.uses_kernel:
            return _in_kernel_dtype(x, lambda rows: quantized_gemv.int8_gemv(
                rows, self.packed, self.row_scales, self.out_features))
        return torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q,
                                                  self.scales).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 [out_features, in_features] weight the kernels compute with."""
        if self.uses_kernel:
            q = quantized_gemv.unpack_int8(self.packed, self.out_features, self.in_features)
            return q.float() * self.row_scales[: self.out_features, None]
        return self.q.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        if self.uses_kernel:
            return _nbytes(self.packed) + _nbytes(self.row_scales)
        return _nbytes(self.q) + _nbytes(self.scales)

    @classmethod
    def from_float(cls, weight: torch.Tensor, use_kernel: bool | None = None
                   ) -> Int8ChannelWeight:
        """Round `weight` [N, K] to int8 per output row, symmetric (row maximum -> 127)."""
        weight = weight.float()
        scales = weight.abs().amax(dim=1) / 127
        # Round the scales first, so the integers are chosen for the scales the kernel uses.
        scales = torch.where(scales > 0, scales, torch.ones_like(scales)).to(KERNEL_DTYPE)
        q = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127)
        return cls(q, scales, use_kernel)


QuantizedWeight = Int4GroupWeight | Int8ChannelWeight


class DecodeQuantizedLinear(nn.Module):
    """`nn.Linear` semantics with a quantized copy of the weight for inputs of few rows.

    `forward(x, num_step_tokens=None)` with x [T, in_features]: when the step's token count
    (`num_step_tokens`, default T) is at most `max_quantized_tokens`, computes
    `quantized.matmul(x)` (see the module docstring), then adds the bias in x's dtype;
    otherwise exactly `F.linear(x, weight, bias)` on the dense weight.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantized: QuantizedWeight,
        max_quantized_tokens: int,
    ) -> None:
        super().__init__()
        if quantized.out_features != weight.shape[0]:
            raise ValueError(
                f"quantized weight has {quantized.out_features} rows, dense {weight.shape[0]}"
            )
        # Plain attributes, not parameters: the dense tensors are shared with the module
        # this replaces (a tied output head's weight is the embedding's).
        self.weight = weight
        self.bias = bias
        self.quantized = quantized
        self.max_quantized_tokens = max_quantized_tokens

    def forward(self, x: torch.Tensor, num_step_tokens: int | None = None) -> torch.Tensor:
        num_tokens = x.shape[0] if num_step_tokens is None else num_step_tokens
        if num_tokens > self.max_quantized_tokens:
            return F.linear(x, self.weight, self.bias)
        out = self.quantized.matmul(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = type(self.quantized).__name__
        return (
            f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
            f"quantized={kind}, max_quantized_tokens={self.max_quantized_tokens}"
        )


class RescoredDecodeHead(DecodeQuantizedLinear):
    """An output head whose quantized logits have their `num_rescored` largest per row
    recomputed with the dense weight.

    Rounding a head's weights moves every logit a little, enough to swap the two leading
    tokens when they are close, which changes greedy text. Recomputing the leading logits
    from the dense rows costs a `num_rescored`-row matmul, so the leading logits (those
    greedy and top-k/top-p sampling read) equal the dense head's up to summation order,
    and the rest keep the quantized head's error. The result is in x's dtype, as
    `DecodeQuantizedLinear`'s.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        quantized: QuantizedWeight,
        max_quantized_tokens: int,
        num_rescored: int,
    ) -> None:
        super().__init__(weight, None, quantized, max_quantized_tokens)
        if not 0 < num_rescored <= weight.shape[0]:
            raise ValueError(
                f"num_rescored must be in 1..{weight.shape[0]}, got {num_rescored!r}"
            )
        self.num_rescored = num_rescored

    def forward(self, x: torch.Tensor, num_step_tokens: int | None = None) -> torch.Tensor:
        num_tokens = x.shape[0] if num_step_tokens is None else num_step_tokens
        if num_tokens > self.max_quantized_tokens:
            return F.linear(x, self.weight)
        logits = self.quantized.matmul(x)  # [T, vocab]
        leading = logits.topk(self.num_rescored, dim=1, sorted=False).indices  # [T, k]
        rows = self.weight.index_select(0, leading.reshape(-1)).view(*leading.shape, -1)
        exact = torch.bmm(rows, x.unsqueeze(-1).to(rows.dtype)).squeeze(-1)  # [T, k]
        return logits.scatter_(1, leading, exact.to(logits.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_rescored={self.num_rescored}"


def _in_kernel_dtype(x: torch.Tensor, kernel) -> torch.Tensor:
    """`kernel(x)` for the C++ kernels, which take float32 and bfloat16 rows; other dtypes
    go through float32 and back."""
    if x.dtype in (torch.float32, torch.bfloat16):
        return kernel(x)
    return kernel(x.float()).to(x.dtype)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
