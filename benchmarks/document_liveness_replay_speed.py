"""Time of a ``document-liveness`` replay: against LRU's, and against one heap of every
group re-keyed whole.

``document-liveness`` re-keys its free blocks whenever its model is refitted (every 25
finished requests). For each case (a trace, a block size, a capacity) the script prepares
the trace once, then replays it in turn under

- ``lru``: the online default, the time users compare with;
- ``document-liveness``: the policy's queue, which keeps groups of blocks in lists, one
  per (class, depth class), and keys only the lists' heads at a refit;
- ``document-liveness, one heap`` (the comparison point): the queue of
  ``tests/core/reference_document_liveness.py``, every group in one heap and re-keyed at
  every refit, the same order;

``--repeats`` times, and reports each one's least time. It checks that both
``document-liveness`` queues give the same hits and evictions (``same_answers``; the
script exits 1 if they do not).

Run from the repository root (it reads the one-heap queue from tests/):

    python benchmarks/document_liveness_replay_speed.py [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

# Run as a script, this folder is on the path but not the repository, whose tests/ hold
# the comparison point.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.belady_replay_speed import SHARED_TRACE, timed  # noqa: E402
from benchmarks.replay_memory import synth  # noqa: E402
from prefixcache.arg_types import positive_int  # noqa: E402
from prefixcache.core import EVICTION_POLICIES  # noqa: E402
from prefixcache.sim.expand import TraceExpander  # noqa: E402
from prefixcache.sim.prepared import prepare_trace  # noqa: E402
from prefixcache.sim.sweep import capacities_from_spec, working_set_blocks  # noqa: E402
from prefixcache.sim.trace import load_trace  # noqa: E402
from tests.core.reference_document_liveness import OneHeapDocumentLivenessQueue  # noqa: E402

POLICY = "document-liveness"


def measure(trace_path: Path, block_size: int, capacity: int | float, repeats: int,
            max_requests: int | None = None) -> dict:
    """One case: ``capacity`` in blocks, or as a share of the working set (a float)."""
    trace = load_trace(trace_path, max_requests=max_requests)
    prepared = prepare_trace(trace, TraceExpander(block_size))
    working_set = working_set_blocks(prepared)
    [num_blocks] = capacities_from_spec([capacity], working_set)
    runs = {"lru": [], POLICY: [], f"{POLICY}, one heap": []}
    answers = {}
    listed_queue = EVICTION_POLICIES[POLICY]
    try:
        for _ in range(repeats):
            for name in runs:
                EVICTION_POLICIES[POLICY] = (OneHeapDocumentLivenessQueue
                                             if name.endswith("one heap") else listed_queue)
                seconds, answer = timed(prepared, num_blocks, name.split(",")[0])
                runs[name].append(seconds)
                answers[name] = answer
    finally:
        EVICTION_POLICIES[POLICY] = listed_queue
    best = {name: min(times) for name, times in runs.items()}
    return {
        "trace": trace_path.name,
        "num_requests": len(prepared.requests),
        "block_size": block_size,
        "num_blocks": num_blocks,
        "working_set_blocks": working_set,
        "seconds": {name: round(value, 2) for name, value in best.items()},
        "all_seconds": {name: [round(t, 2) for t in times] for name, times in runs.items()},
        "over_lru": round(best[POLICY] / best["lru"], 2),
        "one_heap_over_lists": round(best[f"{POLICY}, one heap"] / best[POLICY], 2),
        "lru_hit_tokens": answers["lru"][0],
        "hit_tokens": answers[POLICY][0],
        "same_answers": answers[POLICY] == answers[f"{POLICY}, one heap"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="replays of each queue per case, least time kept (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="the shared trace's first 1,000 requests only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        if args.quick:
            cases = [(SHARED_TRACE, 512, 0.1, 1000), (SHARED_TRACE, 16, 0.1, 1000)]
        else:
            # The shared trace at the same KV size (2 M tokens) at both block sizes, where
            # its LRU->Belady gap is widest; synthetic mixture traffic at 10 % of its
            # working set; and chat, whose requests are small, in a pool that holds half
            # of its working set: many free groups at every refit.
            cases = [(SHARED_TRACE, 512, 4000, None), (SHARED_TRACE, 16, 128_000, None),
                     (synth(Path(directory), "mixture", 5000, "mooncake"), 16, 0.1, None),
                     (synth(Path(directory), "chat", 5000, "mooncake"), 16, 0.5, None)]
        results = [measure(path, block_size, capacity, args.repeats, max_requests)
                   for path, block_size, capacity, max_requests in cases]
    json.dump({
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "repeats": args.repeats,
        "cases": results,
    }, sys.stdout, indent=1)
    print()
    return 0 if all(case["same_answers"] for case in results) else 1


if __name__ == "__main__":
    sys.exit(main())
