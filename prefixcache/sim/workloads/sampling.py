"""Random draws every workload family uses, all from one seeded ``random.Random``."""

from __future__ import annotations

import bisect
import itertools
import math
import random


def lognormal_tokens(rng: random.Random, median: int, sigma: float = 0.5,
                     low: int = 1, high: int | None = None) -> int:
    """A token count around ``median`` (log-normal, spread ``sigma``) within
    [``low``, ``high``]."""
    value = int(round(median * math.exp(rng.gauss(0.0, sigma))))
    if high is not None:
        value = min(value, high)
    return max(low, value)


def geometric(rng: random.Random, mean: float) -> int:
    """A count >= 1 with the given mean (geometric)."""
    if mean <= 1.0:
        return 1
    p = 1.0 / mean
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


class ZipfChooser:
    """Draws item indices 0 .. n-1 with probability proportional to 1 / rank ** ``s``;
    which item holds which rank is a random permutation, redrawn by :meth:`reshuffle`
    (popularity drift)."""

    def __init__(self, rng: random.Random, num_items: int, s: float) -> None:
        if num_items < 1:
            raise ValueError("need at least one item")
        self.rng = rng
        weights = [1.0 / (rank + 1) ** s for rank in range(num_items)]
        self.cumulative = list(itertools.accumulate(weights))
        self.rank_to_item = list(range(num_items))
        self.reshuffle()

    def reshuffle(self) -> None:
        self.rng.shuffle(self.rank_to_item)

    def draw(self) -> int:
        rank = bisect.bisect_left(self.cumulative, self.rng.random() * self.cumulative[-1])
        return self.rank_to_item[min(rank, len(self.rank_to_item) - 1)]


def pareto_count(rng: random.Random, tail_index: float, high: int) -> int:
    """A count in [1, ``high``] with P(count >= k) = k ** -``tail_index`` (discrete
    Pareto, truncated): mostly 1 or 2, with a long tail."""
    return min(high, int((1.0 - rng.random()) ** (-1.0 / tail_index)))
