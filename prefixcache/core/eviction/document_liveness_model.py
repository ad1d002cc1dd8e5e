"""The estimator behind ``document-liveness``: how likely a document is to be asked about
again, and how much of its prompt the next request shares.

Time counts finished requests. A *state* is a document having just had its ``k``-th
request; it gets a *class*, and later either a continuation (the document's next request)
or nothing yet. The model, fitted online:

- A document in a given class gets another request with probability ``p`` (learned per
  class). Classes are bit lengths of features any engine has, so that no threshold is
  tuned to a trace: after the first request, the tokens it generated and its prompt
  length; after a later one, how much the document's prompt lengths have varied so far
  and ``min(k, max_count)``. Each estimate is shrunk towards its coarser class (first
  request or later one, then the first feature alone).
- An alive document's next request arrives at the same rate ``h(t)`` per request as any
  other's; the rate drifts, so it is fitted per bin of ``hazard_bin`` releases.
- The *clock* ``H``, by which a document's silence lowers its standing, advances by the
  latest fitted rate per request, times the wait's *shape* when that is above 1: ``ln 2 *
  mean / median`` of the waits (in requests) that have ended among the states kept, once
  there are :data:`MIN_ENDED_WAITS`. One rate means an exponential wait, whose median is
  ``ln 2`` times its mean; where most next requests come soon and a long tail sets the
  mean, a fitted rate counts the first requests of silence for too little, and a short
  silence already says much of what a long one does.
- ``r(d)``: the share of blocks at depth class ``d`` that a document's next request
  shared, ``d`` being the bit length of the block's distance in tokens from its prompt's
  end (so classes mean the same at any block size), capped at ``max_depth_bits``.

``p`` and ``h`` are fitted together by expectation-maximisation every ``refit_every``
finished requests, over at most the last ``max_states`` states (cut back to half when
full): a state that continued has weight 1; one still waiting counts with its posterior
chance of being alive, ``p·S / (p·S + 1 - p)`` with ``S = exp(-(H(now) - H(start)))``;
the rate per bin is continuations over alive exposure; the shape is taken after each fit.
The fit runs in C where the package was built with a compiler (``_liveness_fit_native.c``:
it runs over every state kept, several passes, every few requests), in Python otherwise,
with the same estimates to the last bit; the rest is plain Python, as the whole core.
"""

from __future__ import annotations

import bisect
import math
from array import array

from prefixcache.core.hashing import BlockHash

try:
    from prefixcache.core.eviction._liveness_fit_native import fit as _c_fit
except ImportError:  # built without a C compiler: the Python fit gives the same estimates
    _c_fit = None

#: Ended waits the clock needs before it follows their shape: fewer say little about it.
MIN_ENDED_WAITS = 20
#: An exponential wait's median over its mean: the shape one fitted rate assumes.
EXPONENTIAL_MEDIAN_OVER_MEAN = math.log(2)


def logit(p: float) -> float:
    """log(p / (1 - p)), with ``p`` clipped to [1e-4, 1 - 1e-4] to stay finite."""
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    return math.log(p / (1.0 - p))


# Hashes of a document's latest prompt kept to see what its next request shares: the
# last ones only (the question is at the end), so memory per document stays small.
KEPT_TAIL_HASHES = 64


def tail_blocks_shared(previous_num_blocks: int, previous_tail_hashes: list[BlockHash],
                       new_hashes: list[BlockHash]) -> int:
    """How many of the given last hashes of a previous prompt of ``previous_num_blocks``
    full blocks are in the prefix ``new_hashes`` shares with it, counted from the tail's
    first. Hashes chain, so what two prompts share is a common prefix: a binary search on
    the positions they have in common finds it."""
    num_tail = len(previous_tail_hashes)
    tail_start = previous_num_blocks - num_tail  # the tail's first block's position
    low, high = 0, num_tail
    while low < high:
        middle = (low + high) // 2
        position = tail_start + middle
        if position < len(new_hashes) and new_hashes[position] == previous_tail_hashes[middle]:
            low = middle + 1
        else:
            high = middle
    return low


class DocumentHistory:
    """What the policy remembers of one document: its requests so far, its first
    request's lengths, the range of its prompt lengths, its latest state in the model, and
    its latest prompt (how many full blocks, and the hashes of the last
    :data:`KEPT_TAIL_HASHES` of them), and how many conversations it has had and which
    were the latest (for a
    :class:`~prefixcache.core.eviction.conversation_tracker.ConversationTracker`)."""

    __slots__ = ("num_requests", "first_output_tokens", "first_prompt_tokens",
                 "min_prompt_tokens", "max_prompt_tokens", "state_id",
                 "num_prompt_blocks", "prompt_tail_hashes", "num_conversations",
                 "recent_conversations")

    def __init__(self, prompt_tokens: int, output_tokens: int) -> None:
        self.num_requests = 0
        self.first_output_tokens = output_tokens
        self.first_prompt_tokens = prompt_tokens
        self.min_prompt_tokens = self.max_prompt_tokens = prompt_tokens
        self.state_id = -1  # its latest state in the model; -1 before the first request
        # Its latest prompt: how many full blocks, and the hashes of the last of them.
        self.num_prompt_blocks = 0
        self.prompt_tail_hashes: list[BlockHash] = []
        self.num_conversations = 0
        # Its latest conversations, the latest first (a ConversationTracker's, if it
        # keeps them).
        self.recent_conversations: list = []


class DocumentLivenessModel:
    """The online estimate of ``p`` per class, of the request rate ``h(t)``, of ``r(d)``,
    and the clock ``H`` (module docstring).

    Time counts finished requests (:meth:`tick`). A *state* is a document having just
    had a request: it gets a class, and later either a continuation (the document's next
    request) or nothing yet. Tuning: ``refit_every`` releases between fits,
    ``em_iterations`` per fit, ``prior_weight`` of the coarser class in each estimate,
    ``hazard_bin`` releases per rate bin, ``max_count`` where the request count stops
    splitting classes, ``max_depth_bits`` where depth classes merge, ``max_states``
    states kept; ``follow_wait_shape=False`` makes the clock advance by the fitted rate
    alone (one rate: an exponential wait). ``num_fits`` counts the fits, so a caller can
    tell when estimates moved; ``rate`` is the latest fitted rate, ``wait_shape`` the
    factor the clock applies to it (1 until it has :data:`MIN_ENDED_WAITS` ended waits).
    """

    #: The fit in C (None: in Python; the same estimates either way).
    native_fit = staticmethod(_c_fit) if _c_fit is not None else None

    def __init__(self, *, refit_every: int = 25, em_iterations: int = 4,
                 prior_weight: float = 8.0, hazard_bin: int = 200, max_count: int = 8,
                 max_depth_bits: int = 12, max_states: int = 5_000,
                 initial_rate: float = 0.002, follow_wait_shape: bool = True) -> None:
        for name, value, smallest in (("refit_every", refit_every, 1),
                                      ("em_iterations", em_iterations, 1),
                                      ("hazard_bin", hazard_bin, 1),
                                      ("max_count", max_count, 1),
                                      ("max_depth_bits", max_depth_bits, 0),
                                      ("max_states", max_states, 2)):
            if not isinstance(value, int) or value < smallest:
                raise ValueError(f"{name} must be an integer >= {smallest}, got {value!r}")
        for name, value in (("prior_weight", prior_weight), ("initial_rate", initial_rate)):
            if not value > 0 or math.isinf(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.refit_every = refit_every
        self.em_iterations = em_iterations
        self.prior_weight = prior_weight
        self.hazard_bin = hazard_bin
        self.max_count = max_count
        self.max_depth_bits = max_depth_bits
        self.max_states = max_states
        self.follow_wait_shape = follow_wait_shape
        self.num_fits = 0
        self.now = 0
        self.clock = 0.0  # H(now), advanced by rate * wait_shape at every tick
        self.rate = initial_rate
        self.wait_shape = 1.0
        self.overall_p = 0.5  # the root class's estimate
        # Classes: three levels, each class with an id and its parent's id one level up.
        self._class_ids: list[dict[tuple, int]] = [{}, {}, {}]
        self._class_parents: list[list[int]] = [[], [], []]
        # The id path of each finest class met (a class's path never changes).
        self._id_paths: dict[tuple, tuple[int, int, int]] = {}
        self._leaf_p: list[float] = []  # per finest class; overall_p until fitted
        # logit of each, and of overall_p, computed once per fit: keys read them often.
        self._leaf_log_odds: list[float] = []
        self.overall_log_odds = logit(self.overall_p)
        # States, oldest first; ids are absolute, index = id - _first_state_id. Kept in
        # arrays of 64-bit ints, which the C fit reads as they are, where lists would
        # have it convert every Python int at every fit.
        self._first_state_id = 0
        # Each state's class id at each level, coarsest first.
        self._state_class_ids: tuple[array, array, array] = (
            array("q"), array("q"), array("q"))
        self._state_start = array("q")
        self._state_continued_at = array("q")  # -1 while waiting
        # The waits that have ended among the states kept, in order, and their sum: the
        # wait's shape is taken from them after every fit.
        self._ended_waits: list[int] = []
        self._ended_waits_total = 0
        # Rates per bin of `hazard_bin` releases, from bin `_first_bin` on.
        self._first_bin = 0
        self._bin_rates = [initial_rate]
        self._last_fit = 0
        # Blocks per depth class (from the end of a prompt), and how many of them the
        # next request shared; starts at 1 of 2 (a uniform prior).
        self._depth_shared = [1.0] * (max_depth_bits + 1)
        self._depth_seen = [2.0] * (max_depth_bits + 1)

    # -- classes ------------------------------------------------------------------------

    def finest_class_key(self, document: DocumentHistory) -> tuple:
        """The document's finest class; its first one and first two items are its coarser
        classes."""
        if document.num_requests == 1:
            return ("first", document.first_output_tokens.bit_length(),
                    document.first_prompt_tokens.bit_length())
        return ("again",
                (document.max_prompt_tokens - document.min_prompt_tokens).bit_length(),
                min(document.num_requests, self.max_count))

    def _class_id_path(self, finest_key: tuple) -> tuple[int, int, int]:
        """The ids of the classes on the path to ``finest_key``, coarsest first (each
        class numbered when first met)."""
        path = self._id_paths.get(finest_key)
        if path is not None:
            return path
        ids = []
        parent = -1
        for level, key in enumerate((finest_key[:1], finest_key[:2], finest_key)):
            class_ids = self._class_ids[level]
            class_id = class_ids.get(key)
            if class_id is None:
                class_id = class_ids[key] = len(class_ids)
                self._class_parents[level].append(parent)
                if level == 2:
                    self._leaf_p.append(self.overall_p)
                    self._leaf_log_odds.append(self.overall_log_odds)
            ids.append(class_id)
            parent = class_id
        path = self._id_paths[finest_key] = (ids[0], ids[1], ids[2])
        return path

    # -- events -------------------------------------------------------------------------

    def tick(self) -> None:
        """A request finished: time and the clock move on."""
        self.now += 1
        self.clock += self.rate * self.wait_shape

    def new_state(self, document: DocumentHistory) -> int:
        """``document`` just had a request (``num_requests`` already counted): close its
        previous state as continued, open a new one; returns its id."""
        previous = document.state_id - self._first_state_id
        if document.state_id >= 0 and previous >= 0:
            self._state_continued_at[previous] = self.now
            wait = self.now - self._state_start[previous]
            bisect.insort(self._ended_waits, wait)
            self._ended_waits_total += wait
        coarsest, middle, finest = self._class_id_path(self.finest_class_key(document))
        coarsest_ids, middle_ids, finest_ids = self._state_class_ids
        coarsest_ids.append(coarsest)
        middle_ids.append(middle)
        finest_ids.append(finest)
        self._state_start.append(self.now)
        self._state_continued_at.append(-1)
        if len(self._state_start) > self.max_states:
            drop = len(self._state_start) - self.max_states // 2
            for class_ids in self._state_class_ids:
                del class_ids[:drop]
            del self._state_start[:drop], self._state_continued_at[:drop]
            self._ended_waits = sorted(at - start for start, at in zip(
                self._state_start, self._state_continued_at, strict=True) if at >= 0)
            self._ended_waits_total = sum(self._ended_waits)
            self._first_state_id += drop
        if self.now - self._last_fit >= self.refit_every:
            self._fit()
            self._last_fit = self.now
        return self._first_state_id + len(self._state_start) - 1

    def finest_class(self, state_id: int) -> int:
        """The id of the state's finest class (ids are never reused)."""
        return self._state_class_ids[2][state_id - self._first_state_id]

    def class_probability(self, finest_class: int) -> float:
        """``p`` of a finest class: the chance its documents get another request."""
        return self._leaf_p[finest_class]

    def class_log_odds(self, finest_class: int) -> float:
        """``logit(p)`` of a finest class (:func:`logit` of :meth:`class_probability`)."""
        return self._leaf_log_odds[finest_class]

    @property
    def all_class_log_odds(self) -> list[float]:
        """:meth:`class_log_odds` of every finest class, by id (the model's own list:
        read it, do not change it)."""
        return self._leaf_log_odds

    def depth_class(self, blocks_from_end: int, block_size: int) -> int:
        """The depth class of a block ``blocks_from_end`` blocks before a prompt's last
        full block: the bit length of that distance in tokens, capped."""
        return min((blocks_from_end * block_size).bit_length(), self.max_depth_bits)

    def depth_class_runs(self, num_blocks: int, block_size: int) -> list[tuple[int, int, int]]:
        """The depth classes of a prompt of ``num_blocks`` full blocks as runs
        ``(depth class, first, end)`` of distances from its last block, nearest first:
        a class covers a range of distances, so a prompt has at most
        ``max_depth_bits + 1`` runs."""
        runs = []
        distance = 0
        while distance < num_blocks:
            depth = self.depth_class(distance, block_size)
            # The distances of class d < max_depth_bits: distance * block_size < 2**d.
            end = (num_blocks if depth >= self.max_depth_bits
                   else min(num_blocks, ((1 << depth) - 1) // block_size + 1))
            runs.append((depth, distance, end))
            distance = end
        return runs

    def depth_classes(self, num_blocks: int, block_size: int) -> list[int]:
        """The depth class of each of a prompt's ``num_blocks`` full blocks, first block
        first."""
        classes = []
        for depth, first, end in reversed(self.depth_class_runs(num_blocks, block_size)):
            classes += [depth] * (end - first)
        return classes

    def observe_next_request(self, previous_num_blocks: int,
                             previous_tail_hashes: list[BlockHash],
                             new_hashes: list[BlockHash], block_size: int) -> None:
        """A document's next request came: count, per depth class of its previous
        prompt's ``previous_num_blocks`` blocks (of which the hashes of the last ones are
        given), the blocks it shared.

        The tail's blocks the next prompt shares are counted by
        :func:`tail_blocks_shared`; a block before the given tail is shared exactly when
        the tail's first block is — unless the prompts part inside that deep stretch,
        which then counts as not shared."""
        num_tail = len(previous_tail_hashes)
        num_tail_shared = tail_blocks_shared(previous_num_blocks, previous_tail_hashes,
                                             new_hashes)
        # The tail's block at distance d from the end is shared when d >= this.
        nearest_shared = num_tail - num_tail_shared
        seen, shared_counts = self._depth_seen, self._depth_shared
        for depth, first, end in self.depth_class_runs(previous_num_blocks, block_size):
            seen[depth] += end - first
            shared_in_tail = min(end, num_tail) - max(first, nearest_shared)
            if shared_in_tail > 0:
                shared_counts[depth] += shared_in_tail
            if num_tail_shared and end > num_tail:
                shared_counts[depth] += end - max(first, num_tail)

    def log_share_reached(self, depth: int) -> float:
        """log r(depth): how often the next request shares a block of this depth class."""
        return math.log(self._depth_shared[depth] / self._depth_seen[depth])

    # -- fitting --------------------------------------------------------------------------

    def _fit(self) -> None:
        """Refit ``p`` per class and the rate per bin by EM over the states kept: in C
        where the package was built with a compiler (``native_fit``, from
        ``_liveness_fit_native.c``), else in Python; the estimates are the same to the
        last bit either way."""
        first_bin, origin, rates = self._fit_window()
        if self.native_fit is None:
            leaf_p, overall, rates = self._fit_in_python(origin, rates)
        else:
            leaf_p, overall, rates = self.native_fit(
                self._state_start, self._state_continued_at, self._state_class_ids,
                self._class_parents, self._leaf_p, rates, self.now, origin,
                self.hazard_bin, self.prior_weight, self.overall_p, self.em_iterations)
        self._adopt_fit(leaf_p, overall, first_bin, rates)

    def _fit_in_python(self, origin: int, rates: list[float]
                       ) -> tuple[list[float], float, list[float]]:
        """The EM fit from the rates per bin from ``origin``'s bin on: ``p`` per finest
        class, the overall ``p`` and the rates.

        Plain Python, as the whole core (no numpy): one pass over the states and one over
        the releases they span per iteration. What does not change between iterations
        (each waiting state's bins, the trials per class, the continuations per bin) is
        computed once. Every float sum is taken in state or release order, as one loop
        over them would: the fit must not depend on how it is computed."""
        now = self.now
        width = self.hazard_bin
        starts = self._state_start  # in time order: the first is the earliest
        continued_at = self._state_continued_at
        leaves = self._state_class_ids[2]
        num_bins = len(rates)
        last_bin = num_bins - 1
        span = now - origin + 1  # the releases the states span, from offset 0
        leaf_p = self._leaf_p
        start_offsets = [start - origin for start in starts]
        end_offsets = [(at if at >= 0 else now) - origin for at in continued_at]
        # Where each waiting state's wait starts and ends: (bin, offset into the bin),
        # for H(offset) = H(bin start) + rate of the bin * offset into it (the last bin's
        # rate beyond it).
        waiting = []
        for index, (start, end, at) in enumerate(zip(start_offsets, end_offsets,
                                                     continued_at, strict=True)):
            if at < 0:
                start_bin = min(start // width, last_bin)
                end_bin = min(end // width, last_bin)
                waiting.append((index, leaves[index], start_bin,
                                start - start_bin * width, end_bin, end - end_bin * width))
        events = [0] * num_bins  # continuations per bin: the same in every iteration
        for at in continued_at:
            if at >= 0:
                events[(at - origin) // width] += 1
        num_classes = [len(ids) for ids in self._class_ids]
        class_of_level = self._state_class_ids
        trials_of_level = []
        for level in range(3):
            trials = [0] * num_classes[level]
            for class_id in class_of_level[level]:
                trials[class_id] += 1
            trials_of_level.append(trials)
        bin_ends = [min((j + 1) * width, span) for j in range(num_bins)]
        prior_weight = self.prior_weight
        overall = self.overall_p
        exp = math.exp
        for _ in range(self.em_iterations):
            # E: the chance each waiting state's document is still alive.
            at_bin_start = [0.0]
            for rate in rates:
                at_bin_start.append(at_bin_start[-1] + rate * width)
            weights = [1.0] * len(starts)
            for index, leaf, start_bin, start_in, end_bin, end_in in waiting:
                p = leaf_p[leaf]
                alive = p * exp((at_bin_start[start_bin] + rates[start_bin] * start_in)
                                - (at_bin_start[end_bin] + rates[end_bin] * end_in))
                weights[index] = alive / max(alive + 1.0 - p, 1e-12)
            # M: p per class, each shrunk towards its parent's.
            # Summed left to right: sum() compensates rounding since Python 3.12.
            total = 0.0
            for weight in weights:
                total += weight
            overall = (total + 1.0) / (len(weights) + 2.0)
            estimates: list[list[float]] = []
            for level in range(3):
                successes = [0.0] * num_classes[level]
                for weight, class_id in zip(weights, class_of_level[level], strict=True):
                    successes[class_id] += weight
                trials = trials_of_level[level]
                parents = self._class_parents[level]
                estimates.append([
                    (successes[c] + prior_weight * (overall if level == 0
                                                    else estimates[-1][parents[c]]))
                    / (trials[c] + prior_weight)
                    for c in range(num_classes[level])])
            leaf_p = estimates[2]
            # M: the rate per bin, continuations over the expected alive exposure.
            change = [0.0] * (span + 1)
            for start, end, weight in zip(start_offsets, end_offsets, weights, strict=True):
                change[start] += weight
                change[end] -= weight
            exposure = [0.0] * num_bins
            alive_count = 0.0
            offset = 0
            for j, bin_end in enumerate(bin_ends):
                in_bin = 0.0
                for delta in change[offset:bin_end]:
                    alive_count += delta
                    in_bin += alive_count
                exposure[j] = in_bin
                offset = bin_end
            rates = [(events[j] + 0.5) / (exposure[j] + 1.0) if exposure[j] > 0 else rates[j]
                     for j in range(num_bins)]
        return leaf_p, overall, rates

    def _fit_window(self) -> tuple[int, int, list[float]]:
        """The bins a fit spans: its first bin, that bin's first release, and the rates to
        start from, one per bin (the previous fit's where its bins overlap, else its last
        one)."""
        width = self.hazard_bin
        first_bin = self._state_start[0] // width
        num_bins = self.now // width - first_bin + 1
        previous = self._bin_rates
        rates = [previous[j - self._first_bin]
                 if 0 <= j - self._first_bin < len(previous) else previous[-1]
                 for j in range(first_bin, first_bin + num_bins)]
        return first_bin, first_bin * width, rates

    def _adopt_fit(self, leaf_p: list[float], overall: float, first_bin: int,
                   rates: list[float]) -> None:
        """Make a fit's estimates the current ones: ``p`` per finest class, the overall
        ``p``, the rates per bin from ``first_bin`` on, and from them the rate and the
        wait's shape the clock follows."""
        self._leaf_p = leaf_p
        self.overall_p = overall
        self._leaf_log_odds = [logit(p) for p in leaf_p]
        self.overall_log_odds = logit(overall)
        self.num_fits += 1
        self._first_bin = first_bin
        self._bin_rates = rates
        # The latest bin once it is at least half full, else the one before.
        now, width, num_bins = self.now, self.hazard_bin, len(rates)
        elapsed_in_last = now - (now // width) * width
        latest = num_bins - 1 if elapsed_in_last >= width / 2 or num_bins == 1 else num_bins - 2
        self.rate = rates[latest]
        if self.follow_wait_shape:
            self.wait_shape = self._ended_wait_shape()

    def _ended_wait_shape(self) -> float:
        """``ln 2 * mean / median`` of the ended waits among the states kept, at least 1;
        1 while fewer than :data:`MIN_ENDED_WAITS` have ended."""
        waits = self._ended_waits  # in order
        num_waits = len(waits)
        if num_waits < MIN_ENDED_WAITS:
            return 1.0
        middle = num_waits // 2
        # As statistics.median: the middle one, or the mean of the middle two.
        median = waits[middle] if num_waits % 2 else (waits[middle - 1] + waits[middle]) / 2
        mean = self._ended_waits_total / num_waits  # exact: the waits are integers
        return max(1.0, EXPONENTIAL_MEDIAN_OVER_MEAN * mean / max(median, 1))

    def class_estimates(self) -> list[dict]:
        """Per middle-level class (after a first request, by tokens it generated; after a
        later one, by how much the document's prompt lengths varied), first requests
        first: states kept, states continued, and the estimated ``p`` averaged over its
        states. For reports."""
        rows: dict[tuple, dict] = {}
        middle_keys = {class_id: key for key, class_id in self._class_ids[1].items()}
        _, middles, leaves = self._state_class_ids
        for middle, leaf, continued_at in zip(middles, leaves, self._state_continued_at,
                                              strict=True):
            row = rows.setdefault(middle_keys[middle], {"states": 0, "continued": 0,
                                                        "p_sum": 0.0})
            row["states"] += 1
            row["continued"] += continued_at >= 0
            row["p_sum"] += self._leaf_p[leaf]
        return [{"class": list(key), "states": row["states"], "continued": row["continued"],
                 "estimated_p": row["p_sum"] / row["states"]}
                for key, row in sorted(rows.items(),
                                       key=lambda item: (item[0][0] != "first", item[0][1]))]
