"""Eviction policies on the Mooncake synthetic trace (data/), and replay speed. Prints JSON.

1. Sweep (block size 512, sequential, one live request, decode slots reserved): token hit
   rate per capacity for every online policy, Belady's offline optimum and the infinite
   cache; the capacity where Belady beats LRU by most, and the fraction of that gap the
   best online policy closes.
2. At that capacity, the offline dead-content diagnostics (:mod:`prefixcache.sim.dead_content`):
   how much of the gap knowing which content is never used again would close — all of it,
   content seen by one request only, content already reused — against the best online
   policy.
3. The same policies in the timeline mode (arrivals at the trace's timestamps, each request
   live for output_length / 50 tokens/s, so concurrent requests pin their blocks) at three
   capacities, with Belady.
4. The trace's reuse hazard (:mod:`prefixcache.sim.reuse`): how likely content seen once,
   or seen again, is to be looked up within the next 100 requests, by age — what limits
   every online policy.
5. Wall time of one whole-trace replay (LRU, the same token capacity) at block sizes 512
   and 16: reading the trace, hashing (expansion), and the replay itself.
6. With ``--robustness`` (about 3 more minutes): document-liveness at the widest-gap
   capacity with each knob of its model changed alone from its default, and the fraction
   of the gap each variant closes.

    python benchmarks/replay_policies.py [--quick] [--robustness] [--trace PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.document_liveness import (
    DocumentLivenessFreeBlockQueue,
    DocumentLivenessModel,
)
from prefixcache.sim.dead_content import DEAD_CONTENT_KINDS
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.replay import ReplayConfig, replay
from prefixcache.sim.reuse import reuse_hazard
from prefixcache.sim.sweep import sweep
from prefixcache.sim.trace import load_trace

DEFAULT_TRACE = (Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake"
                 / "synthetic_trace.jsonl")
CAPACITIES = [1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000, 24000, 32000]
QUICK_CAPACITIES = [2000, 4000, 8000]
TIMELINE_CAPACITIES = [2000, 4000, 8000]
TIMED_TOKEN_CAPACITY = 4000 * 512  # the same KV size at both block sizes
# document-liveness's model knobs and the values each is tried at, alone.
LIVENESS_KNOBS = {"refit_every": [10, 35, 50, 75, 100], "prior_weight": [4, 16],
                  "em_iterations": [2, 8], "hazard_bin": [100, 400], "max_count": [4, 16],
                  "max_depth_bits": [10, 14]}


def timed_replay(trace_path: Path, block_size: int, policy: str = "lru") -> dict:
    started = time.perf_counter()
    trace = load_trace(trace_path)
    loaded = time.perf_counter()
    prepared = prepare_trace(trace, TraceExpander(block_size))
    hashed = time.perf_counter()
    result = replay(prepared, ReplayConfig(TIMED_TOKEN_CAPACITY // block_size, policy))
    done = time.perf_counter()
    return {
        "block_size": block_size,
        "policy": policy,
        "num_blocks": result.num_blocks,
        "hit_rate": round(result.hit_rate, 5),
        "load_s": round(loaded - started, 3),
        "hash_s": round(hashed - loaded, 3),
        "replay_s": round(done - hashed, 3),
        "total_s": round(done - started, 3),
        "requests_per_s": round(result.requests_per_s),
        "blocks_per_s": round(result.blocks_per_s),
    }


def timeline_sweep(prepared, policies: list[str]) -> dict:
    result = sweep(prepared, TIMELINE_CAPACITIES, policies, timeline=True)
    return {
        "mode": "timeline, decode 50 tokens/s, decode slots reserved",
        "capacities_blocks": TIMELINE_CAPACITIES,
        "belady_hit_rates": [round(r, 5) for r in result.belady_hit_rates],
        "policy_hit_rates": {p: [round(r, 5) for r in rates]
                             for p, rates in result.policy_to_hit_rates.items()},
        "ordering_violations": result.ordering_violations,
        "widest_gap": result.widest_gap(),
    }


def _liveness_variant(knobs: dict) -> type[DocumentLivenessFreeBlockQueue]:
    """document-liveness whose models (documents' and conversations') have ``knobs``
    instead of the defaults."""
    class Variant(DocumentLivenessFreeBlockQueue):
        def __init__(self, blocks) -> None:
            super().__init__(blocks, model=DocumentLivenessModel(**knobs),
                             conversation_model=DocumentLivenessModel(**knobs))
    return Variant


def liveness_robustness(prepared, widest: dict) -> list[dict]:
    """document-liveness at the widest-gap capacity with each model knob in
    :data:`LIVENESS_KNOBS` changed alone; each variant is registered only while it runs."""
    lru, belady = widest["baseline_hit_rate"], widest["belady_hit_rate"]
    rows = []
    for knob, values in LIVENESS_KNOBS.items():
        for value in values:
            name = f"document-liveness[{knob}={value}]"
            EVICTION_POLICIES[name] = _liveness_variant({knob: value})
            try:
                rate = replay(prepared, ReplayConfig(widest["capacity_blocks"], name)).hit_rate
            finally:
                del EVICTION_POLICIES[name]
            rows.append({"knob": knob, "value": value, "hit_rate": round(rate, 5),
                         "fraction_of_gap_closed": round((rate - lru) / (belady - lru), 4)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--quick", action="store_true", help="three capacities only")
    parser.add_argument("--robustness", action="store_true",
                        help="also vary document-liveness's knobs at the widest gap")
    args = parser.parse_args()

    capacities = QUICK_CAPACITIES if args.quick else CAPACITIES
    policies = list(EVICTION_POLICIES)
    trace = load_trace(args.trace)
    prepared = prepare_trace(trace, TraceExpander(512))
    started = time.perf_counter()
    result = sweep(prepared, capacities, policies)
    sweep_s = time.perf_counter() - started

    widest = result.widest_gap()
    diagnostics = {}
    if widest is not None:
        lru, belady = widest["baseline_hit_rate"], widest["belady_hit_rate"]
        for name in DEAD_CONTENT_KINDS:
            rate = replay(prepared, ReplayConfig(widest["capacity_blocks"], name)).hit_rate
            diagnostics[name] = {"hit_rate": round(rate, 5),
                                 "fraction_of_gap_closed": round((rate - lru) / (belady - lru), 4)}

    output = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "trace": str(args.trace),
        "num_requests": len(trace.requests),
        "sweep": {
            "block_size": 512,
            "mode": "sequential, concurrency 1, decode slots reserved",
            "capacities_blocks": capacities,
            "infinite_hit_rate": round(result.infinite_hit_rate, 5),
            "belady_hit_rates": [round(r, 5) for r in result.belady_hit_rates],
            "policy_hit_rates": {p: [round(r, 5) for r in rates]
                                 for p, rates in result.policy_to_hit_rates.items()},
            "ordering_violations": result.ordering_violations,
            "widest_gap": widest,
            "fraction_of_lru_belady_gap_closed": {
                p: [round((r - lru) / (b - lru), 4) if b > lru else None
                    for r, lru, b in zip(rates, result.policy_to_hit_rates["lru"],
                                         result.belady_hit_rates, strict=True)]
                for p, rates in result.policy_to_hit_rates.items() if p != "lru"},
            "wall_s": round(sweep_s, 1),
        },
        "dead_content_diagnostics_at_widest_gap": diagnostics,
        "timeline": timeline_sweep(prepared, policies),
        "reuse_hazard": reuse_hazard(prepared).to_dict(),
        "replay_wall_time": [timed_replay(args.trace, 512), timed_replay(args.trace, 16)],
    }
    if args.robustness and widest is not None:
        output["document_liveness_robustness_at_widest_gap"] = liveness_robustness(prepared,
                                                                                  widest)
    json.dump(output, sys.stdout, indent=1)
    print()
    return 1 if result.ordering_violations else 0


if __name__ == "__main__":
    sys.exit(main())
