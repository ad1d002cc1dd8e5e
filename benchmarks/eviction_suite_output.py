"""The output of ``benchmarks/eviction_suite.py``: figures drawn from replayed hit-rate
curves (the widest LRU->Belady gap, the share of it a policy closes, its least margin over
LRU), the summary and leave-one-out check built from a run's traces, and the reading,
checking and merging of saved outputs (``--combine``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

#: The name of the registered ``adaptive`` among the leave-one-out variants.
REGISTERED = "registered"
#: How far below LRU, in points, a policy may be anywhere on a sweep before it counts
#: as below it.
LOFO_TOLERANCE_POINTS = 0.2


def gaps_and_widest(lru: list[float], belady: list[float]) -> tuple[list[float], int]:
    """The LRU->Belady gap at each capacity, and the index of the widest (the first of
    equals)."""
    gaps = [b - a for a, b in zip(lru, belady, strict=True)]
    return gaps, max(range(len(gaps)), key=gaps.__getitem__)


def gap_figures(lru: list[float], belady: list[float], rates: list[float]) -> dict:
    """At the widest LRU->Belady gap, the share a policy with hit ``rates`` closes; and
    its least difference to LRU over the sweep, in points."""
    gaps, widest = gaps_and_widest(lru, belady)
    return {
        "fraction_of_gap_closed": round((rates[widest] - lru[widest]) / gaps[widest], 4)
        if gaps[widest] > 0 else None,
        "min_minus_lru_points": round(
            100 * min(a - b for a, b in zip(rates, lru, strict=True)), 3),
    }


def lofo_score(figures: dict) -> float:
    closed = figures["fraction_of_gap_closed"] or 0.0
    return closed - (figures["min_minus_lru_points"] < -LOFO_TOLERANCE_POINTS)


def leave_one_out(per_value: dict[str, dict[str, dict]]) -> dict:
    """For each trace, the variant best on the others, and the trace's figures under it
    (``per_value[variant][trace]`` holds :func:`gap_figures` of ``adaptive`` under that
    variant)."""
    traces = list(next(iter(per_value.values())))
    report = {}
    for left_out in traces:
        others = [t for t in traces if t != left_out]
        chosen = max(per_value, key=lambda value: sum(
            lofo_score(per_value[value][t]) for t in others) / max(1, len(others)))
        report[left_out] = {"chosen_variant": chosen, **per_value[chosen][left_out]}
    return report


def add_summary(output: dict) -> None:
    """The per-trace headline figures and, with more than one variant, the leave-one-out
    check, from ``output["traces"]``."""
    traces = output["traces"]
    output["summary"] = {
        name: {"adaptive_fraction_of_widest_gap_closed":
               t["widest_gap"]["adaptive_fraction_of_gap_closed"],
               "min_adaptive_minus_lru_points": t["min_adaptive_minus_lru_points"],
               "adaptive_over_lru_replay_time": t["adaptive_over_lru_replay_time"],
               **({"best_candidate_alone": t["best_candidate_alone"]}
                  if "best_candidate_alone" in t else {})}
        for name, t in traces.items()}
    random_traces = [t for t in traces.values() if is_random(t)]
    if random_traces:
        output["random_traces"] = random_traces_summary(random_traces)
    variants = [REGISTERED, *[v for v in output["lofo_variants"] if v != REGISTERED]]
    if len(variants) > 1 and len(traces) > 1:
        output["leave_one_out"] = leave_one_out(
            {variant: {name: t["adaptive_by_variant"][variant]
                       for name, t in traces.items()} for variant in variants})


def is_random(trace_figures: dict) -> bool:
    """Whether a trace's figures are of a random trace or a random merge (drawn with
    parameters no policy was tuned on), which the summary counts together."""
    return "parameters" in trace_figures or "merged_from" in trace_figures


def random_traces_summary(traces: list[dict]) -> dict:
    """Over the random traces, for every online policy replayed: on how many it falls more
    than the tolerance below LRU somewhere on the sweep, its least margin over LRU, and
    how much of the widest gap it closes (median, and on how many traces a quarter)."""
    policies = [p for p in traces[0]["policy_hit_rates"] if p != "lru"]
    by_policy = {}
    for policy in policies:
        figures = [gap_figures(t["policy_hit_rates"]["lru"], t["belady_hit_rates"],
                               t["policy_hit_rates"][policy]) for t in traces]
        closed = [f["fraction_of_gap_closed"] or 0.0 for f in figures]
        margins = [f["min_minus_lru_points"] for f in figures]
        by_policy[policy] = {
            "num_below_lru_by_more_than_tolerance": sum(
                margin < -LOFO_TOLERANCE_POINTS for margin in margins),
            "least_minus_lru_points": min(margins),
            "median_fraction_of_widest_gap_closed": round(statistics.median(closed), 4),
            "num_closing_a_quarter_of_widest_gap": sum(share >= 0.25 for share in closed)}
    return {"num_traces": len(traces), "by_policy": by_policy}


#: What the outputs merged by ``--combine`` must have measured alike.
COMBINED_SETTINGS = ("block_size", "mode", "capacity_fractions_of_working_set",
                     "adaptive_shadow_entries", "lofo_variants", "candidates_alone")


def read_output(path: Path) -> dict:
    """One earlier output of this script; ValueError, naming ``path``, if it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not an output of this script (not UTF-8 text)") from None
    try:
        output = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not an output of this script (not JSON: {exc})") from None
    if not isinstance(output, dict) or not isinstance(output.get("traces"), dict):
        raise ValueError(f"{path}: not an output of this script (no 'traces')")
    problem = output_problem(output)
    if problem:
        raise ValueError(f"{path}: not an output of this script ({problem})")
    return output


def is_number(value) -> bool:
    return type(value) in (int, float)  # not bool, which JSON's true would give


def is_hit_rates(value) -> bool:
    return isinstance(value, list) and bool(value) and all(map(is_number, value))


def output_problem(output: dict) -> str | None:
    """What :func:`combine` and :func:`add_summary` would fail on in ``output`` (a dict
    with a dict ``traces``): a missing setting, no traces, or a trace without the figures
    they read; None if there is nothing."""
    missing = [key for key in COMBINED_SETTINGS if key not in output]
    if missing:
        return f"no {', '.join(missing)}"
    variants = output["lofo_variants"]
    if not isinstance(variants, list) or not all(isinstance(v, str) for v in variants):
        return "lofo_variants is not a list of names"
    if not output["traces"]:
        return "no traces in 'traces'"
    for name, entry in output["traces"].items():
        problem = trace_problem(entry, [REGISTERED, *variants])
        if problem:
            return f"trace {name!r}: {problem}"
    return None


def trace_problem(entry, variants: list[str]) -> str | None:
    """What the summary would fail on in one trace's figures, replayed under ``variants``
    of ``adaptive``; None if there is nothing."""
    if not isinstance(entry, dict):
        return "not an object"
    missing = [key for key in ("widest_gap", "min_adaptive_minus_lru_points",
                               "adaptive_over_lru_replay_time", "belady_hit_rates",
                               "policy_hit_rates", "adaptive_by_variant") if key not in entry]
    if missing:
        return f"no {', '.join(missing)}"
    if not isinstance(entry["widest_gap"], dict) \
            or "adaptive_fraction_of_gap_closed" not in entry["widest_gap"]:
        return "no adaptive_fraction_of_gap_closed in widest_gap"
    belady, policy_rates = entry["belady_hit_rates"], entry["policy_hit_rates"]
    if not is_hit_rates(belady):
        return "belady_hit_rates is not a list of hit rates"
    if not isinstance(policy_rates, dict) or "lru" not in policy_rates or not all(
            is_hit_rates(rates) and len(rates) == len(belady)
            for rates in policy_rates.values()):
        return "policy_hit_rates is not lru's and others' hit rates, one per capacity"
    by_variant = entry["adaptive_by_variant"]
    for variant in variants:
        figures = by_variant.get(variant) if isinstance(by_variant, dict) else None
        if not isinstance(figures, dict) \
                or not is_number(figures.get("min_minus_lru_points")) \
                or "fraction_of_gap_closed" not in figures \
                or not (figures["fraction_of_gap_closed"] is None
                        or is_number(figures["fraction_of_gap_closed"])):
            return f"no figures for adaptive's variant {variant!r} in adaptive_by_variant"
    return None


def combine(paths: list[Path]) -> int:
    """Merge the traces of several outputs (same settings) and summarise them together.
    ValueError, naming the file, for one that is not an output of this script."""
    parts = [read_output(path) for path in paths]
    for key in COMBINED_SETTINGS:
        if len({json.dumps(part.get(key)) for part in parts}) > 1:
            raise ValueError(f"{' '.join(map(str, paths))}: measured with different {key}")
    output = {key: value for key, value in parts[0].items()
              if key not in ("traces", "summary", "leave_one_out")}
    # The summary of the random traces compares each policy on every one of them.
    random_policies = {frozenset(t["policy_hit_rates"]) for part in parts
                       for t in part["traces"].values() if is_random(t)}
    if len(random_policies) > 1:
        raise ValueError(f"{' '.join(map(str, paths))}: random traces replayed with "
                         "different policies")
    names = [name for part in parts for name in part["traces"]]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # one would silently replace the other
        raise ValueError(f"{' '.join(map(str, paths))}: the same trace in more than one: "
                         f"{', '.join(repeated)}")
    output["traces"] = {name: t for part in parts for name, t in part["traces"].items()}
    add_summary(output)
    json.dump(output, sys.stdout, indent=1)
    print()
    return 0
