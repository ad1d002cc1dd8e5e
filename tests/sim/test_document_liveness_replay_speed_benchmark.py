"""``benchmarks/document_liveness_replay_speed.py``: both ``document-liveness`` queues
give the same replay, the registry is left as it was, and the figures it reports are
those of the replays it ran."""

from __future__ import annotations

from benchmarks.document_liveness_replay_speed import POLICY, measure
from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from tests.sim.helpers import random_mooncake_trace, write_lines


def test_both_queues_agree_and_the_figures_are_the_replays(tmp_path):
    trace = random_mooncake_trace(5, num_requests=200, num_roots=10)
    path = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": int(request.timestamp_ms), "input_length": request.input_length,
         "output_length": request.output_length, "hash_ids": list(request.hash_ids)}
        for request in trace.requests])
    result = measure(path, 64, 0.2, repeats=2)
    assert EVICTION_POLICIES[POLICY] is DocumentLivenessFreeBlockQueue
    assert result["same_answers"]
    prepared = prepare_trace(trace, TraceExpander(64))
    assert result["num_blocks"] == round(0.2 * result["working_set_blocks"])
    for policy, field in (("lru", "lru_hit_tokens"), (POLICY, "hit_tokens")):
        expected = replay(prepared, ReplayConfig(result["num_blocks"], policy))
        assert result[field] == expected.num_hit_tokens
    assert result["hit_tokens"] != result["lru_hit_tokens"]
    assert all(len(times) == 2 for times in result["all_seconds"].values())
    assert result["seconds"][POLICY] == min(result["all_seconds"][POLICY])
