"""Mooncake-format traces whose hash ids name blocks of another size than 512 tokens
(``--trace-block-size``): read, replayed and measured as the same sharing in 512-token
ids is."""

from __future__ import annotations

import json

import pytest

from benchmarks import eviction_suite
from prefixcache.entrypoints.cli import main
from prefixcache.sim.trace import format_line, load_trace, parse_line
from tests.sim.helpers import mooncake_in_smaller_ids, trace_prefix


def test_ids_are_counted_in_the_given_size():
    line = '{"timestamp": 5, "input_length": 130, "hash_ids": [1, 2, 3]}'
    request = parse_line(line, 1, mooncake_block_size=64)
    assert request.hash_block_size == 64 and request.hash_ids == (1, 2, 3)
    assert request.timestamp_ms == 5.0  # still ms: only the block size differs
    with pytest.raises(ValueError, match=r"expected 1 \(one per 512-token block.*"
                                         r"give that size \(--trace-block-size\)"):
        parse_line(line, 1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """The shared trace's first 150 requests as they are and spelt in 64-token ids."""
    requests = trace_prefix(150).requests
    folder = tmp_path_factory.mktemp("sizes")
    paths = {}
    for name, spelt in (("mooncake", requests),
                        ("ids64", [mooncake_in_smaller_ids(r, 64) for r in requests])):
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(format_line(r) + "\n" for r in spelt))
    return paths


@pytest.mark.parametrize("block_size", ["64", "512"])
def test_replay_hits_what_the_512_token_spelling_hits(traces, tmp_path, block_size):
    figures = {}
    for name, extra in (("mooncake", []), ("ids64", ["--trace-block-size", "64"])):
        out = tmp_path / f"{name}.json"
        assert main(["replay", str(traces[name]), "--block-size", block_size,
                     "--sweep", "2%,10%,50%", "--policy", "lru,2q", "--quiet",
                     "--json", str(out), *extra]) == 0
        figures[name] = json.loads(out.read_text())
    for key in ("working_set_blocks", "capacities_blocks", "infinite_hit_rate",
                "belady_hit_rates", "policy_hit_rates"):
        assert figures["ids64"][key] == figures["mooncake"][key]
    assert figures["mooncake"]["infinite_hit_rate"] > 0
    assert (figures["mooncake"]["trace_block_size"], figures["ids64"]["trace_block_size"]) \
        == (512, 64)
    # Without the option the 64-token ids are counted as 512-token ones: a clear error.
    assert main(["replay", str(traces["ids64"]), "--num-blocks", "100", "--quiet"]) == 1


def test_merge_and_the_suite_read_them_too(traces, tmp_path, capsys):
    merged = tmp_path / "merged.jsonl"
    assert main(["merge", str(traces["ids64"]), "-o", str(merged), "--quiet",
                 "--trace-block-size", "64"]) == 0
    assert load_trace(merged, mooncake_block_size=64).requests[0].hash_block_size == 64
    outputs = {}
    for name, extra in (("mooncake", []), ("ids64", ["--trace-block-size", "64"])):
        assert eviction_suite.main(["--families", "", "--trace", str(traces[name]),
                                    "--quick", "--policies", "lru,2q,adaptive",
                                    "--lofo-variants", "", *extra]) == 0
        (outputs[name],) = json.loads(capsys.readouterr().out)["traces"].values()
    for key in ("working_set_blocks", "infinite_hit_rate", "belady_hit_rates"):
        assert outputs["ids64"][key] == outputs["mooncake"][key]
    assert (outputs["ids64"]["policy_hit_rates"]["lru"]
            == outputs["mooncake"]["policy_hit_rates"]["lru"])
    assert outputs["ids64"]["trace_block_size"] == 64
