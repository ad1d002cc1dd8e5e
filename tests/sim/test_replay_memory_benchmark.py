"""``benchmarks/replay_memory.py``: both layouts build the same data in their own
processes, and the token-id trace is held in far less memory than as tuples."""

from __future__ import annotations

import random

from benchmarks.replay_memory import measure
from tests.sim.helpers import write_lines


def test_both_layouts_give_the_same_answers_and_arrays_hold_token_ids_smaller(tmp_path):
    rng = random.Random(0)
    roots = [[rng.randrange(50_000) for _ in range(3000)] for _ in range(3)]
    lines = []
    for _ in range(150):
        prompt = rng.choice(roots)[:rng.randint(500, 3000)]
        lines.append({"prompt_token_ids": prompt + [rng.randrange(50_000)
                                                    for _ in range(rng.randint(0, 300))]})
    path = write_lines(tmp_path / "t.jsonl", lines)
    result = measure(path, 16)
    assert result["same_answers"] and result["block_size"] == 16
    plain, ours = result["runs"]["plain"], result["runs"]["prefixcache"]
    assert plain["num_requests"] == ours["num_requests"] == 150
    assert plain["working_set_blocks"] == ours["working_set_blocks"] < ours[
        "num_block_references"]
    # About 270,000 token ids: some 36 bytes each in tuples (about 9 MiB), 4 in an array.
    assert ours["trace_mib"] < plain["trace_mib"] / 3
