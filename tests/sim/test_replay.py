"""Replays through the real manager: agreement with an independent LRU, reference orderings,
modes, admission."""

from __future__ import annotations

import importlib
import random

import pytest

from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.sim.belady import BeladyFreeBlockQueue
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, num_blocks_to_simulate, policy_names, replay
from prefixcache.sim.sweep import (
    SweepResult,
    capacities_from_spec,
    infinite_cache_hit_rate,
    sweep,
    working_set_blocks,
)
from prefixcache.sim.trace import Trace, TraceRequest
from tests.core.reference_document_liveness import OneHeapDocumentLivenessQueue
from tests.sim.helpers import prepared_prefix, random_mooncake_trace, simple_lru_hit_rate
from tests.sim.reference_belady import PerBlockBeladyQueue

ONLINE = list(EVICTION_POLICIES)
# The module, not the function that prefixcache.sim exports under the same name.
replay_module = importlib.import_module("prefixcache.sim.replay")


@pytest.fixture(scope="module")
def prefix_512():
    return prepared_prefix(600, 512)


@pytest.mark.parametrize("num_blocks", [2000, 4000, 8000])
def test_lru_agrees_with_an_independent_simulation(prefix_512, num_blocks):
    result = replay(prefix_512, ReplayConfig(num_blocks, "lru"))
    expected = simple_lru_hit_rate(prefix_512, num_blocks)
    assert expected > 0.02  # the capacity is small enough to evict and big enough to hit
    assert abs(result.hit_rate - expected) <= 0.005


def test_lru_agrees_at_a_small_block_size():
    prepared = prepared_prefix(150, 64)
    for num_blocks in (3000, 12000):
        result = replay(prepared, ReplayConfig(num_blocks, "lru"))
        assert abs(result.hit_rate - simple_lru_hit_rate(prepared, num_blocks)) <= 0.005


def test_sweep_orderings_on_the_shared_trace(prefix_512):
    result = sweep(prefix_512, [1000, 3000, 8000, 16000], ONLINE)
    assert result.ordering_violations == []
    for i in range(len(result.capacities)):
        belady = result.belady_hit_rates[i]
        assert result.infinite_hit_rate >= belady
        for policy in ONLINE:
            assert belady >= result.policy_to_hit_rates[policy][i]
    # Belady is strictly better where the cache is tight, and reaches the ceiling when big.
    assert result.belady_hit_rates[0] > max(r[0] for r in result.policy_to_hit_rates.values())
    assert result.belady_hit_rates[-1] == pytest.approx(result.infinite_hit_rate)
    gap = result.widest_gap()
    assert gap["gap"] > 0 and gap["best_policy"] in ONLINE


def test_a_policy_against_lru_is_judged_at_the_widest_gap_and_everywhere():
    result = SweepResult([10, 20, 30], ["lru", "2q"], infinite_hit_rate=0.5,
                         policy_to_hit_rates={"lru": [0.1, 0.2, 0.3],
                                              "2q": [0.2, 0.19, 0.3]},
                         belady_hit_rates=[0.5, 0.3, 0.3])
    figures = result.versus("2q")
    assert figures["widest_gap_capacity_blocks"] == 10
    assert figures["fraction_of_widest_gap_closed"] == pytest.approx(0.25)
    assert figures["min_minus_baseline_points"] == pytest.approx(-1.0)
    assert result.online_versus_lru() == {"2q": figures}
    # Without Belady's curve there is no gap to close.
    result.belady_hit_rates = []
    assert result.versus("2q") is None and result.online_versus_lru() == {}


def test_the_working_set_counts_distinct_full_blocks():
    trace = Trace("t", [
        TraceRequest(1, 1536, 0, 0.0, hash_ids=(1, 2, 3)),  # three full blocks
        TraceRequest(2, 1300, 0, 1.0, hash_ids=(1, 2, 4)),  # two, and 276 tokens more
        TraceRequest(3, 1024, 0, 2.0, hash_ids=(5, 6)),
    ])
    assert working_set_blocks(prepare_trace(trace, TraceExpander(512))) == 5
    # At block size 256 each full 512-token block is two, and block 4's first half is full.
    assert working_set_blocks(prepare_trace(trace, TraceExpander(256))) == 11


def test_capacities_mix_block_counts_and_shares_of_the_working_set():
    assert capacities_from_spec([0.5, 100, 1.0, 100], 1000) == [100, 500, 1000]
    assert capacities_from_spec([1e-9, 2.0], 1000) == [1, 2000]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", [{"concurrency": 1}, {"concurrency": 3}, {"timeline": True}])
def test_belady_never_below_a_policy_on_random_trees(seed, mode):
    prepared = prepare_trace(random_mooncake_trace(seed), TraceExpander(128))
    smallest = max(prepared.blocks_needed)
    capacities = [smallest, smallest + 8, 2 * smallest, 4 * smallest]
    result = sweep(prepared, capacities, ONLINE, decode_tokens_per_s=20.0
                   if mode.get("timeline") else None, **mode)
    assert result.ordering_violations == []
    assert all(b <= result.infinite_hit_rate + 1e-12 for b in result.belady_hit_rates)


def _token_requests(prompts_and_outputs):
    return Trace("tokens", [
        TraceRequest(i + 1, len(prompt), output_length, float(i), token_ids=tuple(prompt))
        for i, (prompt, output_length) in enumerate(prompts_and_outputs)])


def test_belady_drops_a_copy_that_a_recomputation_replaces():
    """Request 2's prompt ends on block A, so it recomputes A: keeping request 0's copy of A
    until then buys nothing. Belady must evict it (not C) when request 2 allocates, to
    hit A in request 3 and C in request 4 — as unhashed-first happens to."""
    trace = _token_requests([
        ([1, 1, 0, 0, 0, 0, 0, 1, 1], 0),  # A, B, partial
        ([1, 0, 1, 0], 1),  # C (its only block: never hit, always computed)
        ([1, 1, 0, 0], 2),  # A again, recomputed
        ([1, 1, 0, 0, 0], 1),  # hits A
        ([1, 0, 1, 0, 0, 1, 1, 1, 0], 2),  # hits C
    ])
    prepared = prepare_trace(trace, TraceExpander(4))
    belady = replay(prepared, ReplayConfig(3, "belady"))
    assert belady.num_hit_tokens == 8
    unhashed_first = replay(prepared, ReplayConfig(3, "unhashed-first"))
    assert belady.num_hit_tokens >= unhashed_first.num_hit_tokens


def test_belady_drops_a_free_copy_of_content_another_block_holds():
    """With two live requests, request 3 shares request 2's recomputed copy of A while
    request 0's old copy sits free: that free copy is worthless, so Belady keeps C."""
    trace = _token_requests([
        ([1, 1, 1, 2, 2, 1, 2, 0], 0),
        ([0, 0, 1, 2, 2, 1, 1, 2, 2], 3),
        ([1, 1, 1, 2], 1),
        ([1, 1, 1, 2, 2, 1, 2, 0], 0),
        ([1, 1, 1, 2, 2, 1, 2, 0, 0], 3),
        ([0, 0, 1, 2, 2, 1, 1, 2], 1),
    ])
    prepared = prepare_trace(trace, TraceExpander(4))
    result = sweep(prepared, [4], ONLINE, concurrency=2)
    assert result.ordering_violations == []
    assert result.belady_hit_rates[0] == max(r[0] for r in result.policy_to_hit_rates.values())


def _block_aligned_trace(seed: int) -> Trace:
    """Twelve prompts over two shared 8-token bases, most ending on a block boundary of 4
    (so their last block is recomputed), with 0-3 generated tokens."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3) for _ in range(8)] for _ in range(2)]
    return _token_requests([
        ((rng.choice(bases) + [rng.randrange(3) for _ in range(8)])[:rng.choice([4, 8, 9, 12])],
         rng.randrange(4))
        for _ in range(12)])


@pytest.mark.parametrize("seed", range(30))
def test_belady_never_below_a_policy_when_prompts_end_on_block_boundaries(seed):
    prepared = prepare_trace(_block_aligned_trace(seed), TraceExpander(4))
    for concurrency in (1, 2, 3):
        result = sweep(prepared, [4, 6, 8], ONLINE, concurrency=concurrency)
        assert result.ordering_violations == []


def test_belady_and_infinite_orderings_under_concurrency_and_timeline(prefix_512):
    for mode in ({"concurrency": 8}, {"timeline": True}):
        result = sweep(prefix_512, [3000], ONLINE, **mode)
        assert result.ordering_violations == []


def test_infinite_hit_rate_is_the_replay_with_a_cache_that_never_fills(prefix_512):
    huge = sum(prefix_512.blocks_needed)
    result = replay(prefix_512, ReplayConfig(huge, "lru"))
    assert result.num_evictions == 0
    assert result.hit_rate == infinite_cache_hit_rate(prefix_512)


def _figures(result) -> dict:
    """Everything a replay reports except timings and the capacity-relative usages."""
    figures = result.to_dict()
    for key in ("num_blocks", "peak_usage", "mean_usage", "replay_seconds", "requests_per_s",
                "blocks_per_s"):
        del figures[key]
    return figures


def test_a_huge_capacity_replays_with_a_pool_of_the_trace_demand(prefix_512, monkeypatch):
    pool_sizes = []

    class RecordingManager(replay_module.KVCacheManager):
        def __init__(self, num_blocks, *args, **kwargs):
            pool_sizes.append(num_blocks)
            super().__init__(num_blocks, *args, **kwargs)

    monkeypatch.setattr(replay_module, "KVCacheManager", RecordingManager)
    demand = sum(prefix_512.blocks_needed)
    at_demand = replay(prefix_512, ReplayConfig(demand, "lru"))
    huge = replay(prefix_512, ReplayConfig(10**20, "lru"))
    assert pool_sizes == [demand, demand]
    assert huge.num_blocks == 10**20
    assert huge.hit_rate == infinite_cache_hit_rate(prefix_512)
    assert _figures(huge) == _figures(at_demand)
    # Usages are fractions of the capacity asked for.
    assert 0 < huge.peak_usage == pytest.approx(at_demand.peak_usage * demand / 10**20)
    assert huge.mean_usage == pytest.approx(at_demand.mean_usage * demand / 10**20)
    # Below the demand the pool is the capacity itself.
    assert num_blocks_to_simulate(prefix_512, demand - 1) == demand - 1


@pytest.mark.parametrize("policy", sorted(replay_module.OFFLINE_POLICIES))
def test_an_offline_policy_is_built_by_the_pools_factory_and_never_swapped(policy,
                                                                           monkeypatch):
    managers = []

    class RecordingManager(replay_module.KVCacheManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            managers.append((self, self.block_pool.free_block_queue))

    monkeypatch.setattr(replay_module, "KVCacheManager", RecordingManager)
    prepared = prepare_trace(random_mooncake_trace(1), TraceExpander(128))
    replay(prepared, ReplayConfig(40, policy))
    [(manager, queue_at_construction)] = managers
    pool = manager.block_pool
    assert pool.free_block_queue is queue_at_construction
    assert type(queue_at_construction) is not type(EVICTION_POLICIES["lru"]([]))
    assert queue_at_construction.future is not None  # the oracle knows the trace's future
    assert pool.eviction_policy == policy
    assert pool.num_evictions > 0  # the capacity was tight enough for the oracle to act


@pytest.mark.parametrize("mode", [{"concurrency": 3}, {"timeline": True}])
def test_a_pool_of_the_demand_reports_what_a_larger_pool_does(mode, monkeypatch):
    """The shortcut against the real thing: with it disabled, a pool five times the demand
    gives the same figures, for every policy, as the shortcut's pool of the demand."""
    prepared = prepare_trace(random_mooncake_trace(3), TraceExpander(128))
    demand = sum(prepared.blocks_needed)
    for policy in policy_names():
        shortcut = replay(prepared, ReplayConfig(5 * demand, policy, **mode))
        with monkeypatch.context() as patch:
            patch.setattr(replay_module, "num_blocks_to_simulate", lambda _, n: n)
            full = replay(prepared, ReplayConfig(5 * demand, policy, **mode))
        assert _figures(shortcut) == _figures(full), policy
        assert shortcut.num_evictions == 0 and shortcut.num_hit_tokens > 0
        assert shortcut.peak_usage == full.peak_usage
        assert shortcut.mean_usage == pytest.approx(full.mean_usage)


def test_the_timeline_infinite_ceiling_follows_arrival_order():
    """File order and arrival order differ: the longer prompt is first in the file but
    arrives second, so in the timeline it hits the shorter one's two blocks."""
    trace = Trace("t", [
        TraceRequest(1, 9, 0, 100.0, token_ids=(*range(8), 50)),
        TraceRequest(2, 8, 0, 0.0, token_ids=tuple(range(8))),
    ])
    prepared = prepare_trace(trace, TraceExpander(4))
    assert infinite_cache_hit_rate(prepared) == 4 / 17  # file order: the 8 tokens hit one
    assert infinite_cache_hit_rate(prepared, timeline=True) == 8 / 17
    result = sweep(prepared, [8], ONLINE, timeline=True)
    assert result.infinite_hit_rate == 8 / 17
    assert result.belady_hit_rates == [8 / 17]
    assert result.ordering_violations == []


def test_replays_are_deterministic_and_policies_admit_alike(prefix_512):
    first = replay(prefix_512, ReplayConfig(1000, "2q", concurrency=4))
    again = replay(prefix_512, ReplayConfig(1000, "2q", concurrency=4))
    assert (first.num_hit_tokens, first.num_evictions) == (again.num_hit_tokens,
                                                           again.num_evictions)
    lru = replay(prefix_512, ReplayConfig(1000, "lru", concurrency=4))
    assert lru.num_delayed_requests == first.num_delayed_requests
    assert lru.peak_usage == first.peak_usage


def _token_trace(lengths, output_length=0, gap_ms=0.0):
    return Trace("tokens", [
        TraceRequest(i + 1, n, output_length, i * gap_ms, token_ids=tuple(range(n)))
        for i, n in enumerate(lengths)])


def test_rejected_requests_count_as_misses():
    # Block size 4: the 20-token prompt needs 5 blocks, more than the whole cache of 4.
    prepared = prepare_trace(_token_trace([8, 20, 9]), TraceExpander(4))
    result = replay(prepared, ReplayConfig(4, "lru"))
    assert result.num_requests == 3
    assert result.num_rejected_requests == 1 and result.num_admitted_requests == 2
    assert result.num_prompt_tokens == 37
    assert result.num_hit_tokens == 8  # request 3 hits request 1's two blocks
    assert result.hit_rate == 8 / 37


def test_sequential_concurrency_pins_and_delays():
    # Three 12-token requests (3 blocks each) with nothing shared, 2 live, 7 blocks.
    trace = Trace("t", [TraceRequest(i, 12, 0, None, token_ids=tuple(range(100 * i,
                                                                         100 * i + 12)))
                        for i in range(1, 4)])
    prepared = prepare_trace(trace, TraceExpander(4))
    result = replay(prepared, ReplayConfig(7, "lru", concurrency=3))
    assert result.num_delayed_requests == 1  # the third waits for the first to finish
    assert result.peak_usage == pytest.approx(6 / 7)
    assert result.num_evictions == 2


def test_timeline_holds_blocks_for_the_decode_time():
    # 4 blocks; each request needs 2 (4-token prompt + 4 decode slots at block size 4).
    trace = Trace("t", [
        TraceRequest(1, 4, 4, 0.0, token_ids=(1, 2, 3, 4)),
        TraceRequest(2, 4, 4, 100.0, token_ids=(5, 6, 7, 8)),
        TraceRequest(3, 4, 4, 200.0, token_ids=(9, 10, 11, 12)),
    ])
    prepared = prepare_trace(trace, TraceExpander(4))
    # 4 tokens at 10 tokens/s: live for 0.4 s, so request 3 arrives while 1 and 2 hold all.
    result = replay(prepared, ReplayConfig(4, "lru", timeline=True, decode_tokens_per_s=10.0))
    assert result.num_delayed_requests == 1
    assert result.mean_wait_s == pytest.approx(0.2 / 3)
    assert result.peak_usage == 1.0
    fast = replay(prepared, ReplayConfig(4, "lru", timeline=True, decode_tokens_per_s=100.0))
    assert fast.num_delayed_requests == 0 and fast.mean_wait_s == 0.0


def test_timeline_needs_timestamps():
    prepared = prepare_trace(_token_trace([4, 4]), TraceExpander(4))
    prepared.requests[0] = TraceRequest(1, 4, 0, None, token_ids=(0, 1, 2, 3))
    with pytest.raises(ValueError, match="timestamp"):
        replay(prepared, ReplayConfig(4, "lru", timeline=True))


def test_config_validation():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        ReplayConfig(4, "mru")
    with pytest.raises(ValueError, match="num_blocks"):
        ReplayConfig(0)
    with pytest.raises(ValueError, match="concurrency"):
        ReplayConfig(4, concurrency=0)
    for rate in (0.0, 1e-320, 0.000999, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"decode_tokens_per_s must be a finite number "
                                             r">= 0\.001"):
            ReplayConfig(4, timeline=True, decode_tokens_per_s=rate)
    assert ReplayConfig(4, timeline=True, decode_tokens_per_s=0.001).decode_tokens_per_s == 0.001


def _evictions_under(queue_class, prepared, config, monkeypatch):
    """The replay's result with ``queue_class`` as ``config.policy``'s queue, and every
    block id the queue gave out, in order."""
    taken: list[int] = []

    class Recording(queue_class):
        def popleft_n(self, n):
            blocks = super().popleft_n(n)
            taken.extend(block.block_id for block in blocks)
            return blocks

    registry = (replay_module.OFFLINE_POLICIES if config.policy in replay_module.OFFLINE_POLICIES
                else EVICTION_POLICIES)
    monkeypatch.setitem(registry, config.policy, Recording)
    return replay(prepared, config), taken


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", [{"concurrency": 1}, {"concurrency": 3}, {"timeline": True}])
def test_document_liveness_takes_blocks_in_the_order_of_one_heap_of_every_group(
        seed, mode, monkeypatch):
    # Block size 64: eight blocks per trace block, so depth classes vary within prompts.
    prepared = prepare_trace(random_mooncake_trace(seed, num_requests=200, num_roots=10),
                             TraceExpander(64))
    smallest = max(prepared.blocks_needed)
    for num_blocks in (smallest, 2 * smallest, 4 * smallest):
        config = ReplayConfig(num_blocks, "document-liveness", **mode)
        listed = DocumentLivenessFreeBlockQueue
        result, taken = _evictions_under(listed, prepared, config, monkeypatch)
        expected, expected_taken = _evictions_under(OneHeapDocumentLivenessQueue, prepared,
                                                    config, monkeypatch)
        assert result.num_evictions > 0
        assert taken == expected_taken
        assert _figures(result) == _figures(expected)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", [{"concurrency": 1}, {"concurrency": 3}, {"timeline": True}])
def test_belady_takes_blocks_in_the_order_of_one_heap_entry_per_block(seed, mode,
                                                                      monkeypatch):
    # Block size 128 splits the trace's 512-token blocks: long runs share a next use.
    prepared = prepare_trace(random_mooncake_trace(seed, num_requests=120),
                             TraceExpander(128))
    smallest = max(prepared.blocks_needed)
    for num_blocks in (smallest, smallest + 5, 3 * smallest):
        config = ReplayConfig(num_blocks, "belady", **mode)
        result, taken = _evictions_under(BeladyFreeBlockQueue, prepared, config, monkeypatch)
        expected, expected_taken = _evictions_under(PerBlockBeladyQueue, prepared, config,
                                                    monkeypatch)
        assert result.num_evictions > 0
        assert taken == expected_taken
        assert _figures(result) == _figures(expected)
