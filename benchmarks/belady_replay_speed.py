"""Time of a Belady replay: against LRU's, and against a queue with a heap entry per block.

A sweep replays Belady's optimum at every capacity, so its time is most of a sweep's at
small block sizes. For each case (a trace, a block size, a capacity) the script prepares
the trace once, then replays it in turn under

- ``lru``: the online default, the time users compare with;
- ``belady``: the replayer's queue, which keeps the blocks of a release in runs that
  share a next use, one heap entry per run;
- ``belady, per block`` (the comparison point): the plain queue of
  ``tests/sim/reference_belady.py``, one heap entry per block, the same definition;

``--repeats`` times, and reports each one's least time. It checks that both Belady queues
give the same hits and evictions (``same_answers``; the script exits 1 if they do not).

Run from the repository root (it reads the per-block queue from tests/):

    python benchmarks/belady_replay_speed.py [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this folder is on the path but not the repository, whose tests/ hold
# the comparison point.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.replay_memory import synth  # noqa: E402
from prefixcache.arg_types import positive_int  # noqa: E402
from prefixcache.sim.expand import TraceExpander  # noqa: E402
from prefixcache.sim.prepared import PreparedTrace, prepare_trace  # noqa: E402
from prefixcache.sim.replay import ReplayConfig, replay  # noqa: E402
from prefixcache.sim.sweep import capacities_from_spec, working_set_blocks  # noqa: E402
from prefixcache.sim.trace import load_trace  # noqa: E402
from tests.sim.reference_belady import PerBlockBeladyQueue  # noqa: E402

SHARED_TRACE = (Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake"
                / "synthetic_trace.jsonl")
# The module, not the function ``prefixcache.sim`` exports under the same name.
replay_module = importlib.import_module("prefixcache.sim.replay")


def timed(prepared, num_blocks: int, policy: str) -> tuple[float, tuple[int, int]]:
    """Seconds of one replay, and its (hit tokens, evictions)."""
    started = time.perf_counter()
    result = replay(prepared, ReplayConfig(num_blocks, policy))
    return time.perf_counter() - started, (result.num_hit_tokens, result.num_evictions)


def timed_in_turn(prepared, num_blocks: int, repeats: int, registry: dict, policy: str,
                  reference_label: str, reference_queue: type) -> tuple[dict, dict]:
    """``repeats`` rounds of replays under ``lru``, ``policy`` and, as
    ``reference_label``, ``policy`` with ``registry[policy]`` swapped for
    ``reference_queue`` (put back after). Returns each label's times and its last
    (hit tokens, evictions)."""
    runs: dict[str, list[float]] = {"lru": [], policy: [], reference_label: []}
    answers = {}
    queue = registry[policy]
    try:
        for _ in range(repeats):
            for label in runs:
                registry[policy] = reference_queue if label == reference_label else queue
                seconds, answers[label] = timed(prepared, num_blocks,
                                                "lru" if label == "lru" else policy)
                runs[label].append(seconds)
    finally:
        registry[policy] = queue
    return runs, answers


def case_figures(trace_path: Path, prepared: PreparedTrace, num_blocks: int,
                 working_set: int, runs: dict[str, list[float]]) -> tuple[dict, dict]:
    """What every replay-speed case reports about itself and its times, and each
    label's least time."""
    best = {name: min(times) for name, times in runs.items()}
    return {
        "trace": trace_path.name,
        "num_requests": len(prepared.requests),
        "block_size": prepared.expander.block_size,
        "num_blocks": num_blocks,
        "working_set_blocks": working_set,
        "seconds": {name: round(value, 2) for name, value in best.items()},
        "all_seconds": {name: [round(t, 2) for t in times] for name, times in runs.items()},
    }, best


def prepared_case(trace_path: Path, block_size: int, capacity: int | float,
                  max_requests: int | None) -> tuple[PreparedTrace, int, int]:
    """A case's trace prepared once, its working set and its capacity in blocks
    (``capacity`` is in blocks, or a share of the working set if a float)."""
    trace = load_trace(trace_path, max_requests=max_requests)
    prepared = prepare_trace(trace, TraceExpander(block_size))
    working_set = working_set_blocks(prepared)
    [num_blocks] = capacities_from_spec([capacity], working_set)
    return prepared, working_set, num_blocks


def measure(trace_path: Path, block_size: int, capacity: int | float, repeats: int,
            max_requests: int | None = None) -> dict:
    """One case: ``capacity`` in blocks, or as a share of the working set (a float)."""
    prepared, working_set, num_blocks = prepared_case(trace_path, block_size, capacity,
                                                      max_requests)
    runs, answers = timed_in_turn(prepared, num_blocks, repeats,
                                  replay_module.OFFLINE_POLICIES, "belady",
                                  "belady, per block", PerBlockBeladyQueue)
    figures, best = case_figures(trace_path, prepared, num_blocks, working_set, runs)
    return {
        **figures,
        "block_references": prepared.block_hashes.num_references,
        "belady_over_lru": round(best["belady"] / best["lru"], 2),
        "per_block_over_runs": round(best["belady, per block"] / best["belady"], 2),
        "lru_hit_tokens": answers["lru"][0],
        "belady_hit_tokens": answers["belady"][0],
        "same_answers": answers["belady"] == answers["belady, per block"],
    }


def run_cases(description: str, full_cases: Callable[[Path], list[tuple]],
              measure_case: Callable[..., dict]) -> int:
    """The command line the replay-speed scripts share: ``--repeats``, and ``--quick``
    (the shared trace's first 1,000 requests at block sizes 512 and 16, 10 % of the
    working set) or else ``full_cases(directory)``, cases ``(trace path, block size,
    capacity, max requests)`` whose synthetic traces are written in ``directory``. Each
    case is measured with ``measure_case``, the JSON printed; returns 1 unless every case
    gave the same answers both ways."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="replays of each queue per case, least time kept (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="the shared trace's first 1,000 requests only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        cases = ([(SHARED_TRACE, 512, 0.1, 1000), (SHARED_TRACE, 16, 0.1, 1000)]
                 if args.quick else full_cases(Path(directory)))
        results = [measure_case(path, block_size, capacity, args.repeats, max_requests)
                   for path, block_size, capacity, max_requests in cases]
    json.dump({
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "repeats": args.repeats,
        "cases": results,
    }, sys.stdout, indent=1)
    print()
    return 0 if all(case["same_answers"] for case in results) else 1


def full_cases(directory: Path) -> list[tuple]:
    """The shared trace at the same KV size (2 M tokens) at both block sizes, where its
    LRU->Belady gap is widest; a synthetic mixture at 10 % of its working set."""
    return [(SHARED_TRACE, 512, 4000, None), (SHARED_TRACE, 16, 128_000, None),
            (synth(directory, "mixture", 5000, "mooncake"), 16, 0.1, None)]


def main() -> int:
    return run_cases(" ".join(__doc__.split("\n\n")[0].split()), full_cases, measure)


if __name__ == "__main__":
    sys.exit(main())
