"""``benchmarks/belady_replay_speed.py``: both Belady queues give the same replay, and
the figures it reports are those of the replays it ran."""

from __future__ import annotations

from benchmarks.belady_replay_speed import measure
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from tests.sim.helpers import random_mooncake_trace, write_lines


def test_both_belady_queues_agree_and_the_figures_are_the_replays(tmp_path):
    trace = random_mooncake_trace(4, num_requests=150)
    path = write_lines(tmp_path / "t.jsonl", [
        {"timestamp": int(request.timestamp_ms), "input_length": request.input_length,
         "output_length": request.output_length, "hash_ids": list(request.hash_ids)}
        for request in trace.requests])
    result = measure(path, 128, 0.2, repeats=2)
    assert result["same_answers"]
    prepared = prepare_trace(trace, TraceExpander(128))
    assert result["num_blocks"] == round(0.2 * result["working_set_blocks"])
    for policy in ("lru", "belady"):
        expected = replay(prepared, ReplayConfig(result["num_blocks"], policy))
        assert result[f"{policy}_hit_tokens"] == expected.num_hit_tokens
    assert result["belady_hit_tokens"] > result["lru_hit_tokens"]
    assert all(len(times) == 2 for times in result["all_seconds"].values())
    assert result["seconds"]["belady"] == min(result["all_seconds"]["belady"])
