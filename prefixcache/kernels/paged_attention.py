"""A C++ kernel for attention of few query tokens over the paged KV cache (optional).

PyTorch's attention needs each sequence's keys and values as one tensor, so the plain path
first gathers them out of the paged cache: at a long context that copy costs about as much
as the attention that reads it. `paged_attention` reads them in place instead (the kernel
is `paged_attention.cpp`, next to this file), for decodes and for short chunks after
context.

The kernel is compiled on first use with the machine's C++ compiler (through
`torch.utils.cpp_extension`, cached on disk by PyTorch, so later starts only load it).
`load_paged_attention()` returns False when it cannot be built (no compiler, no ninja, a
build error); the failure is logged once and callers keep the plain path.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

from prefixcache.kernels.cpp_build import build_kernel_library

logger = logging.getLogger(__name__)

#: Head sizes the kernel is built for.
KERNEL_HEAD_DIMS = (64, 128)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_EXTENSION_NAME = "prefixcache_paged_attention"


@functools.cache
def load_paged_attention() -> bool:
    """Build (or load the cached build of) the kernel; True when `paged_attention` works."""
    try:
        start = time.perf_counter()
        build_kernel_library(_EXTENSION_NAME, _SOURCE)
        torch.library.register_fake("prefixcache::paged_attention")(_fake_paged_attention)
        logger.debug("paged attention kernel ready in %.1f s", time.perf_counter() - start)
        return True
    except Exception as exc:  # noqa: BLE001 - any build failure means the plain path
        logger.warning("the paged attention kernel could not be built, attention gathers "
                       "keys instead: %s: %s", type(exc).__name__, exc)
        return False


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed query rows over their sequences' paged keys.

    - query [rows, kv_heads, group, head_dim] float32: sequence s owns rows
      `query_start[s]:query_start[s + 1]`, its last tokens, in order.
    - key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim], any float dtype,
      head_dim in `KERNEL_HEAD_DIMS`.
    - block_tables [sequences, max_blocks] int64: each sequence's blocks, in position order.
    - seq_lens [sequences] int64: each sequence's keys, this step's included.

    Row i of an n-row sequence of length L sits at position L - n + i and attends to keys
    0..L - n + i. Returns [rows, kv_heads, group, head_dim] float32. Requires
    `load_paged_attention()` to have returned True; raises RuntimeError on inconsistent
    inputs (a block id outside the cache, too few blocks for a length).
    """
    return torch.ops.prefixcache.paged_attention(query, key_cache, value_cache, block_tables,
                                                 query_start, seq_lens, scale)


def _fake_paged_attention(query, key_cache, value_cache, block_tables, query_start, seq_lens,
                          scale):
    """The output's shape and dtype, for tracing (torch.compile)."""
    return torch.empty_like(query)
