"""The C++ paged attention kernel against attention computed from gathered keys.

Every case builds a random paged cache and random block tables, runs the kernel, and
compares each query row with softmax(q k^T / sqrt(d)) v over exactly the keys its position
sees, computed in float64 from the same cache values. Tolerances are float32 rounding
(1e-5); a wrong block, offset, head or causal limit moves outputs by ~0.1 or more.
"""

from __future__ import annotations

import logging

import pytest
import torch

from prefixcache.kernels import paged_attention as kernel_module
from prefixcache.kernels.paged_attention import load_paged_attention, paged_attention

pytestmark = pytest.mark.skipif(
    not load_paged_attention(), reason="no C++ toolchain to build the kernel")


def random_case(*, dtype, head_dim, block_size, num_kv_heads, group, lens, query_rows,
                num_blocks=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one padding column
    num_blocks = num_blocks or len(lens) * max_blocks + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    # Distinct random blocks per sequence, so a wrong block id reads someone else's keys.
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = order[: len(lens) * max_blocks].view(len(lens), max_blocks).contiguous()
    query_start = torch.tensor([0, *torch.tensor(query_rows).cumsum(0).tolist()])
    query = torch.randn(int(query_start[-1]), num_kv_heads, group, head_dim,
                        generator=generator)
    return query, key_cache, value_cache, block_tables, query_start, torch.tensor(lens)


def reference(query, key_cache, value_cache, block_tables, query_start, seq_lens):
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        slots = block_tables[s][positions // block_size] * block_size + positions % block_size
        keys = key_cache.view(-1, num_kv_heads, head_dim)[slots].double()  # [L, kv, d]
        values = value_cache.view(-1, num_kv_heads, head_dim)[slots].double()
        first, last = query_start[s].item(), query_start[s + 1].item()
        for i, row in enumerate(range(first, last)):
            visible = seq_len - (last - first) + i + 1
            scores = torch.einsum("hgd,thd->hgt", query[row].double(), keys[:visible])
            weights = (scores * head_dim**-0.5).softmax(-1)
            out[row] = torch.einsum("hgt,thd->hgd", weights, values[:visible])
    return out


def run_kernel(case):
    query, key_cache, value_cache, block_tables, query_start, seq_lens = case
    return paged_attention(query, key_cache, value_cache, block_tables, query_start,
                           seq_lens, key_cache.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decodes_of_different_lengths(dtype, head_dim):
    # Lengths at, below and across block boundaries, one long enough to be split in runs.
    case = random_case(dtype=dtype, head_dim=head_dim, block_size=16, num_kv_heads=3,
                       group=3, lens=[1, 16, 17, 37, 700], query_rows=[1, 1, 1, 1, 1])
    torch.testing.assert_close(run_kernel(case).double(), reference(*case),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_chunks_after_context_are_causal(block_size):
    # Several query rows per sequence: each sees the keys up to its own position.
    case = random_case(dtype=torch.float32, head_dim=64, block_size=block_size,
                       num_kv_heads=2, group=4, lens=[9, 40, 300],
                       query_rows=[3, 8, 5])
    torch.testing.assert_close(run_kernel(case).double(), reference(*case),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_result_does_not_depend_on_the_thread_count(num_threads):
    # More threads split a long sequence into more runs merged by log-sum-exp.
    case = random_case(dtype=torch.bfloat16, head_dim=64, block_size=16, num_kv_heads=1,
                       group=2, lens=[2000, 3], query_rows=[1, 2])
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = run_kernel(case)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), reference(*case), atol=1e-5, rtol=1e-5)


def test_multi_query_and_multi_head_layouts():
    for num_kv_heads, group in [(1, 8), (4, 1), (2, 3)]:
        case = random_case(dtype=torch.float32, head_dim=64, block_size=8,
                           num_kv_heads=num_kv_heads, group=group, lens=[30, 64],
                           query_rows=[1, 4])
        torch.testing.assert_close(run_kernel(case).double(), reference(*case),
                                   atol=1e-5, rtol=1e-5)


def test_inconsistent_inputs_raise_instead_of_reading_out_of_bounds():
    case = list(random_case(dtype=torch.float32, head_dim=64, block_size=4, num_kv_heads=1,
                            group=1, lens=[10], query_rows=[1], num_blocks=8))
    bad_table = case[3].clone()
    bad_table[0, 1] = 8  # block 8 of an 8-block cache
    with pytest.raises(RuntimeError, match="outside the cache"):
        run_kernel([*case[:3], bad_table, *case[4:]])
    with pytest.raises(RuntimeError, match="blocks for all of its keys"):
        run_kernel([*case[:5], torch.tensor([10_000])])
    with pytest.raises(RuntimeError, match="query_start"):
        run_kernel([*case[:4], torch.tensor([0, 2]), case[5]])
    narrow = [c[..., :32].contiguous() if i in (0, 1, 2) else c for i, c in enumerate(case)]
    with pytest.raises(RuntimeError, match="head size"):
        run_kernel(narrow)


def test_a_failed_build_is_logged_and_reported(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    with caplog.at_level(logging.WARNING, logger=kernel_module.__name__):
        assert kernel_module.load_paged_attention.__wrapped__() is False
    assert "could not be built" in caplog.text and "no C++ compiler" in caplog.text
