"""Hit rate against cache size: one replay per (capacity, policy), plus the two references.

``infinite``
    The hit rate with a cache that never evicts: a request hits the longest run of its
    hit-able blocks whose hashes any earlier request has computed ("earlier" in the order
    the mode admits requests: file order, or arrival order in the timeline mode). It does
    not depend on the capacity (nor on pinning), so it is the ceiling of every curve.
``belady``
    Offline-optimal eviction at each capacity, replayed through the same manager with the
    same admission (see :mod:`prefixcache.sim.belady` for the exact definition).

Capacities can be given as shares of the trace's *working set*, its distinct full blocks
(:func:`working_set_blocks`): what a cache that never evicts ends up holding, so shares
compare traces of any size.

Every sweep checks ``infinite >= belady >= policy`` at each capacity and reports any
violation in :attr:`SweepResult.ordering_violations` (the tests assert there are none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixcache.core import EVICTION_POLICIES
from prefixcache.sim.parallel_replays import replay_all
from prefixcache.sim.prepared import PreparedTrace
from prefixcache.sim.replay import BELADY, ReplayConfig, ReplayResult, arrival_order

# Hit rates are compared with this slack: they are ratios of integers computed the same way,
# so only float rounding can separate equal values.
_ORDER_TOLERANCE = 1e-12


def working_set_blocks(prepared: PreparedTrace) -> int:
    """The trace's distinct full blocks (by hash)."""
    return prepared.block_hashes.num_distinct


def capacities_from_spec(spec: Sequence[int | float], working_set: int) -> list[int]:
    """Capacities in blocks, ascending and distinct, from a mix of block counts (ints) and
    shares of ``working_set`` (floats: 0.02 is 2 %, each at least one block)."""
    return sorted({entry if isinstance(entry, int) else max(1, round(entry * working_set))
                   for entry in spec})


def infinite_cache_hit_tokens(prepared: PreparedTrace,
                              order: Sequence[int] | None = None) -> int:
    """Tokens hit when nothing is ever evicted, over the whole trace with requests in
    ``order`` (indices; default file order — the timeline mode's is ``arrival_order``)."""
    chains = prepared.block_hashes
    seen = bytearray(chains.num_distinct)  # by slot: some earlier request computed it
    block_size = prepared.block_size
    num_hit_tokens = 0
    all_max_hit_blocks = prepared.max_hit_blocks
    for index in range(len(chains)) if order is None else order:
        slots = chains.slots(index)
        limit = min(all_max_hit_blocks[index], len(slots))
        k = 0
        # Chains are prefix-closed: a hash seen before implies its whole prefix was seen.
        while k < limit and seen[slots[k]]:
            k += 1
        num_hit_tokens += k * block_size
        for slot in slots[k:]:
            seen[slot] = 1
    return num_hit_tokens


def infinite_cache_hit_rate(prepared: PreparedTrace, timeline: bool = False) -> float:
    """The infinite-cache hit rate, with requests in the order the mode admits them."""
    num_prompt_tokens = prepared.num_prompt_tokens
    if not num_prompt_tokens:
        return 0.0
    order = arrival_order(prepared) if timeline else None
    return infinite_cache_hit_tokens(prepared, order) / num_prompt_tokens


@dataclass(slots=True)
class SweepResult:
    """Curves over ``capacities`` (in blocks): ``policy_to_hit_rates[p][i]`` is policy ``p``
    at ``capacities[i]``; ``belady_hit_rates`` likewise (empty when not computed);
    ``runs`` holds every replay's full figures; ``working_set_blocks`` is the trace's
    (:func:`working_set_blocks`, 0 when not known)."""

    capacities: list[int]
    policies: list[str]
    infinite_hit_rate: float
    working_set_blocks: int = 0
    policy_to_hit_rates: dict[str, list[float]] = field(default_factory=dict)
    belady_hit_rates: list[float] = field(default_factory=list)
    runs: list[ReplayResult] = field(default_factory=list)
    ordering_violations: list[str] = field(default_factory=list)

    def widest_gap(self, policy: str = "lru") -> dict | None:
        """Where Belady beats ``policy`` by most, and how much of that gap the best other
        *online* policy closes there (offline diagnostics never count). None without
        Belady figures."""
        if not self.belady_hit_rates or policy not in self.policy_to_hit_rates:
            return None
        base = self.policy_to_hit_rates[policy]
        gaps = [b - a for a, b in zip(base, self.belady_hit_rates, strict=True)]
        i = max(range(len(gaps)), key=gaps.__getitem__)
        others = {p: rates[i] for p, rates in self.policy_to_hit_rates.items()
                  if p != policy and p in EVICTION_POLICIES}
        best = max(others, key=others.__getitem__) if others else None
        gap = gaps[i]
        return {
            "capacity_blocks": self.capacities[i],
            "baseline_policy": policy,
            "baseline_hit_rate": base[i],
            "belady_hit_rate": self.belady_hit_rates[i],
            "gap": gap,
            "best_policy": best,
            "best_hit_rate": others[best] if best else None,
            "fraction_of_gap_closed": (others[best] - base[i]) / gap if best and gap > 0
            else None,
        }

    def versus(self, policy: str, baseline: str = "lru") -> dict | None:
        """``policy`` against ``baseline``: the share of the widest baseline->Belady gap it
        closes there (None if there is no gap), and its least margin over the baseline
        anywhere on the sweep, in points (negative where it is below). None without
        Belady figures, or without both policies."""
        rates = self.policy_to_hit_rates
        if not self.belady_hit_rates or policy not in rates or baseline not in rates:
            return None
        gap = self.widest_gap(baseline)
        i = self.capacities.index(gap["capacity_blocks"])
        return {
            "widest_gap_capacity_blocks": gap["capacity_blocks"],
            "fraction_of_widest_gap_closed":
                (rates[policy][i] - rates[baseline][i]) / gap["gap"] if gap["gap"] > 0
                else None,
            "min_minus_baseline_points": 100 * min(
                a - b for a, b in zip(rates[policy], rates[baseline], strict=True)),
        }

    def online_versus_lru(self) -> dict[str, dict]:
        """:meth:`versus` ``lru`` for every other online policy of the sweep (empty
        without Belady figures or without ``lru``)."""
        return {policy: figures for policy in self.policies
                if policy != "lru" and policy in EVICTION_POLICIES
                and (figures := self.versus(policy)) is not None}

    def to_dict(self) -> dict:
        return {
            "working_set_blocks": self.working_set_blocks,
            "capacities_blocks": self.capacities,
            "infinite_hit_rate": self.infinite_hit_rate,
            "belady_hit_rates": self.belady_hit_rates,
            "policy_hit_rates": self.policy_to_hit_rates,
            "ordering_violations": self.ordering_violations,
            "widest_gap": self.widest_gap(),
            "versus_lru": self.online_versus_lru(),
            "runs": [run.to_dict() for run in self.runs],
        }


def sweep(prepared: PreparedTrace, capacities: Sequence[int], policies: Sequence[str],
          with_belady: bool = True, concurrency: int = 1, timeline: bool = False,
          decode_tokens_per_s: float | None = None,
          progress: Callable[[int], None] | None = None, jobs: int = 1) -> SweepResult:
    """Replay ``prepared`` at every capacity under every policy (and Belady's), in up to
    ``jobs`` processes (:func:`~prefixcache.sim.parallel_replays.replay_all`: the same
    figures whatever their number).

    ``progress(n)`` is forwarded to the replays, so a bar over
    ``len(capacities) * (len(policies) + with_belady) * num_requests`` steps fills once.
    """
    policies = [p for p in policies if p != BELADY]
    result = SweepResult(list(capacities), list(policies),
                         infinite_cache_hit_rate(prepared, timeline),
                         working_set_blocks(prepared))
    for policy in policies:
        result.policy_to_hit_rates[policy] = []
    extra = {} if decode_tokens_per_s is None else {"decode_tokens_per_s": decode_tokens_per_s}
    configs = [ReplayConfig(num_blocks, policy, concurrency=concurrency, timeline=timeline,
                            **extra)
               for num_blocks in capacities
               for policy in [*policies, *([BELADY] if with_belady else [])]]
    for config, run in zip(configs, replay_all(prepared, configs, progress, jobs),
                           strict=True):
        result.runs.append(run)
        if config.policy == BELADY:
            result.belady_hit_rates.append(run.hit_rate)
        else:
            result.policy_to_hit_rates[config.policy].append(run.hit_rate)
    _check_ordering(result)
    return result


def _check_ordering(result: SweepResult) -> None:
    infinite = result.infinite_hit_rate
    for i, capacity in enumerate(result.capacities):
        ceiling = result.belady_hit_rates[i] if result.belady_hit_rates else infinite
        if result.belady_hit_rates and ceiling > infinite + _ORDER_TOLERANCE:
            result.ordering_violations.append(
                f"{capacity} blocks: belady {ceiling:.6f} > infinite {infinite:.6f}")
        for policy, rates in result.policy_to_hit_rates.items():
            if rates[i] > ceiling + _ORDER_TOLERANCE:
                name = "belady" if result.belady_hit_rates else "infinite"
                result.ordering_violations.append(
                    f"{capacity} blocks: {policy} {rates[i]:.6f} > {name} {ceiling:.6f}")
