"""The prepared trace's storage: chains as slots into each distinct hash stored once, the
token ids of a parsed trace as arrays, and Belady's future uses in flat arrays — all
giving exactly what plain lists and dicts would."""

from __future__ import annotations

import random
from array import array
from bisect import bisect_right

import pytest

from prefixcache.core import BlockHasher
from prefixcache.sim.belady import NEVER, FutureUses
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import BlockHashChains, prepare_trace
from prefixcache.sim.sweep import infinite_cache_hit_tokens, working_set_blocks
from prefixcache.sim.trace import Trace, TraceRequest, load_trace
from tests.sim.helpers import random_mooncake_trace, write_lines


def token_id_trace(seed: int, num_requests: int = 40) -> Trace:
    """Prompts sharing prefixes of a few roots, as token ids."""
    rng = random.Random(seed)
    roots = [[rng.randrange(1000) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    requests = []
    for line_no in range(1, num_requests + 1):
        root = rng.choice(roots)
        prompt = root[:rng.randint(1, len(root))] + [rng.randrange(1000)
                                                    for _ in range(rng.randint(0, 20))]
        requests.append(TraceRequest(line_no, len(prompt), rng.randint(0, 9), None,
                                     token_ids=tuple(prompt)))
    return Trace("t", requests)


TRACES = [("mooncake", random_mooncake_trace), ("token ids", token_id_trace)]


@pytest.mark.parametrize("block_size", [512, 64, 16, 4, 2, 1])  # each divides 512
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind, make_trace", TRACES)
def test_chains_are_the_expanders_hashes_each_stored_once(kind, make_trace, seed, block_size):
    trace = make_trace(seed)
    expander = TraceExpander(block_size)
    prepared = prepare_trace(trace, expander)
    chains = prepared.block_hashes
    fresh = TraceExpander(block_size)
    expected = [fresh.block_hashes(request) for request in trace.requests]
    assert len(chains) == len(expected) and list(chains) == expected
    distinct = {block_hash for chain in expected for block_hash in chain}
    assert chains.num_distinct == working_set_blocks(prepared) == len(distinct)
    assert chains.num_references == sum(map(len, expected))
    # One object per distinct hash: the memory a chain costs is its 4-byte slots.
    assert len({id(block_hash) for chain in chains for block_hash in chain}) == len(distinct)
    first_seen: dict = {}  # hash -> the slot it must have: slots count first appearances
    for index, chain in enumerate(expected):
        slots = chains.slots(index)
        assert slots.itemsize == 4 and [chains.hash_at(s) for s in slots] == chain
        assert list(slots) == [first_seen.setdefault(h, len(first_seen)) for h in chain]


def test_runs_and_single_hashes_give_the_same_slots():
    trace = random_mooncake_trace(3, num_requests=80)
    expander = TraceExpander(16)
    by_runs, by_hash, mixed = BlockHashChains(), BlockHashChains(), BlockHashChains()
    for request in trace.requests:
        runs = expander.block_hash_runs(request)
        by_runs.append_runs(*runs)
        by_hash.append(expander.block_hashes(request))
        if request.line_no % 2:
            mixed.append_runs(*runs)
        else:
            mixed.append(expander.block_hashes(request))
    slots = [list(by_hash.slots(i)) for i in range(len(by_hash))]
    assert [list(by_runs.slots(i)) for i in range(len(by_runs))] == slots
    assert [list(mixed.slots(i)) for i in range(len(mixed))] == slots
    assert by_runs.num_distinct == by_hash.num_distinct == mixed.num_distinct


def test_runs_of_different_ids_that_begin_alike_share_their_first_slots():
    # At block size 2 these two ids' pseudo-random blocks start with the same 2 tokens.
    first, second = 79901, 93484
    expander = TraceExpander(2)
    assert expander.token_block(first)[:2] == expander.token_block(second)[:2]
    assert expander.token_block(first)[2:4] != expander.token_block(second)[2:4]
    trace = Trace("t", [TraceRequest(1, 512, 0, 0.0, hash_ids=(first,)),
                        TraceRequest(2, 512, 0, 1.0, hash_ids=(second,))])
    prepared = prepare_trace(trace, expander)
    assert working_set_blocks(prepared) == 2 * 256 - 1
    assert infinite_cache_hit_tokens(prepared) == 2  # the second request hits block 0


def test_chains_index_like_a_list_and_refuse_appends_once_frozen():
    chains = BlockHashChains()
    chains.append([b"a", b"b"])
    chains.append([])
    chains.append([b"a", b"c"])
    assert chains[-1] == [b"a", b"c"] and chains[1] == [] and len(chains) == 3
    assert list(chains.slots(2)) == list(chains.slots(-1)) == [0, 2]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            chains[bad]
        with pytest.raises(IndexError):
            chains.slots(bad)
    with pytest.raises(TypeError):
        chains[0:2]
    chains.freeze()
    assert chains[0] == [b"a", b"b"]
    with pytest.raises(RuntimeError, match="frozen"):
        chains.append([b"d"])
    with pytest.raises(RuntimeError, match="frozen"):
        chains.append_runs([[b"d"]], 1)
    assert chains.num_distinct == 3 and chains.num_references == 4


def test_only_a_hash_id_request_has_runs():
    with pytest.raises(ValueError, match="only a hash-id request"):
        TraceExpander(16).block_hash_runs(TraceRequest(1, 3, 0, None, token_ids=(1, 2, 3)))


@pytest.mark.parametrize("ids, itemsize", [([5, 2**32 - 1], 4), ([5, 2**32], 8),
                                           ([2**63 - 1, 0], 8)])
def test_parsed_token_ids_are_arrays_hashed_like_the_list(tmp_path, ids, itemsize):
    prompt = ids * 4
    path = write_lines(tmp_path / "t.jsonl", [{"prompt_token_ids": prompt}])
    (request,) = load_trace(path).requests
    assert isinstance(request.token_ids, array) and request.token_ids.itemsize == itemsize
    assert list(request.token_ids) == prompt
    expander = TraceExpander(2)
    hasher = BlockHasher(2, hash_seed=expander.hash_seed)
    assert expander.block_hashes(request) == hasher.hash_blocks(None, prompt)
    assert expander.prompt_token_ids(request) == prompt


class PlainFutureUses:
    """The definition of FutureUses' answers, with a list per hash."""

    def __init__(self, sequences, max_hit_blocks):
        self.uses, self.recomputes, self.depths = {}, {}, {}
        for index, (hashes, num_hit_able) in enumerate(zip(sequences, max_hit_blocks, strict=True)):
            for depth, block_hash in enumerate(hashes):
                where = self.uses if depth < num_hit_able else self.recomputes
                where.setdefault(block_hash, []).append(index)
                self.depths.setdefault(block_hash, depth)

    @staticmethod
    def first_after(indices, now):
        later = [i for i in indices if i > now]
        return later[0] if later else NEVER

    def answers(self, block_hash, now):
        uses = self.uses.get(block_hash, [])
        return (self.first_after(uses, now),
                self.first_after(self.recomputes.get(block_hash, []), now),
                bisect_right(uses, now), self.depths.get(block_hash, 0))


@pytest.mark.parametrize("seed", range(6))
def test_future_uses_answer_as_lists_per_hash_would(seed):
    rng = random.Random(seed)
    keys = [bytes([k]) for k in range(12)]
    sequences, max_hit_blocks = [], []
    for _ in range(rng.randint(0, 50)):
        chain = rng.sample(keys, rng.randint(0, 6))
        sequences.append(chain)
        max_hit_blocks.append(rng.randint(0, len(chain)))
    future = FutureUses(iter(sequences), iter(max_hit_blocks))  # read once
    plain = PlainFutureUses(sequences, max_hit_blocks)
    for block_hash in [*keys, b"never seen"]:
        for now in range(-2, len(sequences) + 2):
            assert (future.next_use(block_hash, now), future.next_recompute(block_hash, now),
                    future.num_uses_until(block_hash, now), future.depth(block_hash)
                    ) == plain.answers(block_hash, now)


@pytest.mark.parametrize("kind, make_trace", TRACES)
def test_infinite_cache_hits_what_any_earlier_request_computed(kind, make_trace):
    prepared = prepare_trace(make_trace(4), TraceExpander(4 if kind == "token ids" else 64))
    order = list(range(len(prepared.requests)))
    random.Random(4).shuffle(order)
    for requests in (None, order):
        seen, expected = set(), 0
        for index in range(len(prepared.requests)) if requests is None else requests:
            chain = prepared.block_hashes[index]
            k = 0
            while k < min(prepared.max_hit_blocks[index], len(chain)) and chain[k] in seen:
                k += 1
            expected += k * prepared.block_size
            seen.update(chain)
        assert infinite_cache_hit_tokens(prepared, requests) == expected > 0
