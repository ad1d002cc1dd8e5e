"""Token expansion of Mooncake hash ids: deterministic, subdividable, hashed like the manager."""

from __future__ import annotations

import pytest

from prefixcache.core import BlockHasher, KVCacheManager, Request
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.trace import TraceRequest


def mooncake(line_no, input_length, hash_ids):
    return TraceRequest(line_no, input_length, 0, 0.0, hash_ids=tuple(hash_ids))


def test_token_blocks_are_deterministic_and_distinct():
    a, b = TraceExpander(512), TraceExpander(16)
    block = a.token_block(7)
    assert len(block) == 512 and all(0 <= t < 65536 for t in block)
    assert block == b.token_block(7) == TraceExpander(512).token_block(7)
    assert block != a.token_block(8)
    assert TraceExpander(512, token_seed=1).token_block(7) != block


def test_prompt_is_the_id_blocks_then_a_unique_tail():
    expander = TraceExpander(512)
    request = mooncake(5, 512 * 2 + 100, [3, 4, 9])
    tokens = expander.prompt_token_ids(request)
    assert len(tokens) == 1124
    assert tokens[:1024] == expander.token_block(3) + expander.token_block(4)
    # The trailing partial block is the request's own, not hash id 9's content.
    assert tokens[1024:] != expander.token_block(9)[:100]
    assert tokens == expander.prompt_token_ids(request)
    other_line = mooncake(6, 1124, [3, 4, 9])
    assert expander.prompt_token_ids(other_line)[:1024] == tokens[:1024]
    assert expander.prompt_token_ids(other_line)[1024:] != tokens[1024:]


def test_smaller_block_sizes_subdivide_the_same_tokens():
    request = mooncake(1, 512 * 2 + 40, [3, 4, 9])
    big, small = TraceExpander(512), TraceExpander(16)
    tokens_small = small.prompt_token_ids(request)
    assert len(tokens_small) == 1064
    # Full 16-token sub-blocks of the partial trace block come from id 9's content ...
    assert tokens_small[:1056] == (big.token_block(3) + big.token_block(4)
                                   + big.token_block(9)[:32])
    # ... and only the last 1064 % 16 = 8 tokens are the request's own.
    assert len(small.block_hashes(request)) == 1064 // 16 == 66
    assert len(big.block_hashes(request)) == 2


@pytest.mark.parametrize("block_size", [1024, 512, 64, 16])
def test_block_hashes_equal_the_managers_own(block_size):
    expander = TraceExpander(block_size)
    requests = [mooncake(1, 512 * 3, [1, 2, 3]), mooncake(2, 512 * 2 + 300, [1, 2, 8]),
                mooncake(3, 700, [5, 6]),
                TraceRequest(4, 40, 0, None, token_ids=tuple(range(40)))]
    manager = KVCacheManager(8, block_size, hash_seed=expander.hash_seed)
    for request in requests:
        live = Request(str(request.line_no), expander.prompt_token_ids(request))
        manager.get_computed_blocks(live)  # attaches the manager's hasher, which hashes
        assert live.block_hashes == expander.block_hashes(request)
    # Shared prefixes give shared hashes: request 2 extends request 1's first two ids.
    shared = 1024 // block_size
    assert len(expander.block_hashes(requests[1])) >= shared
    assert (expander.block_hashes(requests[1])[:shared]
            == expander.block_hashes(requests[0])[:shared])


def test_hash_runs_depend_on_the_parent_not_only_the_id():
    expander = TraceExpander(512)
    first = expander.block_hashes(mooncake(1, 1024, [1, 2]))
    second = expander.block_hashes(mooncake(2, 1024, [3, 2]))
    assert first[1] != second[1]
    hasher = BlockHasher(512, "sha256", expander.hash_seed)
    assert second == hasher.hash_blocks(None, expander.token_block(3) + expander.token_block(2))


def test_block_size_must_divide_512():
    with pytest.raises(ValueError, match="does not divide"):
        TraceExpander(100).block_hashes(mooncake(1, 600, [1, 2]))
