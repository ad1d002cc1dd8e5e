"""How likely cached content is to be looked up again: the reuse hazard of a trace.

An online eviction policy can only rank free blocks by what it has seen: how often and how
recently their content was used. This module measures, on a prepared trace, how much those
two signals say about the future, independently of any cache:

    For every *useful* access of a hash (the same definition as Belady's, see
    :mod:`prefixcache.sim.belady`), and an age ``a`` (in requests), consider the accesses
    whose next useful access has not come within ``a`` requests; the hazard is the fraction
    of them whose next one comes within the following ``window`` requests.

Split by whether the access was the hash's first (``first``) or a repeat (``repeat``). A
flat hazard means age carries no information (any order within the class is as good as
LRU); a class with a low hazard at every age is what a policy should evict first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.core import BlockHash
from prefixcache.sim.prepared import PreparedTrace


@dataclass(frozen=True, slots=True)
class ReuseHazard:
    """``first[i]`` and ``repeat[i]`` are the hazards at ``ages[i]`` (None when no access
    qualifies); ``num_first``/``num_repeat`` count the accesses waiting at ``ages[0]``."""

    ages: tuple[int, ...]
    window: int
    first: tuple[float | None, ...]
    repeat: tuple[float | None, ...]
    num_first: int
    num_repeat: int

    def to_dict(self) -> dict:
        return {
            "ages_requests": list(self.ages),
            "window_requests": self.window,
            "first_access": [None if h is None else round(h, 4) for h in self.first],
            "repeat_access": [None if h is None else round(h, 4) for h in self.repeat],
            "num_first_accesses": self.num_first,
            "num_repeat_accesses": self.num_repeat,
        }


def reuse_hazard(prepared: PreparedTrace, ages: Sequence[int] = (0, 100, 200, 400, 800),
                 window: int = 100) -> ReuseHazard:
    """The reuse hazard of ``prepared`` in file order (module docstring)."""
    if window < 1 or any(a < 0 for a in ages):
        raise ValueError("window must be >= 1 and ages >= 0")
    hash_to_uses: dict[BlockHash, list[int]] = {}
    for index, (hashes, max_hit_blocks) in enumerate(
            zip(prepared.block_hashes, prepared.max_hit_blocks, strict=True)):
        for block_hash in hashes[:max_hit_blocks]:
            uses = hash_to_uses.get(block_hash)
            if uses is None:
                hash_to_uses[block_hash] = [index]
            else:
                uses.append(index)
    num_requests = len(prepared.block_hashes)
    # Per class and age: [accesses still waiting at that age, of which reused in the window].
    counts = {cls: [[0, 0] for _ in ages] for cls in ("first", "repeat")}
    for uses in hash_to_uses.values():
        for k, index in enumerate(uses):
            gap = uses[k + 1] - index if k + 1 < len(uses) else None
            rows = counts["first" if k == 0 else "repeat"]
            for row, age in zip(rows, ages, strict=True):
                if index + age + window > num_requests:
                    continue  # the trace ends before the window does: no verdict
                if gap is None or gap >= age:
                    row[0] += 1
                    if gap is not None and gap < age + window:
                        row[1] += 1

    def hazards(rows: list[list[int]]) -> tuple[float | None, ...]:
        return tuple(reused / waiting if waiting else None for waiting, reused in rows)

    return ReuseHazard(
        ages=tuple(ages), window=window,
        first=hazards(counts["first"]), repeat=hazards(counts["repeat"]),
        num_first=counts["first"][0][0] if ages else 0,
        num_repeat=counts["repeat"][0][0] if ages else 0,
    )
