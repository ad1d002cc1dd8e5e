"""Rotary position embeddings (the "rotate half" layout Hugging Face checkpoints use).

Frequencies are computed once in float64 (so Llama 3 scaling's thresholds are exact), the
cos/sin tables once for every position up to `max_positions` in float32, and a forward pass
only indexes them by each token's absolute position - which is what lets a chunk of a prompt
start anywhere in its sequence.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prefixcache.model.config import RopeScaling


def rope_inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling,
    freq_factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Return the [head_dim // 2] float64 inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Wavelengths longer than the original context / low_freq_factor were never seen whole
    # in training: stretch them by `factor`. Shorter than context / high_freq_factor: keep.
    # In between: interpolate linearly in (context / wavelength) between the two.
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = context / scaling.low_freq_factor
    short_wavelength = context / scaling.high_freq_factor
    smooth = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < short_wavelength, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys given each token's absolute position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        freq_factors: tuple[float, ...] | None = None,
    ) -> None:
        super().__init__()
        self._table_args = (head_dim, max_positions, theta, scaling, freq_factors)
        self.register_buffer("cos_table", None, persistent=False)
        self.register_buffer("sin_table", None, persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables on their current device - needed after `to_empty`, which
        leaves buffers uninitialised."""
        head_dim, max_positions, theta, scaling, freq_factors = self._table_args
        device = self.cos_table.device if self.cos_table is not None else None
        if device is not None and device.type == "meta":
            device = None  # meta tensors hold no values; build real ones on CPU
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, freq_factors)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        # [max_positions, head_dim // 2] each; float32 like the reference implementation.
        self.cos_table = angles.cos().float().to(device)
        self.sin_table = angles.sin().float().to(device)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (each < max_positions, checked by the caller);
        query [T, num_heads, head_dim]; key [T, num_kv_heads, head_dim]."""
        cos, sin = self.tables(positions, query.dtype)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of `positions` [T], each [T, 1, head_dim // 2] in `dtype`: computed once
        per step and applied by every layer with `apply_rotary`."""
        # The reference casts cos/sin to the activation dtype and rotates there; do the same
        # so bfloat16 results match it, not a float32 variant.
        cos = self.cos_table[positions].unsqueeze(1).to(dtype)
        sin = self.sin_table[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by `RotaryEmbedding.tables` of its positions."""
    first, second = x.chunk(2, dim=-1)  # each [T, heads, head_dim // 2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
