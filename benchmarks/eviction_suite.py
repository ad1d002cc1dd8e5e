"""Eviction policies on the workload suite and the shared trace. Prints JSON.

For each synthetic family (``prefixcache synth``, seeded) and the shared Mooncake trace:
a sweep at block size 512 (sequential, one live request, decode slots reserved; or, with
``--concurrency C``, up to ``C`` live, or with ``--timeline``, each request admitted at
its timestamp and live while it decodes, as ``prefixcache replay`` does) over
capacities of 2 % to 100 % of the infinite-cache working set (the trace's distinct full
blocks), with every online policy, Belady's offline optimum and the infinite cache. Per
trace it reports where the LRU->Belady gap is widest, the share of it ``adaptive`` closes
there, the least ``adaptive - lru`` over the sweep (points), and the replay time of
``adaptive`` against ``lru``'s summed over the sweep.

Leave-one-trace-out validation of ``adaptive``'s design choices, its *variants*: the
registered one, other sizes of its shadow caches (``shadow-256``, ``shadow-384``,
``shadow-512``: entries per shadow), the costlier candidate set it replaced
(``previous``: ``2q``'s own order as a fifth candidate, shadows of 512 entries; with
today's ghost-list reach, not the earlier shorter one), the set of recency and
protection orders alone: 0, 50 and 90 % protected (``no-low-reuse``), the candidates
without the half-protected one (``no-half``), and one ghost-list reach for every
candidate instead of the choice between two: ``2q``'s 2 cache-fulls (``ghost-2``) or 4
(``ghost-4``), and the two constants of the choice among candidates: the lead a candidate
needs to be followed, 0, 5 or 10 % of the leader's count instead of 2 % (``margin-0``,
``margin-5``, ``margin-10``), and how often the shadows' counts halve, every 1, 2, 3 or 8
shadow capacities of sampled hashes instead of 4 (``decay-1`` ... ``decay-8``;
``decay-2-margin-0`` both at once).
``adaptive`` is replayed on every trace under each variant of ``--lofo-variants``; for each
trace left out, the variant with the best mean score on the *other* traces is chosen
(score: the share of the widest gap closed, minus 1 if it is more than 0.2 points below
LRU at any capacity), and the left-out trace's figures under it are reported
(``leave_one_out``).

    python benchmarks/eviction_suite.py [--num-requests 2000] [--seed 1]
        [--families chat,rag,...] [--trace PATH] [--trace-block-size N] [--skip-bad-lines]
        [--quick] [--policies lru,adaptive,...]
        [--lofo-variants shadow-256,shadow-384,...] [--split-trace N]
        [--random-traces N] [--random-merges N] [--random-families chat,rag,...]
        [--candidates-alone]
        [--concurrency C | --timeline]
    python benchmarks/eviction_suite.py --combine PART.json PART.json ...

``--trace PATH`` measures another Mooncake- or Bailian-format trace (docs/trace-formats.md)
in the shared one's place (named after its file: a trace of your own traffic, or one kept
aside from tuning); ``--trace-block-size N`` reads its Mooncake lines' ids as N-token
blocks (which must divide 512 tokens or be a multiple of them), and its figures say which
(``trace_block_size``); ``--skip-bad-lines`` skips and counts its malformed lines.
``--families ''`` runs that trace alone and ``--trace ''`` skips it, so the traces can
be measured by separate processes; ``--split-trace N`` measures that trace as ``N``
consecutive parts in time (``shared-1/N`` ...), each replayed alone, to check on parts
of it what was seen on the whole; ``--combine`` then merges their outputs into one, with
the summary and the leave-one-out check over all of them.

``--candidates-alone`` also replays each of ``adaptive``'s candidate orders followed
alone from the start (``adaptive`` restricted to that one candidate), and reports per
trace the best of them at the widest gap and how far ``adaptive`` falls short of the best
one at any capacity (``candidates_alone``, ``best_candidate_alone``): whether what
``adaptive`` leaves of a gap is lost in choosing among its candidates or lies beyond all
of them.

``--random-traces N`` adds ``N`` traces no policy was tuned on: the families of
``--random-families`` in turn, each with parameters drawn at random around its defaults
(:mod:`prefixcache.sim.workloads.random_parameters`; the draws depend only on ``--seed``),
named ``random-01-chat`` and so on, each reported with its parameters and generator seed
(``prefixcache synth`` writes it again from them); the summary then
counts, over them and for every online policy replayed, the traces where it falls more
than 0.2 points below LRU and those where it closes a quarter of the widest gap
(``random_traces``).

``--random-merges N`` adds ``N`` traces of mixed traffic no policy was tuned on: each
two traces of different ``--random-families`` (their pairs in turn), each with
parameters drawn at random as above, merged in order of arrival with their hash ids
kept apart (``prefixcache merge``) and cut to ``--num-requests``; named
``merge-01-chat+rag`` and so on, each reported with its parts' families, seeds and
parameters (``merged_from``), and counted with the random traces in the summary.

The figures go to stdout as JSON; stderr has a line per trace when it is done and, on a
terminal, a bar over the requests that trace's replays have left.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import platform
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Run as a script, this folder is on the path but not the repository, which the sibling
# module is imported from (as when the tests import this one).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.eviction_suite_output import (
    REGISTERED,
    add_summary,
    combine,
    gap_figures,
    gaps_and_widest,
)
from prefixcache.arg_types import name_list, non_negative_int, positive_int
from prefixcache.core import EVICTION_POLICIES
from prefixcache.core.eviction.adaptive import CANDIDATES, Candidate
from prefixcache.entrypoints.cli import run_with_exit_codes, stderr_to_null_if_closed
from prefixcache.entrypoints.trace_options import add_trace_block_size
from prefixcache.sim.expand import TraceExpander, block_sizes_fit
from prefixcache.sim.merge import merge_traces
from prefixcache.sim.prepared import PreparedTrace, prepare_trace
from prefixcache.sim.sweep import capacities_from_spec, sweep, working_set_blocks
from prefixcache.sim.trace import MOONCAKE_BLOCK_SIZE, Trace, TraceFormatError, load_trace
from prefixcache.sim.workloads import (
    MAX_NUM_REQUESTS,
    WORKLOAD_FAMILIES,
    generate_requests,
    write_trace,
)
from prefixcache.sim.workloads.random_parameters import random_parameters

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" \
    / "synthetic_trace.jsonl"
BLOCK_SIZE = MOONCAKE_BLOCK_SIZE  # the traces' own: every figure is at this block size
CAPACITY_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
QUICK_FRACTIONS = (0.05, 0.2, 0.5)


@dataclasses.dataclass(frozen=True)
class ReplayMode:
    """How the requests of a trace are replayed: one at a time in file order (the
    default), up to ``concurrency`` live at once, or, with ``timeline``, each admitted at
    its timestamp and live while it decodes (``prefixcache replay``'s modes)."""

    concurrency: int = 1
    timeline: bool = False

    @property
    def description(self) -> str:
        if self.timeline:
            return "timeline, decode slots reserved"
        return f"sequential, concurrency {self.concurrency}, decode slots reserved"


SEQUENTIAL = ReplayMode()


def one_reach_candidates(ghost_factor: int) -> tuple[Candidate, ...]:
    """The registered candidate orders with one ghost-list reach for every segment order,
    without the repeats that leaves; the liveness order (no ghost list) as registered."""
    orders = dict.fromkeys((c.protected_fraction, c.low_reuse_first) for c in CANDIDATES
                           if not c.liveness)
    return (tuple(Candidate(fraction, low_reuse_first, ghost_factor)
                  for fraction, low_reuse_first in orders)
            + tuple(c for c in CANDIDATES if c.liveness))


#: The variants of ``adaptive`` the leave-one-out check chooses among: class attributes
#: to override.
ADAPTIVE_VARIANTS: dict[str, dict] = {
    REGISTERED: {},
    "shadow-256": {"shadow_entries": 256},
    "shadow-384": {"shadow_entries": 384},
    "shadow-512": {"shadow_entries": 512},
    "previous": {"candidates": (Candidate(0.0, False), Candidate(0.5, False),
                                Candidate(0.9, False), Candidate(0.0, True),
                                Candidate(0.9, True)),
                 "shadow_entries": 512},
    "no-low-reuse": {"candidates": (Candidate(0.0, False), Candidate(0.5, False),
                                    Candidate(0.9, False))},
    "no-half": {"candidates": tuple(c for c in CANDIDATES if c.protected_fraction != 0.5)},
    "ghost-2": {"candidates": one_reach_candidates(2)},
    "ghost-4": {"candidates": one_reach_candidates(4)},
    "margin-0": {"switch_margin": 0.0},
    "margin-5": {"switch_margin": 0.05},
    "margin-10": {"switch_margin": 0.10},
    "decay-1": {"decay_factor": 1},
    "decay-2": {"decay_factor": 2},
    "decay-3": {"decay_factor": 3},
    "decay-8": {"decay_factor": 8},
    "decay-2-margin-0": {"decay_factor": 2, "switch_margin": 0.0},
    "document-clock": {"liveness_clock": "documents"},
    # Nearly every block protected, low-reuse content not first: the order that keeps
    # conversations longest where their next turns come long after the cache turns over.
    "protect-99": {"candidates": CANDIDATES + (Candidate(0.99, False),)},
    "protect-99-alone": {"candidates": (Candidate(0.99, False),)},
}


def split_in_time(requests: list, num_parts: int) -> list[list]:
    """``requests`` (in time order) cut into ``num_parts`` consecutive parts of nearly
    equal size."""
    bounds = [len(requests) * i // num_parts for i in range(num_parts + 1)]
    return [requests[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


def candidate_alone_overrides() -> dict[str, dict]:
    """Per candidate of ``adaptive`` (by label), the class attributes that make it follow
    that candidate alone."""
    return {candidate.label: {"candidates": (candidate,)} for candidate in CANDIDATES}


def best_candidate_figures(capacities: list[int], lru: list[float], belady: list[float],
                           adaptive: list[float],
                           candidate_rates: dict[str, list[float]]) -> dict:
    """At the widest LRU->Belady gap, the candidate followed alone that hits most and the
    share of the gap it closes; and over the sweep, the most ``adaptive`` falls short of
    the best candidate at the same capacity (points; 0 if it never does) and at which
    capacity (None if it never does)."""
    _, widest = gaps_and_widest(lru, belady)
    best = max(candidate_rates, key=lambda label: candidate_rates[label][widest])
    best_rates = [max(rates[i] for rates in candidate_rates.values())
                  for i in range(len(lru))]
    shortfalls = [b - a for a, b in zip(adaptive, best_rates, strict=True)]
    worst = max(range(len(shortfalls)), key=shortfalls.__getitem__)
    return {
        "candidate": best,
        "fraction_of_gap_closed":
            gap_figures(lru, belady, candidate_rates[best])["fraction_of_gap_closed"],
        "max_adaptive_shortfall_points": round(100 * max(0.0, shortfalls[worst]), 3),
        "max_adaptive_shortfall_at_blocks": capacities[worst] if shortfalls[worst] > 0
        else None,
    }


def sweep_adaptive_with(prepared: PreparedTrace, capacities: list[int],
                        overrides: dict, jobs: int = 1,
                        mode: ReplayMode = SEQUENTIAL,
                        progress: Callable[[int], object] | None = None) -> list[float]:
    """``adaptive``'s hit rates over ``capacities``, replayed in ``mode``, with its class
    attributes ``overrides`` set for the replays (and restored after; forked workers
    inherit them). ``progress(n)``: as :func:`~prefixcache.sim.sweep.sweep`'s."""
    adaptive_class = EVICTION_POLICIES["adaptive"]
    saved = {name: getattr(adaptive_class, name) for name in overrides}
    for name, value in overrides.items():
        setattr(adaptive_class, name, value)
    try:
        return sweep(prepared, capacities, ["adaptive"], with_belady=False, jobs=jobs,
                     concurrency=mode.concurrency, timeline=mode.timeline,
                     progress=progress).policy_to_hit_rates["adaptive"]
    finally:
        for name, value in saved.items():
            setattr(adaptive_class, name, value)


def trace_name(path: Path) -> str:
    """``shared`` for the shared Mooncake trace, else the file's name without extension."""
    return "shared" if path.resolve() == DEFAULT_TRACE else path.stem


def evaluate(trace: Trace, fractions: tuple[float, ...], policies: list[str],
             lofo_variants: list[str], candidates_alone: bool = False,
             jobs: int = 1, mode: ReplayMode = SEQUENTIAL, progress=None) -> dict:
    """The trace's figures (module docstring). ``progress``, a tqdm-like bar, is given
    its ``total`` in requests replayed once the capacities are known, then updated as
    they are."""
    prepared = prepare_trace(trace, TraceExpander(BLOCK_SIZE))
    working_set = working_set_blocks(prepared)
    capacities = capacities_from_spec(fractions, working_set)
    variants = [v for v in lofo_variants if v != REGISTERED]
    candidate_overrides = candidate_alone_overrides() if candidates_alone else {}
    update = None
    if progress is not None:
        num_sweeps = len(policies) + 1 + len(variants) + len(candidate_overrides)  # Belady
        progress.total = num_sweeps * len(capacities) * len(prepared.requests)
        progress.refresh()
        update = progress.update
    result = sweep(prepared, capacities, policies, jobs=jobs, concurrency=mode.concurrency,
                   timeline=mode.timeline, progress=update)
    variant_to_rates = {REGISTERED: result.policy_to_hit_rates["adaptive"]}
    for variant in variants:
        variant_to_rates[variant] = sweep_adaptive_with(
            prepared, capacities, ADAPTIVE_VARIANTS[variant], jobs, mode, update)
    candidate_to_rates = {
        label: sweep_adaptive_with(prepared, capacities, overrides, jobs, mode, update)
        for label, overrides in candidate_overrides.items()}
    rates = result.policy_to_hit_rates
    lru, adaptive, belady = rates["lru"], rates["adaptive"], result.belady_hit_rates
    gaps, widest = gaps_and_widest(lru, belady)
    seconds = {p: sum(r.replay_seconds for r in result.runs if r.policy == p)
               for p in ("lru", "adaptive")}
    figures = {
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
        "adaptive_by_variant": {
            variant: {"hit_rates": [round(r, 5) for r in rates],
                      **gap_figures(lru, belady, rates)}
            for variant, rates in variant_to_rates.items()},
    }
    if candidate_to_rates:
        figures["candidates_alone"] = {
            label: {"hit_rates": [round(r, 5) for r in rates],
                    **gap_figures(lru, belady, rates)}
            for label, rates in candidate_to_rates.items()}
        figures["best_candidate_alone"] = best_candidate_figures(
            capacities, lru, belady, adaptive, candidate_to_rates)
    return figures


def random_trace_specs(num_traces: int, families: list[str],
                       seed: int) -> list[tuple[str, str, int, dict]]:
    """``num_traces`` (name, family, generator seed, parameters): the families in turn,
    each with parameters drawn at random; a function of the arguments only."""
    rng = random.Random(f"random-traces:{seed}")
    specs = []
    for index in range(num_traces):
        family = families[index % len(families)]
        params = random_parameters(WORKLOAD_FAMILIES[family], rng)
        specs.append((f"random-{index + 1:02d}-{family}", family, rng.randrange(2**32),
                      params))
    return specs


def random_merge_specs(num_traces: int, families: list[str],
                       seed: int) -> list[tuple[str, list[tuple[str, int, dict]]]]:
    """``num_traces`` (name, parts): each part a (family, generator seed, parameters)
    drawn as :func:`random_trace_specs` draws them, two parts of different families, the
    pairs of ``families`` in turn; a function of the arguments only."""
    rng = random.Random(f"random-merges:{seed}")
    pairs = list(itertools.combinations(dict.fromkeys(families), 2))
    specs = []
    for index in range(num_traces):
        pair = pairs[index % len(pairs)]
        parts = [(family, rng.randrange(2**32),
                  random_parameters(WORKLOAD_FAMILIES[family], rng)) for family in pair]
        specs.append((f"merge-{index + 1:02d}-{'+'.join(pair)}", parts))
    return specs


def generated_trace(name: str, family: str, seed: int, num_requests: int, params: dict,
                    tmp: str) -> Trace:
    """A family's trace, written in the Mooncake format (as ``name`` in ``tmp``, removed
    again) and read back as ``prefixcache replay`` reads it."""
    path = Path(tmp) / f"{name}.jsonl"
    with path.open("w") as handle:
        write_trace(generate_requests(family, seed, num_requests, **params), handle,
                    "mooncake", seed)
    trace = load_trace(path)
    path.unlink()
    return trace


def merged_trace(name: str, parts: list[tuple[str, int, dict]], num_requests: int,
                 tmp: str) -> Trace:
    """Each part's trace of ``num_requests`` (:func:`generated_trace`), merged in order of
    arrival as ``prefixcache merge`` merges them, cut to the first ``num_requests``."""
    traces = [generated_trace(f"{name}-{index}", family, seed, num_requests, params, tmp)
              for index, (family, seed, params) in enumerate(parts)]
    return Trace(name, merge_traces(traces, max_requests=num_requests))


def main(argv: list[str] | None = None) -> int:
    """Run the script on ``argv``, ending as the ``prefixcache`` command does (Ctrl-C: exit
    130; stdout's reader gone: 141, quietly). A usage error exits 2 (SystemExit from
    argparse). Started with stderr closed, its lines go nowhere rather than into the
    JSON on stdout."""
    stderr_to_null_if_closed()
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + "\nFigures measured with it: "
        "docs/benchmarks.md; each option in full: this script's docstring.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python benchmarks/eviction_suite.py --policies lru,2q,adaptive "
               "--lofo-variants '' --jobs 2\n"
               "  python benchmarks/eviction_suite.py --families '' --trace mine.jsonl "
               "--policies lru,2q,adaptive --lofo-variants '' --jobs 2")
    parser.add_argument("--num-requests", type=int, default=2000,
                        help="requests per generated trace (default 2000)")
    parser.add_argument("--seed", type=non_negative_int, default=1,
                        help="seed of the families' traces and of the random draws "
                             "(default 1)")
    parser.add_argument("--families", default=",".join(WORKLOAD_FAMILIES),
                        help="the workload families to generate and measure, comma-"
                             f"separated (default: all of {', '.join(WORKLOAD_FAMILIES)}; "
                             "'' for none)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE),
                        help="a Mooncake- or Bailian-format trace measured beside the "
                             "families, named by its file (default: the shared trace, named "
                             "'shared'; '' skips it)")
    add_trace_block_size(parser)
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) malformed lines of --trace instead of failing")
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES),
                        help="the online eviction policies replayed, comma-separated "
                             "(default: every registered one; must include lru and "
                             "adaptive)")
    parser.add_argument("--shadow-entries", type=positive_int, default=None,
                        help="replay adaptive with this many shadow entries instead")
    parser.add_argument("--quick", action="store_true", help="three capacities only")
    parser.add_argument("--split-trace", type=int, default=1, metavar="N",
                        help="measure the shared trace as N consecutive parts, each alone")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="PART",
                        help="merge the outputs of earlier runs instead of measuring")
    parser.add_argument("--lofo-variants", default=",".join(
        v for v in ADAPTIVE_VARIANTS if v != REGISTERED),
        help="adaptive's variants for the leave-one-trace-out check, among "
             f"{', '.join(ADAPTIVE_VARIANTS)} ('' to skip)")
    parser.add_argument("--random-traces", type=int, default=0, metavar="N",
                        help="also measure N traces of the --random-families in turn, "
                             "with parameters drawn at random around their defaults "
                             "(default 0)")
    parser.add_argument("--random-merges", type=int, default=0, metavar="N",
                        help="also measure N traces each merging two traces of different "
                             "--random-families (their pairs in turn), each with "
                             "parameters drawn at random (default 0)")
    parser.add_argument("--random-families", default=",".join(WORKLOAD_FAMILIES),
                        help="families of the random traces and merges (default: all)")
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                        help="replays run at once, each in a process of its own "
                             "(default 1); the figures are the same")
    parser.add_argument("--candidates-alone", action="store_true",
                        help="also replay each of adaptive's candidate orders followed "
                             "alone, and report the best of them against adaptive")
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument("--concurrency", type=positive_int, default=1, metavar="C",
                         help="replay with up to C requests live at once, in file order "
                              "(default 1: one at a time)")
    overlap.add_argument("--timeline", action="store_true",
                         help="replay each request at its timestamp, live while it decodes "
                              "(prefixcache replay's timeline mode, at its default decode "
                              "speed)")
    args = parser.parse_args(argv)
    mode = ReplayMode(args.concurrency, args.timeline)
    if args.combine:
        try:
            return combine(args.combine)
        except ValueError as exc:
            parser.error(f"--combine {exc}")
    if args.split_trace < 1:
        parser.error("--split-trace must be at least 1")
    if (not 1 <= args.num_requests <= MAX_NUM_REQUESTS or args.random_traces < 0
            or args.random_merges < 0):
        parser.error(f"--num-requests must be 1 to {MAX_NUM_REQUESTS:,}, --random-traces "
                     "and --random-merges at least 0")
    families = name_list(args.families)
    # Repeats kept: the random traces take these families in turn, as many times as named.
    random_families = [f for f in (part.strip() for part in args.random_families.split(","))
                       if f]
    unknown_families = [f for f in families + random_families if f not in WORKLOAD_FAMILIES]
    if unknown_families:
        parser.error(f"unknown family {', '.join(unknown_families)}; choose among "
                     f"{', '.join(WORKLOAD_FAMILIES)}")
    if args.random_traces and not random_families:
        parser.error("--random-traces needs at least one of --random-families")
    if args.random_merges and len(set(random_families)) < 2:
        parser.error("--random-merges needs two different --random-families")
    if not families and not args.random_traces and not args.random_merges and not args.trace:
        parser.error("nothing to measure: --families '' and --trace '' without "
                     "--random-traces or --random-merges")
    if args.split_trace > 1 and not args.trace:
        parser.error(f"--split-trace {args.split_trace} needs a trace to split, and "
                     "--trace '' skips it")
    if args.shadow_entries is not None:
        EVICTION_POLICIES["adaptive"].shadow_entries = args.shadow_entries
    policies = name_list(args.policies)
    # Online policies only: Belady is measured on every trace anyway, and the dead-content
    # diagnostics are no policy to rank.
    unknown_policies = [p for p in policies if p not in EVICTION_POLICIES]
    if unknown_policies:
        parser.error(f"unknown online policy {', '.join(unknown_policies)}; choose among "
                     f"{', '.join(EVICTION_POLICIES)} (Belady is always measured)")
    if "lru" not in policies or "adaptive" not in policies:
        parser.error("--policies must include lru and adaptive")
    fractions = QUICK_FRACTIONS if args.quick else CAPACITY_FRACTIONS
    lofo_variants = name_list(args.lofo_variants)
    unknown = [v for v in lofo_variants if v not in ADAPTIVE_VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose among "
                     f"{', '.join(ADAPTIVE_VARIANTS)}")
    if args.trace and not block_sizes_fit(BLOCK_SIZE, args.trace_block_size):
        parser.error(f"--trace-block-size {args.trace_block_size}: the suite replays at "
                     f"{BLOCK_SIZE}-token blocks, so the trace's ids must name blocks that "
                     f"divide {BLOCK_SIZE} tokens or are a multiple of {BLOCK_SIZE}")
    shared = None
    if args.trace:
        try:  # before the families: a bad file should not wait for minutes of replays
            shared = load_trace(Path(args.trace), skip_bad_lines=args.skip_bad_lines,
                                mooncake_block_size=args.trace_block_size)
        except TraceFormatError as exc:  # its message names the file (or directory)
            parser.error(f"--trace: {exc}")
        except OSError as exc:
            parser.error(f"--trace {args.trace}: {exc.strerror}")
        if note := shared.skipped_lines_note():
            print(note, file=sys.stderr)
        if args.split_trace > len(shared.requests):  # a part of none measures nothing
            parser.error(f"--split-trace {args.split_trace}: the trace has only "
                         f"{len(shared.requests)} requests, one part per request at most")
        if mode.timeline and not shared.has_timestamps:
            parser.error(f"--timeline needs a 'timestamp' on every request of {args.trace}")
    traces: dict[str, dict] = {}

    # A bar per trace on a terminal (a trace of many thousand requests takes minutes);
    # a line per trace when done, wherever stderr goes.
    show_progress = sys.stderr.isatty()

    def measure(name: str, trace: Trace) -> dict:
        from tqdm import tqdm
        with tqdm(desc=f"{name}: replaying", unit="req", leave=False,
                  disable=not show_progress) as bar:
            figures = evaluate(trace, fractions, policies, lofo_variants,
                               args.candidates_alone, args.jobs, mode,
                               bar if show_progress else None)
        print(f"{name}: done", file=sys.stderr)
        return figures

    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            traces[family] = measure(family, generated_trace(
                family, family, args.seed, args.num_requests, {}, tmp))
        for name, family, seed, params in random_trace_specs(
                args.random_traces, random_families, args.seed):
            traces[name] = {"family": family, "seed": seed, "parameters": params,
                            **measure(name, generated_trace(
                                name, family, seed, args.num_requests, params, tmp))}
        for name, parts in random_merge_specs(args.random_merges, random_families,
                                              args.seed):
            traces[name] = {
                "merged_from": [{"family": family, "seed": seed, "parameters": params}
                                for family, seed, params in parts],
                **measure(name, merged_trace(name, parts, args.num_requests, tmp))}
    if shared is not None:
        name = trace_name(Path(args.trace))
        parts = [(name, shared)] if args.split_trace == 1 else [
            (f"{name}-{part}/{args.split_trace}", dataclasses.replace(shared, requests=requests))
            for part, requests in enumerate(split_in_time(shared.requests, args.split_trace), 1)]
        for part_name, trace in parts:
            traces[part_name] = {"trace_block_size": args.trace_block_size,
                                 "num_bad_lines": shared.num_bad_lines,
                                 **measure(part_name, trace)}
    output = {
        "date": datetime.date.today().isoformat(),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "block_size": BLOCK_SIZE,
        "mode": mode.description,
        "seed": args.seed,
        "capacity_fractions_of_working_set": fractions,
        "adaptive_shadow_entries": EVICTION_POLICIES["adaptive"].shadow_entries,
        "lofo_variants": lofo_variants,
        "candidates_alone": args.candidates_alone,
        "traces": traces,
    }
    add_summary(output)
    json.dump(output, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
