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

import sys
from pathlib import Path

# Run as a script, this folder is on the path but not the repository, whose tests/ hold
# the comparison point.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.belady_replay_speed import (  # noqa: E402
    SHARED_TRACE,
    case_figures,
    prepared_case,
    run_cases,
    timed_in_turn,
)
from benchmarks.replay_memory import synth  # noqa: E402
from prefixcache.core import EVICTION_POLICIES  # noqa: E402
from tests.core.reference_document_liveness import OneHeapDocumentLivenessQueue  # noqa: E402

POLICY = "document-liveness"


def measure(trace_path: Path, block_size: int, capacity: int | float, repeats: int,
            max_requests: int | None = None) -> dict:
    """One case: ``capacity`` in blocks, or as a share of the working set (a float)."""
    prepared, working_set, num_blocks = prepared_case(trace_path, block_size, capacity,
                                                      max_requests)
    runs, answers = timed_in_turn(prepared, num_blocks, repeats, EVICTION_POLICIES, POLICY,
                                  f"{POLICY}, one heap", OneHeapDocumentLivenessQueue)
    figures, best = case_figures(trace_path, prepared, num_blocks, working_set, runs)
    return {
        **figures,
        "over_lru": round(best[POLICY] / best["lru"], 2),
        "one_heap_over_lists": round(best[f"{POLICY}, one heap"] / best[POLICY], 2),
        "lru_hit_tokens": answers["lru"][0],
        "hit_tokens": answers[POLICY][0],
        "same_answers": answers[POLICY] == answers[f"{POLICY}, one heap"],
    }


def full_cases(directory: Path) -> list[tuple]:
    """The shared trace at the same KV size (2 M tokens) at both block sizes, where its
    LRU->Belady gap is widest; a synthetic mixture at 10 % of its working set; and chat,
    whose requests are small, in a pool that holds half of its working set: many free
    groups at every refit."""
    return [(SHARED_TRACE, 512, 4000, None), (SHARED_TRACE, 16, 128_000, None),
            (synth(directory, "mixture", 5000, "mooncake"), 16, 0.1, None),
            (synth(directory, "chat", 5000, "mooncake"), 16, 0.5, None)]


def main() -> int:
    return run_cases(" ".join(__doc__.split("\n\n")[0].split()), full_cases, measure)


if __name__ == "__main__":
    sys.exit(main())
