"""Eviction policies on the workload suite and the shared trace. Prints JSON.

For each synthetic family (``prefixcache synth``, seeded) and the shared Mooncake trace:
a sweep at block size 512 (sequential, one live request, decode slots reserved) over
capacities of 2 % to 100 % of the infinite-cache working set (the trace's distinct full
blocks), with every online policy, Belady's offline optimum and the infinite cache. Per
trace it reports where the LRU->Belady gap is widest, the share of it ``adaptive`` closes
there, the least ``adaptive - lru`` over the sweep (points), and the replay time of
``adaptive`` against ``lru``'s summed over the sweep.

No constant of ``adaptive`` was fitted to these traces; ``--shadow-entries`` replays it
with another shadow size to show how much that choice matters.

    python benchmarks/eviction_suite.py [--num-requests 2000] [--seed 1]
        [--families chat,rag,...] [--trace PATH] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

from prefixcache.core import EVICTION_POLICIES
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.sweep import sweep
from prefixcache.sim.trace import load_trace
from prefixcache.sim.workloads import WORKLOAD_FAMILIES, generate_requests, write_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" \
    / "synthetic_trace.jsonl"
CAPACITY_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
QUICK_FRACTIONS = (0.05, 0.2, 0.5)


def evaluate(path: Path, fractions: tuple[float, ...], policies: list[str]) -> dict:
    prepared = prepare_trace(load_trace(path), TraceExpander(512))
    working_set = len({h for hashes in prepared.block_hashes for h in hashes})
    capacities = sorted({max(1, round(f * working_set)) for f in fractions})
    result = sweep(prepared, capacities, policies)
    rates = result.policy_to_hit_rates
    lru, adaptive, belady = rates["lru"], rates["adaptive"], result.belady_hit_rates
    gaps = [b - a for a, b in zip(lru, belady, strict=True)]
    widest = max(range(len(gaps)), key=gaps.__getitem__)
    seconds = {p: sum(r.replay_seconds for r in result.runs if r.policy == p)
               for p in ("lru", "adaptive")}
    return {
        "num_requests": len(prepared.requests),
        "working_set_blocks": working_set,
        "capacities_blocks": capacities,
        "infinite_hit_rate": round(result.infinite_hit_rate, 5),
        "belady_hit_rates": [round(r, 5) for r in belady],
        "policy_hit_rates": {p: [round(r, 5) for r in v] for p, v in rates.items()},
        "ordering_violations": result.ordering_violations,
        "widest_gap": {
            "capacity_blocks": capacities[widest],
            "lru": round(lru[widest], 5),
            "belady": round(belady[widest], 5),
            "adaptive": round(adaptive[widest], 5),
            "adaptive_fraction_of_gap_closed":
                round((adaptive[widest] - lru[widest]) / gaps[widest], 4)
                if gaps[widest] > 0 else None,
        },
        "min_adaptive_minus_lru_points": round(
            100 * min(a - b for a, b in zip(adaptive, lru, strict=True)), 3),
        "replay_seconds": {p: round(s, 2) for p, s in seconds.items()},
        "adaptive_over_lru_replay_time": round(seconds["adaptive"] / seconds["lru"], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--families", default=",".join(WORKLOAD_FAMILIES))
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="the shared Mooncake trace (skipped if missing)")
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    parser.add_argument("--shadow-entries", type=int, default=None,
                        help="replay adaptive with this many shadow entries instead")
    parser.add_argument("--quick", action="store_true", help="three capacities only")
    args = parser.parse_args()
    if args.shadow_entries is not None:
        EVICTION_POLICIES["adaptive"].shadow_entries = args.shadow_entries
    policies = args.policies.split(",")
    if "lru" not in policies or "adaptive" not in policies:
        parser.error("--policies must include lru and adaptive")
    fractions = QUICK_FRACTIONS if args.quick else CAPACITY_FRACTIONS
    traces: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = Path(tmp) / f"{family}.jsonl"
            with path.open("w") as handle:
                write_trace(generate_requests(family, args.seed, args.num_requests), handle,
                            "mooncake", args.seed)
            traces[family] = evaluate(path, fractions, policies)
            print(f"{family}: done", file=sys.stderr)
    if args.trace.exists():
        traces["shared"] = evaluate(args.trace, fractions, policies)
    output = {
        "date": datetime.date.today().isoformat(),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "block_size": 512,
        "mode": "sequential, concurrency 1, decode slots reserved",
        "seed": args.seed,
        "capacity_fractions_of_working_set": fractions,
        "adaptive_shadow_entries": EVICTION_POLICIES["adaptive"].shadow_entries,
        "traces": traces,
        "summary": {name: {"adaptive_fraction_of_widest_gap_closed":
                           t["widest_gap"]["adaptive_fraction_of_gap_closed"],
                           "min_adaptive_minus_lru_points": t["min_adaptive_minus_lru_points"],
                           "adaptive_over_lru_replay_time": t["adaptive_over_lru_replay_time"]}
                    for name, t in traces.items()},
    }
    json.dump(output, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
