"""What the wait's shape does to ``document-liveness``. Prints JSON.

The policy's model fits one rate per request at which a live document's next request
comes (an exponential wait, whose median is ``ln 2`` times its mean), and its clock, by
which silence lowers a block's standing, runs that rate times the wait's shape:
``ln 2 * mean / median`` (at least 1) of the waits that have ended among the model's
states. For each trace, this prints the wait's shape over the whole trace (a document is
the prompt's first block id; the wait is the number of requests between two of its
requests) and, at 2, 5, 10 and 20 % of the working set (block size 512, sequential
replay), the token hit rates of ``lru``, ``unhashed-first``, ``document-liveness`` and two
diagnostic copies of it, measurements rather than policies:

- ``one-rate-clock``: its clock runs at the fitted rate alone (``follow_wait_shape=False``),
  as the policy did before it followed the wait's shape;
- ``faster-clock``: that one-rate clock times ``--clock-scale``, one fixed factor for
  every trace.

Traces: the shared Mooncake trace, and the three random traces of ``python
benchmarks/eviction_suite.py --random-traces 30`` (seed 1, 3,000 requests each) on which
the one-rate policy was more than 0.2 points below LRU, regenerated from their generator
seeds and parameters; with ``--long-chat``, also the two of its ``--random-traces 8
--random-families chat --num-requests 12000 --seed 2`` where it was (several minutes
more).

    python benchmarks/document_liveness_wait_shape.py [--clock-scale 4] [--long-chat]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.core.eviction.document_liveness_model import DocumentLivenessModel
from prefixcache.sim.expand import TraceExpander
from prefixcache.sim.prepared import prepare_trace
from prefixcache.sim.sweep import sweep, working_set_blocks
from prefixcache.sim.trace import Trace, load_trace
from prefixcache.sim.workloads import generate_requests, write_trace

SHARED_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" \
    / "synthetic_trace.jsonl"
BLOCK_SIZE = 512
FRACTIONS = (0.02, 0.05, 0.10, 0.20)
POLICIES = ("lru", "unhashed-first", "document-liveness")
ONE_RATE_CLOCK = "one-rate-clock"
FASTER_CLOCK = "faster-clock"
#: name -> (family, generator seed, number of requests, parameters), as
#: ``eviction_suite.py`` reports them.
RANDOM_TRACES = {
    "random-01-chat": ("chat", 546390556, 3000, {
        "num_system_prompts": 17, "system_prompt_zipf_s": 1.2, "system_prompt_tokens": 301,
        "conversations_per_s": 0.41, "turns_tail_index": 1.22, "first_message_tokens": 992,
        "user_tokens": 158, "output_tokens": 110, "think_time_s": 32.531}),
    "random-11-chat": ("chat", 2210456544, 3000, {
        "num_system_prompts": 54, "system_prompt_zipf_s": 0.83,
        "system_prompt_tokens": 2778, "conversations_per_s": 0.282, "turns_tail_index": 1.59,
        "first_message_tokens": 617, "user_tokens": 64, "output_tokens": 89,
        "think_time_s": 52.767}),
    "random-04-tenants": ("tenants", 3194650526, 3000, {
        "num_tenants": 98, "zipf_s": 0.79, "system_prompt_tokens": 2082,
        "user_tokens": 2216, "output_tokens": 881, "follow_up_probability": 0.42,
        "follow_up_delay_s": 23.264, "requests_per_s": 1.155}),
}
#: The same for the long chat traces (``--long-chat``); named as in their own set.
LONG_CHAT_TRACES = {
    "random-06-chat (12,000)": ("chat", 322268100, 12000, {
        "num_system_prompts": 52, "system_prompt_zipf_s": 0.74,
        "system_prompt_tokens": 4324, "conversations_per_s": 1.99, "turns_tail_index": 1.88,
        "first_message_tokens": 624, "user_tokens": 449, "output_tokens": 100,
        "think_time_s": 121.996}),
    "random-03-chat (12,000)": ("chat", 3470444009, 12000, {
        "num_system_prompts": 62, "system_prompt_zipf_s": 0.8, "system_prompt_tokens": 442,
        "conversations_per_s": 1.575, "turns_tail_index": 1.95, "first_message_tokens": 765,
        "user_tokens": 73, "output_tokens": 297, "think_time_s": 77.139}),
}


class OneRateClockQueue(DocumentLivenessFreeBlockQueue):
    """``document-liveness`` whose clock runs at the fitted rate alone."""

    policy_name = ONE_RATE_CLOCK

    def __init__(self, blocks) -> None:
        super().__init__(blocks, model=DocumentLivenessModel(follow_wait_shape=False))


class FasterClockModel(DocumentLivenessModel):
    """The one-rate model, its clock advanced ``scale`` times the fitted rate per
    request."""

    def __init__(self, scale: float) -> None:
        super().__init__(follow_wait_shape=False)
        self.scale = scale

    def tick(self) -> None:
        super().tick()
        self.clock += (self.scale - 1.0) * self.rate  # its wait_shape stays 1


class FasterClockQueue(DocumentLivenessFreeBlockQueue):
    """``document-liveness`` with a :class:`FasterClockModel` of ``clock_scale``."""

    policy_name = FASTER_CLOCK
    clock_scale = 4.0

    def __init__(self, blocks) -> None:
        super().__init__(blocks, model=FasterClockModel(self.clock_scale))


def wait_shape(trace: Trace) -> dict:
    """The waits, in requests, between consecutive requests of each document."""
    last_seen: dict[int, int] = {}
    waits = []
    for index, request in enumerate(trace.requests):
        if not request.hash_ids:
            continue
        document = request.hash_ids[0]
        if document in last_seen:
            waits.append(index - last_seen[document])
        last_seen[document] = index
    mean, median = statistics.fmean(waits), statistics.median(waits)
    return {"documents": len(last_seen), "waits": len(waits), "mean_requests": round(mean, 1),
            "median_requests": median, "median_over_mean": round(median / mean, 2)}


def measure(trace: Trace) -> dict:
    """The trace's wait shape, and every policy's hit rate at each of :data:`FRACTIONS`."""
    prepared = prepare_trace(trace, TraceExpander(BLOCK_SIZE))
    working_set = working_set_blocks(prepared)
    capacities = [max(1, round(fraction * working_set)) for fraction in FRACTIONS]
    result = sweep(prepared, capacities, [*POLICIES, ONE_RATE_CLOCK, FASTER_CLOCK],
                   with_belady=False)
    return {"wait": wait_shape(trace), "working_set_blocks": working_set,
            "hit_rate_percent": {
                str(blocks): {policy: round(100 * rates[i], 2)
                              for policy, rates in result.policy_to_hit_rates.items()}
                for i, blocks in enumerate(capacities)}}


def synthetic_trace(family: str, seed: int, num_requests: int, params: dict,
                    tmp: str) -> Trace:
    """The family's trace as ``prefixcache synth`` writes it (Mooncake format)."""
    path = Path(tmp) / f"{family}-{seed}.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests(family, seed, num_requests, **params), handle,
                    "mooncake", seed)
    return load_trace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clock-scale", type=float, default=4.0,
                        help="how many times the fitted rate the faster-clock copy's clock "
                             "advances per request (default 4)")
    parser.add_argument("--long-chat", action="store_true",
                        help="also measure the two long chat traces (12,000 requests)")
    args = parser.parse_args()
    if not (args.clock_scale > 0 and math.isfinite(args.clock_scale)):
        parser.error("--clock-scale must be a finite number > 0")
    FasterClockQueue.clock_scale = args.clock_scale
    diagnostics = (OneRateClockQueue, FasterClockQueue)
    for queue in diagnostics:
        EVICTION_POLICIES[queue.policy_name] = queue
    try:
        traces = {"shared": load_trace(SHARED_TRACE)}
        with tempfile.TemporaryDirectory() as tmp:
            specs = {**RANDOM_TRACES, **(LONG_CHAT_TRACES if args.long_chat else {})}
            for name, (family, seed, num_requests, params) in specs.items():
                traces[name] = synthetic_trace(family, seed, num_requests, params, tmp)
        output = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
                  "block_size": BLOCK_SIZE, "clock_scale": args.clock_scale,
                  "traces": {name: measure(trace) for name, trace in traces.items()}}
    finally:
        for queue in diagnostics:
            del EVICTION_POLICIES[queue.policy_name]
    json.dump(output, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
