"""The scheduler: which tokens of which requests the model computes in the next step.

One idea covers prefill, chunked prefill, decode and cache hits alike: every request's
``num_computed_tokens`` catches up with its ``num_tokens``. Each step hands out a budget of
``max_num_batched_tokens``:

1. Running requests first, oldest admitted first, each taking
   ``min(num_tokens - num_computed_tokens, remaining budget)`` — one token when decoding,
   a chunk when a long prompt is still being prefilled. When the KV cache manager cannot
   fit a running request, the most recently admitted running request is preempted: its
   blocks are freed (they stay cached) and it goes back to the front of the queue to be
   recomputed, usually hitting its own cached blocks.
2. Then, if nothing was preempted, waiting requests in arrival order while
   ``max_num_seqs`` and the budget allow. A cache hit counts as already computed, so only
   the uncached tokens spend budget. With ``max_loras`` set, a request whose LoRA adapter
   would be one more than ``max_loras`` distinct adapters among the running requests is
   skipped (it keeps its place and waits for one of them to finish); the requests behind
   it may still be admitted.

No request waits forever. A request whose tokens (prompt plus outputs) need more blocks
than the whole pool can never sample another token: wherever it is, it is finished with
``FINISHED_LENGTH`` and its blocks are freed (preempting it would only bring it back to
the same wall). Every other request fits the pool on its own, so the oldest running
request always advances (preemption takes from the newest end), and once nothing runs,
the head of the queue is always admitted.

With an external prefix source (a second KV tier, :mod:`prefixcache.core.external_prefix`),
a waiting request's blocks past its local hit are looked up there too; the ones it holds
are allocated like computed tokens and handed to the worker to fill
(``ScheduledRequest.external_blocks``) before the step runs, so they cost no budget.

Scheduled tokens count as computed as soon as they are scheduled (the model runs them in
this step), so the scheduler's state is consistent before the step's results come back.
The engine then appends sampled tokens to requests whose chunk reached their last token
(``needs_logits``) and finishes requests via :meth:`Scheduler.finish_request`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from prefixcache.core.arithmetic import cdiv
from prefixcache.core.external_prefix import ExternalBlock, ExternalPrefixSource
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request, RequestStatus

DEFAULT_MAX_NUM_SEQS = 64
# Enough that a 2,000-token prompt prefills in one step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step. Chunked prefill splits prompts longer than the remaining budget;
    without it, a prompt is computed in one step, so one longer than
    ``max_num_batched_tokens`` can never run. The recomputation of a preempted request is
    split either way: its prompt plus outputs may have grown past the budget."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_chunked_prefill: bool = True
    max_loras: int | None = None  # distinct LoRA adapters running at once; None: no limit

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 or None, got {self.max_loras}")


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in a step: compute ``num_new_tokens`` tokens starting at
    ``start_position`` into the blocks of ``block_ids``. ``needs_logits`` is True when the
    chunk ends at the request's last known token, so a token is sampled from it. On the
    step that admits it, ``num_hit_tokens`` came from the block pool and
    ``num_external_tokens`` from an external source, whose ``external_blocks`` the worker
    fills before computing."""

    request: Request
    num_new_tokens: int
    start_position: int
    block_ids: list[int]
    needs_logits: bool
    num_hit_tokens: int = 0  # set on the step that admits the request
    num_external_tokens: int = 0
    external_blocks: list[ExternalBlock] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        start = self.start_position
        return self.request.all_token_ids[start:start + self.num_new_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    """What the next step computes, plus what the scheduler changed to make room."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests the scheduler ended itself, with FINISHED_LENGTH: their tokens outgrew the
    # whole KV pool, so they could never sample another token.
    finished_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: int = 0


class Scheduler:
    """Continuous batching over one :class:`KVCacheManager`, and optionally an
    ``external_prefix_source`` behind it (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 external_prefix_source: ExternalPrefixSource | None = None) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.external_prefix_source = external_prefix_source
        # The last external load: (request, its local hit blocks, payloads). The head of
        # the queue may wait several steps for room; it is not loaded again meanwhile.
        self._external_load: tuple[Request, int, list] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Tokens the whole pool holds: a request with more can never be computed.
        self.num_pool_slots = kv_cache_manager.num_blocks * kv_cache_manager.block_size

    # -- requests in and out ----------------------------------------------------------

    def check_can_ever_fit(self, request: Request, num_extra_tokens: int = 0) -> str | None:
        """Why ``request`` (plus ``num_extra_tokens`` it may generate) can never run, or
        None. Checked on arrival so an impossible request fails alone, immediately. A
        request that passes with no extra tokens is always admitted eventually and
        samples at least one token."""
        manager = self.kv_cache_manager
        num_tokens = request.num_tokens + num_extra_tokens
        if num_tokens > self.num_pool_slots:
            num_blocks_needed = cdiv(num_tokens, manager.block_size)
            return (f"request needs {num_tokens} tokens of KV cache ({num_blocks_needed} "
                    f"blocks of {manager.block_size}) but the whole pool holds "
                    f"{manager.num_blocks} blocks")
        if not self.config.enable_chunked_prefill and \
                request.num_tokens > self.config.max_num_batched_tokens:
            return (f"prompt of {request.num_tokens} tokens exceeds max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens} and chunked prefill is off")
        return None

    def add_request(self, request: Request) -> None:
        """Queue ``request``. Raises ValueError for a duplicate id or when it can never fit
        (see :meth:`check_can_ever_fit`)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        reason = self.check_can_ever_fit(request)
        if reason is not None:
            raise ValueError(reason)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request wherever it is and free its blocks. Unknown ids are ignored
        (a request may finish and be aborted in the same step). Returns the request."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        if self._external_load is not None and self._external_load[0] is request:
            self._external_load = None
        return request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        for request_id in list(request_ids):
            self.finish_request(request_id, status)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step and advance ``num_computed_tokens`` of what it computes.
        Requests found to have outgrown the pool are finished here (``finished_requests``)."""
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        manager = self.kv_cache_manager
        num_pool_slots = self.num_pool_slots

        # 1. Running requests, oldest first; preempt from the newest end when out of blocks.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_tokens > num_pool_slots:
                # It holds every block already; preempted, it would only come back here.
                self._finish_outgrown(request, output)
                continue  # the next request moved up to ``index``
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new_tokens <= 0:
                index += 1
                continue
            while manager.allocate_slots(request, num_new_tokens) is None:
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                self._schedule(request, num_new_tokens, output)
                budget -= num_new_tokens
                index += 1
                continue
            break  # ``request`` preempted itself: nothing later in the list is left

        # 2. Waiting requests, unless this step had to preempt (no room for newcomers).
        if not output.preempted_request_ids:
            can_split_prompts = self.config.enable_chunked_prefill
            max_loras = self.config.max_loras
            running_loras = {r.lora_name for r in self.running if r.lora_name is not None}
            # Requests passed over for their adapter, put back in front afterwards in order.
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                lora_name = request.lora_name
                if max_loras is not None and lora_name is not None \
                        and lora_name not in running_loras and len(running_loras) >= max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
                if request.num_tokens > num_pool_slots:
                    # A victim preempted while it had outgrown the pool, before its turn in
                    # the running loop came.
                    self._finish_outgrown(request, output)
                    continue
                hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
                external_payloads = self._load_external_prefix(request, len(hit_blocks)) \
                    if self.external_prefix_source is not None else ()
                num_external_tokens = len(external_payloads) * manager.block_size
                num_new_tokens = request.num_tokens - num_hit_tokens - num_external_tokens
                if num_new_tokens > budget:
                    # A prompt that is not split fits an empty step (add_request checks it).
                    # A preempted request's prompt plus outputs may not, and its cached
                    # blocks may be gone: it is split, or it might never run again.
                    if not can_split_prompts and request.status != RequestStatus.PREEMPTED:
                        break
                    num_new_tokens = budget
                # External blocks take fresh blocks, like tokens computed now.
                if manager.allocate_slots(request, num_external_tokens + num_new_tokens,
                                          num_hit_tokens, hit_blocks) is None:
                    # Only running requests hold blocks, and this one fits the pool: it
                    # is admitted once they have finished or been preempted.
                    break
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit_tokens + num_external_tokens
                self.running.append(request)
                scheduled = self._schedule(request, num_new_tokens, output)
                scheduled.num_hit_tokens = num_hit_tokens
                if external_payloads:
                    self._external_load = None
                    first = len(hit_blocks)
                    scheduled.num_external_tokens = num_external_tokens
                    scheduled.external_blocks = [
                        ExternalBlock(block_id, payload) for block_id, payload in
                        zip(scheduled.block_ids[first:first + len(external_payloads)],
                            external_payloads, strict=True)]
                budget -= num_new_tokens
                if lora_name is not None:
                    running_loras.add(lora_name)
            self.waiting.extendleft(reversed(skipped))
        return output

    def _load_external_prefix(self, request: Request, num_hit_blocks: int) -> list:
        """Payloads of the request's blocks after its ``num_hit_blocks`` local hits that
        the external source holds (at most up to its last prompt token, as a local hit);
        the same list again while the request waits for room."""
        manager = self.kv_cache_manager
        if not manager.enable_caching or request.skip_reading_prefix_cache:
            return []
        last = self._external_load
        if last is not None and last[0] is request and last[1] == num_hit_blocks:
            return last[2]
        block_size = manager.block_size
        max_blocks = (request.num_tokens - 1) // block_size
        block_hashes = request.block_hashes[num_hit_blocks:max_blocks]
        payloads: list = []
        if block_hashes:
            num_held = self.external_prefix_source.lookup(block_hashes)
            if num_held:
                tokens = request.all_token_ids
                payloads = list(self.external_prefix_source.load(
                    block_hashes[:num_held],
                    [tokens[i * block_size:(i + 1) * block_size]
                     for i in range(num_hit_blocks, num_hit_blocks + num_held)]))
        self._external_load = (request, num_hit_blocks, payloads)
        return payloads

    def _schedule(self, request: Request, num_new_tokens: int,
                  output: SchedulerOutput) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new_tokens
        scheduled = ScheduledRequest(
            request=request,
            num_new_tokens=num_new_tokens,
            start_position=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            needs_logits=request.num_computed_tokens == request.num_tokens,
        )
        output.scheduled.append(scheduled)
        output.num_scheduled_tokens += num_new_tokens
        return scheduled

    def _finish_outgrown(self, request: Request, output: SchedulerOutput) -> None:
        """End ``request``, whose tokens need more blocks than the pool holds, as a
        length limit: its outputs so far stand, it just cannot grow any further."""
        self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        output.finished_requests.append(request)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Free ``request``'s blocks and queue it first for recomputation. Its tokens so far
        (prompt and outputs) are kept; its cached blocks will usually be hit again."""
        # Victims come from the end of ``running``, past every request scheduled so far
        # this step, so nothing needs to be taken back out of ``output``.
        self.running.remove(request)
        # Marked before the free: an eviction policy may treat a preempted request's
        # blocks (which it will come back for) differently from a finished one's.
        request.status = RequestStatus.PREEMPTED
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted_request_ids.append(request.request_id)
