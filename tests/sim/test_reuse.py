"""The reuse hazard: exact figures on a hand-checked trace, and its input checks."""

from __future__ import annotations

import pytest

from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.reuse import reuse_hazard
from prefixcache.sim.trace import load_trace
from tests.sim.helpers import write_lines


def small_prepared(tmp_path, chains):
    # Each request ends in a one-token partial block of its own (id 100 + i).
    lines = [{"timestamp": i, "input_length": 512 * len(ids) + 1, "output_length": 1,
              "hash_ids": [*ids, 100 + i]} for i, ids in enumerate(chains)]
    trace = load_trace(write_lines(tmp_path / "t.jsonl", lines))
    return prepare_trace(trace, TraceExpander(512))


def test_hazard_by_first_and_repeat_access(tmp_path):
    # Hash 0 is used by requests 0, 2 and 4; hashes 1, 2, 3 once each.
    prepared = small_prepared(tmp_path, [[0], [1], [0], [2], [0], [3]])
    hazard = reuse_hazard(prepared, ages=(0, 2), window=2)
    # Age 0 (accesses 0..4 have a full window): nothing is reused within 2 requests.
    # Age 2 (accesses 0..2): of the first accesses at 0 and 1 still waiting, 0's comes
    # back at 2; the repeat at 2 comes back at 4.
    assert hazard.first == (0.0, 0.5)
    assert hazard.repeat == (0.0, 1.0)
    assert (hazard.num_first, hazard.num_repeat) == (3, 2)
    assert hazard.to_dict()["repeat_access"] == [0.0, 1.0]


def test_hazard_without_qualifying_accesses_is_none(tmp_path):
    prepared = small_prepared(tmp_path, [[0], [1]])
    hazard = reuse_hazard(prepared, ages=(0,), window=5)
    assert hazard.first == (None,) and hazard.repeat == (None,)


@pytest.mark.parametrize("ages,window", [((0,), 0), ((-1,), 5)])
def test_hazard_rejects_bad_arguments(tmp_path, ages, window):
    prepared = small_prepared(tmp_path, [[0]])
    with pytest.raises(ValueError):
        reuse_hazard(prepared, ages=ages, window=window)
