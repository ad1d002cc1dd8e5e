"""Replaying a prepared trace through the real :class:`~prefixcache.core.KVCacheManager`.

Each admitted request is looked up (``get_computed_blocks``), allocated its prompt plus its
decode slots in one ``allocate_slots`` call (a prefill is one step here: compute time is
not modelled, only where KV lives), given its ``output_length`` generated tokens, held
while it is live, then freed. Two modes:

sequential (``concurrency=C``)
    Requests are admitted in file order; at most ``C`` are live, and admitting one more
    first frees the oldest. If a request does not fit beside the live ones, the oldest are
    freed (they finish early) until it does: it *waits*, and counts as delayed.
timeline
    Requests arrive at their ``timestamp`` (stable-sorted) and stay live for
    ``output_length / decode_tokens_per_s`` seconds. One that does not fit waits in a FIFO
    queue (head of line blocks, like a first-come scheduler) until finishing requests free
    enough blocks; it counts as delayed and its wait is reported.

A request whose block table alone exceeds the cache can never be admitted: it is
*rejected* (counted, never replayed) in both modes. Hit rates are always over the prompt
tokens of *every* request, so a rejected request counts as all misses.

Because admission depends only on the number of free blocks, which every policy leaves
the same (see :mod:`prefixcache.sim.belady`), all policies admit the same requests in the
same order; only their hits differ.

A capacity above the trace's whole demand (:func:`num_blocks_to_simulate`) is replayed
with a pool of just that demand: the figures are the same, and a capacity of 10**20
blocks costs no more memory than the trace itself.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prefixcache.core import (
    EVICTION_POLICIES,
    FreeKVCacheBlockQueue,
    FreeQueueFactory,
    KVCacheManager,
    Request,
)
from prefixcache.core.block_pool import BlockHashToBlockMap
from prefixcache.sim.belady import BeladyFreeBlockQueue, FutureUses
from prefixcache.sim.dead_content import DEAD_CONTENT_KINDS, DeadContentFirstFreeBlockQueue
from prefixcache.sim.prepared import PreparedTrace

BELADY = "belady"
# Offline references and diagnostics: free queues built from the pool's blocks, the trace's
# future and the pool's hash map (through the pool's free-queue factory), each with a
# ``now`` attribute the replay keeps at the latest admission index.
OFFLINE_POLICIES: dict[str, Callable[[list, FutureUses, BlockHashToBlockMap],
                                     FreeKVCacheBlockQueue]] = {
    BELADY: BeladyFreeBlockQueue,
    **{name: (lambda blocks, future, cached, kind=kind:
              DeadContentFirstFreeBlockQueue(blocks, future, kind))
       for name, kind in DEAD_CONTENT_KINDS.items()},
}
DEFAULT_DECODE_TOKENS_PER_S = 50.0
# The slowest decode a timeline replay accepts, a round bound far from where lifetimes
# overflow to infinity (and usages to NaN): a request at the trace's output limit (2**24
# tokens) then lives about 530 years, a finite number of seconds.
MIN_DECODE_TOKENS_PER_S = 1e-3
_PROGRESS_EVERY = 64
_PLACEHOLDER_TOKEN_ID = 0


def arrival_order(prepared: PreparedTrace) -> list[int]:
    """Request indices in the order the timeline mode admits them: by ``timestamp``, ties in
    file order (a stable sort). Raises ValueError if a request has no timestamp."""
    timestamps = [request.timestamp_ms for request in prepared.requests]
    if any(t is None for t in timestamps):
        raise ValueError("the timeline mode needs a timestamp on every request")
    return sorted(range(len(timestamps)), key=timestamps.__getitem__)


def num_blocks_to_simulate(prepared: PreparedTrace, num_blocks: int) -> int:
    """The pool size that replays a cache of ``num_blocks`` exactly: ``num_blocks``, or
    the trace's demand — every request's block table summed — when that is smaller.

    Why a pool of the demand gives every figure of a larger one: every request is then
    admissible, and a request allocates at most its block table, so all the blocks ever
    taken from the free queue number at most the demand. Every policy takes a block that
    holds nothing cached (never used, or freed without a hash) before evicting cached
    content — ``lru`` has the never-used blocks at its head, the others put hashless
    blocks first — and such blocks never run out: nothing is evicted, nobody waits, in
    either pool. Hits, admissions, delays, waits and blocks in use are then the same;
    only block ids differ. (The policies' size-dependent knobs — learned-reuse's decay,
    2q's protected share and both ghost lists — act only after evictions or on more
    insertions than the demand, and placement alone cannot change a hit.)
    """
    demand = sum(prepared.blocks_needed)
    return min(num_blocks, max(demand, 1))


def policy_names() -> list[str]:
    """Every policy a replay accepts: the core's online policies, then the offline ones
    (``belady`` and the dead-content diagnostics of :mod:`prefixcache.sim.dead_content`)."""
    return [*EVICTION_POLICIES, *OFFLINE_POLICIES]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """What one replay simulates. ``concurrency`` applies to the sequential mode only;
    ``decode_tokens_per_s`` to the timeline mode only."""

    num_blocks: int
    policy: str = "lru"
    concurrency: int = 1
    timeline: bool = False
    decode_tokens_per_s: float = DEFAULT_DECODE_TOKENS_PER_S

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.policy not in policy_names():
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose one of "
                             f"{', '.join(policy_names())}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not MIN_DECODE_TOKENS_PER_S <= self.decode_tokens_per_s < float("inf"):
            raise ValueError(f"decode_tokens_per_s must be a finite number >= "
                             f"{MIN_DECODE_TOKENS_PER_S:g}, got {self.decode_tokens_per_s}")

    @property
    def mode(self) -> str:
        return "timeline" if self.timeline else "sequential"


@dataclass(slots=True)
class ReplayResult:
    """Figures of one replay. Usages are fractions of ``num_blocks`` held by live requests:
    the mean is per admission (sequential) or time-weighted (timeline)."""

    policy: str
    num_blocks: int  # the capacity asked for, whatever pool replayed it
    block_size: int
    mode: str
    concurrency: int | None
    num_requests: int
    num_admitted_requests: int
    num_rejected_requests: int
    num_delayed_requests: int
    num_prompt_tokens: int
    num_hit_tokens: int
    hit_rate: float
    num_evictions: int
    num_blocks_allocated: int
    peak_usage: float
    mean_usage: float
    mean_wait_s: float | None
    replay_seconds: float
    requests_per_s: float
    blocks_per_s: float
    # What a learning policy learned by the end (its free queue's ``policy_state()``:
    # learned-reuse's per-signature table and overall reuse rate, document-liveness's
    # classes), or None.
    policy_state: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class _Replay:
    """State of one replay; :meth:`run` drives it. Not reusable."""

    def __init__(self, prepared: PreparedTrace, config: ReplayConfig,
                 progress: Callable[[int], None] | None) -> None:
        self.prepared = prepared
        self.config = config
        self.progress = progress
        expander = prepared.expander
        blocks_needed = prepared.blocks_needed
        order = arrival_order(prepared) if config.timeline else range(len(prepared.requests))
        self.admissible = [i for i in order if blocks_needed[i] <= config.num_blocks]
        self.num_pool_blocks = num_blocks_to_simulate(prepared, config.num_blocks)
        self.manager = KVCacheManager(
            self.num_pool_blocks, expander.block_size, hash_algo=expander.hash_algo,
            hash_seed=expander.hash_seed, eviction_policy=config.policy,
            free_queue_factory=self._offline_queue_factory(),
        )
        self.offline_queue = (self.manager.block_pool.free_block_queue
                              if config.policy in OFFLINE_POLICIES else None)
        self.num_admitted = 0
        self.num_hit_tokens = 0
        self.num_blocks_allocated = 0
        self.num_delayed = 0
        self.peak_usage = 0.0
        self._since_progress = 0

    def _offline_queue_factory(self) -> FreeQueueFactory | None:
        """The factory of the offline policy being replayed, which knows the admitted
        requests' future; None for an online policy (the pool builds it by name)."""
        build = OFFLINE_POLICIES.get(self.config.policy)
        if build is None:
            return None
        prepared = self.prepared
        chains, max_hit_blocks = prepared.block_hashes, prepared.max_hit_blocks
        future = FutureUses((chains[i] for i in self.admissible),
                            (max_hit_blocks[i] for i in self.admissible))
        return lambda blocks, cached: build(blocks, future, cached)

    def _usage(self) -> float:
        """Fraction of the requested capacity held by live requests (the pool may be
        smaller than the capacity; see :func:`num_blocks_to_simulate`)."""
        num_used = self.num_pool_blocks - self.manager.block_pool.get_num_free_blocks()
        return num_used / self.config.num_blocks

    def _make_request(self, index: int) -> Request:
        prepared = self.prepared
        request = Request(str(index),
                          prepared.expander.prompt_token_ids(prepared.requests[index]))
        # Hashes computed once by the expander; the manager's hasher (same algorithm and
        # seed) then finds every full block already hashed.
        request.block_hashes.extend(prepared.block_hashes[index])
        return request

    def _try_admit(self, index: int, request: Request) -> bool:
        """Look up and allocate ``request``; False, with nothing changed, if it can't fit."""
        manager = self.manager
        if self.offline_queue is not None:
            self.offline_queue.now = self.num_admitted
        blocks, num_hit_tokens = manager.get_computed_blocks(request)
        new_blocks = manager.allocate_slots(
            request, request.num_tokens - num_hit_tokens, num_hit_tokens, blocks,
            num_lookahead_tokens=self.prepared.num_decode_slots(index))
        if new_blocks is None:
            return False
        request.num_computed_tokens = request.num_tokens
        # Its decoding, as far as the cache can tell: the trace's output length in
        # placeholder tokens (never cached: no allocation follows), so the freed request
        # reports what it generated, as a finished one does in the engine. A trace without
        # output lengths gives every request signature 0 for learned-reuse.
        request.append_output_token_ids([_PLACEHOLDER_TOKEN_ID]
                                        * self.prepared.requests[index].output_length)
        self.num_admitted += 1
        self.num_hit_tokens += num_hit_tokens
        self.num_blocks_allocated += len(new_blocks)
        usage = self._usage()
        if usage > self.peak_usage:
            self.peak_usage = usage
        self._since_progress += 1
        if self.progress is not None and self._since_progress >= _PROGRESS_EVERY:
            self.progress(self._since_progress)
            self._since_progress = 0
        return True

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        if self.config.timeline:
            mean_usage, mean_wait_s = self._run_timeline()
        else:
            mean_usage, mean_wait_s = self._run_sequential(), None
        elapsed = time.perf_counter() - started
        if self.progress is not None:
            self.progress(self._since_progress + len(self.prepared.requests)
                          - len(self.admissible))
        prepared, config = self.prepared, self.config
        num_prompt_tokens = prepared.num_prompt_tokens
        blocks_in_tables = sum(prepared.blocks_needed[i] for i in self.admissible)
        return ReplayResult(
            policy=config.policy,
            num_blocks=config.num_blocks,
            block_size=prepared.block_size,
            mode=config.mode,
            concurrency=None if config.timeline else config.concurrency,
            num_requests=len(prepared.requests),
            num_admitted_requests=self.num_admitted,
            num_rejected_requests=len(prepared.requests) - self.num_admitted,
            num_delayed_requests=self.num_delayed,
            num_prompt_tokens=num_prompt_tokens,
            num_hit_tokens=self.num_hit_tokens,
            hit_rate=self.num_hit_tokens / num_prompt_tokens if num_prompt_tokens else 0.0,
            num_evictions=self.manager.block_pool.num_evictions,
            num_blocks_allocated=self.num_blocks_allocated,
            peak_usage=self.peak_usage,
            mean_usage=mean_usage,
            mean_wait_s=mean_wait_s,
            replay_seconds=elapsed,
            requests_per_s=self.num_admitted / elapsed if elapsed > 0 else 0.0,
            blocks_per_s=blocks_in_tables / elapsed if elapsed > 0 else 0.0,
            policy_state=self.manager.block_pool.free_block_queue.policy_state(),
        )

    def _run_sequential(self) -> float:
        manager = self.manager
        live: deque[Request] = deque()
        concurrency = self.config.concurrency
        usage_sum = 0.0
        for index in self.admissible:
            request = self._make_request(index)
            while len(live) >= concurrency:
                manager.free(live.popleft())
            if not self._try_admit(index, request):
                self.num_delayed += 1
                while not self._try_admit(index, request):
                    # Cannot fail forever: alone, any admissible request fits.
                    manager.free(live.popleft())
            live.append(request)
            usage_sum += self._usage()
        while live:
            manager.free(live.popleft())
        return usage_sum / self.num_admitted if self.num_admitted else 0.0

    def _run_timeline(self) -> tuple[float, float]:
        manager = self.manager
        requests = self.prepared.requests
        rate = self.config.decode_tokens_per_s
        finishing: list[tuple[float, int, Request]] = []  # (finish time s, index, request)
        waiting: deque[tuple[int, float, Request]] = deque()  # (index, arrival s, request)
        usage_area = 0.0
        wait_sum = 0.0
        clock = 0.0  # seconds since the first arrival
        start_s = None

        def advance(to: float) -> None:
            nonlocal usage_area, clock
            usage_area += self._usage() * (to - clock)
            clock = to

        def admit_waiting() -> None:
            nonlocal wait_sum
            while waiting:
                index, arrival, request = waiting[0]
                if not self._try_admit(index, request):
                    return
                waiting.popleft()
                if clock > arrival:
                    self.num_delayed += 1
                    wait_sum += clock - arrival
                finish = clock + requests[index].output_length / rate
                heapq.heappush(finishing, (finish, index, request))

        def finish_until(limit: float) -> None:
            while finishing and finishing[0][0] <= limit:
                finish, _, request = heapq.heappop(finishing)
                advance(finish)
                manager.free(request)
                admit_waiting()

        for index in self.admissible:
            arrival_ms = requests[index].timestamp_ms
            if start_s is None:
                start_s = arrival_ms / 1000.0
            arrival = arrival_ms / 1000.0 - start_s
            finish_until(arrival)
            advance(arrival)
            waiting.append((index, arrival, self._make_request(index)))
            admit_waiting()
        finish_until(float("inf"))
        mean_usage = usage_area / clock if clock > 0 else 0.0
        mean_wait = wait_sum / self.num_admitted if self.num_admitted else 0.0
        return mean_usage, mean_wait


def replay(prepared: PreparedTrace, config: ReplayConfig,
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``prepared`` once under ``config``; ``progress(n)`` is called as requests
    are admitted (and once for the rejected ones). Raises ValueError for a timeline replay
    of a trace without timestamps."""
    return _Replay(prepared, config, progress).run()
