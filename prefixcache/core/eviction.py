"""Eviction policies: where freed blocks go in the free queue, and so which block is
evicted next.

Blocks are always taken from the head of the free queue; a policy only decides how blocks
whose last reference was just dropped are *released* into it. Every policy is a
:class:`~prefixcache.core.block.FreeKVCacheBlockQueue` (the block pool exposes it as
``free_block_queue``) with one extra method:

``release(blocks, request=None)``
    ``blocks`` just reached ``ref_cnt == 0``, given in the design's append order: a
    request's block table reversed, so its deepest (least reusable) block comes first.
    ``request`` is the request whose blocks they were (None when the pool is driven
    directly); ``learned-reuse`` looks at its ``status`` and ``num_output_tokens``,
    ``document-liveness`` also at its prompt's block hashes and length.

Policies:

``lru`` (default — the design)
    Append every released block to the tail in the given order. The head is the least
    recently used block, and a request's tail blocks are evicted before its prefix.
``unhashed-first`` (vLLM 0.33's order)
    Released blocks that hold no cached content (partial tails, or any block when caching
    is off) go to the head, most recently released first, so they are reused before any
    cached block is evicted; cached blocks are appended as in ``lru``.
``2q`` (segmented LRU with a ghost list, see :class:`TwoQueueFreeBlockQueue`)
    Cached content referenced a second time (hit while free, or recomputed while its hash
    is in the ghost list of recent evictions) is protected: one-off prompts are evicted
    before it. Unhashed blocks go first, as in ``unhashed-first``.
``learned-reuse`` (see :class:`LearnedReuseFreeBlockQueue`)
    Learns, online, which kinds of finished requests leave content that is looked up
    again, and evicts new content of the kinds that rarely are before anything else.
    Otherwise ``lru``, with unhashed blocks first.
``document-liveness`` (see :mod:`prefixcache.core.document_liveness`)
    Groups content by document (the prompt's first block) and evicts first the blocks
    whose document is least likely to be asked about again, as estimated online from
    each kind of document's history and its silence since; unhashed blocks first.

New policies register in :data:`EVICTION_POLICIES`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import FreeKVCacheBlockQueue, KVCacheBlock
from prefixcache.core.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request, RequestStatus


class LRUFreeBlockQueue(FreeKVCacheBlockQueue):
    """The design's order: released blocks join the tail in the order given."""

    policy_name = "lru"

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        self.append_n(blocks)


class UnhashedFirstFreeBlockQueue(FreeKVCacheBlockQueue):
    """Blocks without a hash jump to the head; cached blocks join the tail."""

    policy_name = "unhashed-first"

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        unhashed = [block for block in blocks if block.block_hash is None]
        if not unhashed:
            self.append_n(blocks)
            return
        self.prepend_n(unhashed)
        self.append_n([block for block in blocks if block.block_hash is not None])


class TwoSegmentFreeBlockQueue(FreeKVCacheBlockQueue):
    """A free queue in two LRU segments: *lower* (the inherited list) is drained first,
    then *upper*. Subclasses decide where released blocks go.

    ``in_upper[block_id]`` says which segment a free block is in (the pool's blocks are
    numbered 0 .. num_blocks - 1); ``num_lower`` counts the lower segment and
    ``num_free_blocks`` both. The inherited ``append``/``append_n``/``prepend_n`` act on
    the *lower* segment (so "tail" there is still evicted before every upper block);
    :meth:`append_upper` fills the upper one. Two hooks see what passes through:
    :meth:`_on_taken` the blocks about to be reused for new content (their old hashes
    still set) and :meth:`_on_hit` a free block a request has just hit.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        self.num_block_ids = max((block.block_id for block in blocks), default=-1) + 1
        self.in_upper = bytearray(self.num_block_ids)
        self.upper = FreeKVCacheBlockQueue(())
        self.num_lower = 0
        super().__init__(blocks)

    def _on_taken(self, blocks: list[KVCacheBlock]) -> None:
        """``blocks`` leave the queue to hold new content."""

    def _on_hit(self, block: KVCacheBlock) -> None:
        """``block`` leaves the queue because a request hit its cached content."""

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not self._can_take(n):
            return []
        from_lower = min(n, self.num_lower)
        popped = super().popleft_n(from_lower)
        self.num_lower -= from_lower
        if from_lower < n:
            more = self.upper.popleft_n(n - from_lower)
            self.num_free_blocks -= len(more)
            in_upper = self.in_upper
            for block in more:
                in_upper[block.block_id] = 0
            popped.extend(more)
        self._on_taken(popped)
        return popped

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def remove(self, block: KVCacheBlock) -> None:
        if self.in_upper[block.block_id]:
            self.in_upper[block.block_id] = 0
            self.upper.remove(block)
            self.num_free_blocks -= 1
        else:
            super().remove(block)
            self.num_lower -= 1
        self._on_hit(block)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        self.num_lower += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        super().prepend_n(blocks)
        self.num_lower += len(blocks)

    def place(self, unhashed: list[KVCacheBlock], lower: list[KVCacheBlock],
              upper: list[KVCacheBlock]) -> None:
        """Put released blocks in the usual three places, each list keeping its order:
        ``unhashed`` (holding nothing) at the head of lower, ``lower`` at its tail,
        ``upper`` at the tail of upper."""
        if unhashed:
            self.prepend_n(unhashed)
        if lower:
            self.append_n(lower)
        if upper:
            self.append_upper(upper)

    def append_upper(self, blocks: list[KVCacheBlock]) -> None:
        """Append ``blocks`` to the tail of the upper segment."""
        in_upper = self.in_upper
        for block in blocks:
            in_upper[block.block_id] = 1
        self.upper.append_n(blocks)
        self.num_free_blocks += len(blocks)

    def forget_cached_content(self) -> None:
        """Every block is free and holds nothing after a reset, so none deserves the upper
        segment: its blocks move, in order, to the head of the lower one (taken first,
        like any unhashed block) rather than outlive content cached after the reset.
        Subclasses extend this, calling it."""
        upper = self.upper
        if upper.num_free_blocks:
            emptied = upper.popleft_n(upper.num_free_blocks)
            self.num_free_blocks -= len(emptied)
            self.in_upper = bytearray(self.num_block_ids)
            self.prepend_n(emptied)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Lower head to tail, then upper head to tail: the eviction order."""
        return super().get_all_free_blocks() + self.upper.get_all_free_blocks()


class TwoQueueFreeBlockQueue(TwoSegmentFreeBlockQueue):
    """2Q-style segmented LRU: content referenced again is protected from one-off content.

    The lower segment (*probation*) holds free blocks whose content has been referenced
    once, the upper one (*protected*) those whose content was referenced again.

    Content counts as referenced again when its block is hit while free (the pool's
    ``touch`` calls ``remove``), or when it is released under a hash that is still
    remembered in the *ghost* list — the hashes of the last ``ghost_factor * num_blocks``
    evicted blocks (hashes only, no KV). The ghost is what lets a prefix whose reuse comes
    back after longer than the cache can hold it (e.g. the second question on a long
    document) earn protection: plain SLRU only protects what is hit while still cached.
    The mark is dropped when a block is taken for new content. An evicted block's hash
    joins the ghost even while a duplicate block still in use holds it; that duplicate's
    release then finds it there and is protected as if recomputed (rare noise, as in
    ``learned-reuse``).

    Released blocks without a hash go to the head of probation (they hold nothing).
    Protected holds at most ``protected_fraction`` of all blocks; beyond that its least
    recently used blocks are demoted to the tail of probation, so a once-popular prefix
    cannot stay forever. Hits on blocks still held by another request are not seen (no
    ``remove``); such content is still protected once it comes back through the ghost.
    A prefix-cache reset forgets the ghost and the marks, and moves protected (now empty)
    blocks to the head of probation.
    """

    policy_name = "2q"
    protected_fraction = 0.9
    ghost_factor = 2

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        super().__init__(blocks)
        self.is_reused = bytearray(self.num_block_ids)
        self.max_protected = int(self.protected_fraction * len(blocks))
        self.ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_ghost = self.ghost_factor * len(blocks)

    def _on_taken(self, blocks: list[KVCacheBlock]) -> None:
        is_reused = self.is_reused
        ghost = self.ghost
        for block in blocks:
            is_reused[block.block_id] = 0
            if block.block_hash is not None:  # about to be evicted by the pool
                ghost[block.block_hash] = None
        while len(ghost) > self.max_ghost:
            ghost.popitem(last=False)

    def _on_hit(self, block: KVCacheBlock) -> None:
        self.is_reused[block.block_id] = 1

    def forget_cached_content(self) -> None:
        super().forget_cached_content()
        self.ghost.clear()
        self.is_reused = bytearray(self.num_block_ids)

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        is_reused = self.is_reused
        ghost = self.ghost
        unhashed, probation, protected = [], [], []
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                unhashed.append(block)
            elif is_reused[block.block_id]:
                protected.append(block)
            elif block_hash in ghost:
                del ghost[block_hash]
                is_reused[block.block_id] = 1
                protected.append(block)
            else:
                probation.append(block)
        self.place(unhashed, probation, [])
        if protected:
            self._protect(protected)  # the upper segment, with 2q's cap

    def _protect(self, blocks: list[KVCacheBlock]) -> None:
        self.append_upper(blocks)
        overflow = self.upper.num_free_blocks - self.max_protected
        if overflow > 0:
            demoted = self.upper.popleft_n(overflow)
            in_upper = self.in_upper
            for block in demoted:
                in_upper[block.block_id] = 0
            self.num_free_blocks -= overflow
            self.append_n(demoted)


def output_length_signature(request: Request) -> int:
    """The bit length of the request's number of generated tokens: 0, 1, 2-3, 4-7, ..."""
    return request.num_output_tokens.bit_length()


def output_length_range(signature: int) -> tuple[int, int]:
    """The numbers of generated tokens (lowest, highest) that have ``signature``."""
    return (0, 0) if signature == 0 else (1 << (signature - 1), (1 << signature) - 1)


class LearnedReuseFreeBlockQueue(TwoSegmentFreeBlockQueue):
    """Evicts first the new content of the kinds of requests that rarely leave reusable
    content, learning online which kinds those are.

    A finished request's *signature* is :func:`output_length_signature`: how much it
    generated, known once it finishes, and in real traffic a hint of the task — short
    answers about a long document tend to be followed by more questions about it, long
    generations from one-off prompts rarely are. For each signature the queue counts the
    cached blocks released with content *new* to the cache (filled since the block was last
    taken: nobody released it before), and how many of those were looked up again — hit
    while free, or recomputed while the hash is in the *ghost* list of recently evicted,
    never-reused content (the last ``ghost_factor * num_blocks`` such hashes, a
    few hundred bytes each). Its reuse rate is estimated as
    ``(reused + prior_weight * g) / (inserted + prior_weight)``, shrunk towards the
    overall rate ``g``. Whenever the counted insertions pass ``memory_factor *
    num_blocks``, every count is halved (then again every half of that), so the estimates
    follow changing traffic; a reuse is credited with the weight its insertion has left.

    New content another request hits while its filler still holds it (the pool reports
    such hits through :meth:`note_hit_in_use`), or while it is free after its filler was
    preempted, is counted as inserted and reused at once.
    The queue does not know who filled a block, so new content is attributed to the first
    request that releases it as finished — the filler, unless a request that shared it
    finishes first. A trace or workload without output lengths puts every request in
    signature 0, and the queue is ``unhashed-first``.

    Where released blocks go:

    - no hash (partial tails, decode slots): the head of the lower segment;
    - new content of a signature whose estimate is below ``low_reuse_ratio * g``: the tail
      of the lower segment, so it is evicted before any other cached content;
    - everything else — new content of other signatures, content hit before, content
      recomputed from the ghost, the blocks of a preempted request (it comes back for
      them; its new content stays new, to be judged when the request finally finishes)
      and of releases without a request: the tail of the upper segment, in the design's
      LRU order.

    With no history every estimate equals ``g``, so the queue starts out as
    ``unhashed-first``. The learned table is :meth:`reuse_estimates`. A prefix-cache reset
    forgets the ghost and the pending insertions, not the learned counts, and empties the
    upper segment into the head of the lower one.
    """

    policy_name = "learned-reuse"
    observes_hits_in_use = True
    low_reuse_ratio = 0.5
    prior_weight = 4.0
    ghost_factor = 4
    memory_factor = 8

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        super().__init__(blocks)
        size = self.num_block_ids
        self.is_new = bytearray(size)  # filled since taken, not yet released as finished
        self.hit_while_new = bytearray(size)  # and already hit by another request
        # Who last released the block as preempted: anyone else releasing its still new
        # content later must have hit it, a reuse (see _note_shared_since_preempted).
        self.preempted_request_ids: list[str | None] = [None] * size
        # The signature that inserted the block's content, until its reuse is counted, and
        # how many halvings had happened then (the insertion's weight is 2 ** -(now - then)).
        self.block_signature: list[int | None] = [None] * size
        self.block_epoch = [0] * size
        # Hash -> (signature, epoch) of content evicted before anyone reused it.
        self.ghost: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()
        self.max_ghost = self.ghost_factor * len(blocks)
        self.memory = self.memory_factor * max(len(blocks), 1)
        self.num_inserted: dict[int, float] = {}
        self.num_reused: dict[int, float] = {}
        self.total_inserted = 0.0
        self.total_reused = 0.0
        self.num_halvings = 0

    # -- learning ---------------------------------------------------------------------

    def _credit(self, signature: int, epoch: int, num_blocks: int = 1) -> None:
        weight = num_blocks * 0.5 ** (self.num_halvings - epoch)
        self.num_reused[signature] = self.num_reused.get(signature, 0.0) + weight
        self.total_reused += weight

    def _insert(self, signature: int, num_blocks: int) -> None:
        self.num_inserted[signature] = self.num_inserted.get(signature, 0.0) + num_blocks
        self.total_inserted += num_blocks
        if self.total_inserted > self.memory:
            for counts in (self.num_inserted, self.num_reused):
                for key in counts:
                    counts[key] /= 2.0
            self.total_inserted /= 2.0
            self.total_reused /= 2.0
            self.num_halvings += 1

    def overall_reuse_rate(self) -> float:
        """``g``: the share of all inserted content looked up again (1/2 with no data)."""
        return (self.total_reused + 1.0) / (self.total_inserted + 2.0)

    def estimated_reuse_rate(self, signature: int) -> float:
        """The shrunk estimate of the share of ``signature``'s new content reused."""
        prior = self.prior_weight
        return ((self.num_reused.get(signature, 0.0) + prior * self.overall_reuse_rate())
                / (self.num_inserted.get(signature, 0.0) + prior))

    def is_low_reuse(self, signature: int) -> bool:
        """Whether ``signature``'s new content is evicted before other cached content."""
        return (self.estimated_reuse_rate(signature)
                < self.low_reuse_ratio * self.overall_reuse_rate())

    def reuse_estimates(self) -> dict[int, dict]:
        """Per signature seen: the generated-token range it stands for, inserted and reused
        block counts (decayed), the estimate, and whether its new content is currently
        evicted first."""
        return {
            signature: {
                "output_tokens": output_length_range(signature),
                "inserted": self.num_inserted[signature],
                "reused": self.num_reused.get(signature, 0.0),
                "estimated_reuse_rate": self.estimated_reuse_rate(signature),
                "evicted_first": self.is_low_reuse(signature),
            }
            for signature in sorted(self.num_inserted)
        }

    # -- the hooks and the release order ---------------------------------------------------

    def _on_taken(self, blocks: list[KVCacheBlock]) -> None:
        is_new = self.is_new
        block_signature = self.block_signature
        ghost = self.ghost
        for block in blocks:
            block_id = block.block_id
            signature = block_signature[block_id]
            if signature is not None and block.block_hash is not None:
                # Evicted before anyone reused it. (Rarely, a duplicate of the hash is
                # still in use; its release then counts as a reuse — harmless noise.)
                ghost[block.block_hash] = (signature, self.block_epoch[block_id])
                ghost.move_to_end(block.block_hash)
            block_signature[block_id] = None
            is_new[block_id] = 1
            self.hit_while_new[block_id] = 0
            self.preempted_request_ids[block_id] = None
        while len(ghost) > self.max_ghost:
            ghost.popitem(last=False)

    def _on_hit(self, block: KVCacheBlock) -> None:
        signature = self.block_signature[block.block_id]
        if signature is not None:
            self._credit(signature, self.block_epoch[block.block_id])
            self.block_signature[block.block_id] = None

    def note_hit_in_use(self, block: KVCacheBlock) -> None:
        if self.is_new[block.block_id]:
            self.hit_while_new[block.block_id] = 1  # counted when it is first released
        else:
            self._on_hit(block)

    def forget_cached_content(self) -> None:
        super().forget_cached_content()
        self.ghost.clear()
        self.block_signature = [None] * self.num_block_ids
        self.is_new = bytearray(self.num_block_ids)
        self.hit_while_new = bytearray(self.num_block_ids)
        self.preempted_request_ids = [None] * self.num_block_ids

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        if request is not None and request.status == RequestStatus.PREEMPTED:
            self._release_preempted(blocks, request)
            return
        signature = None if request is None else output_length_signature(request)
        if request is not None:
            self._note_shared_since_preempted(blocks, request)
        is_new = self.is_new
        hit_while_new = self.hit_while_new
        block_signature = self.block_signature
        block_epoch = self.block_epoch
        ghost = self.ghost
        # First pass: which blocks bring new content of ``signature`` (still unproven, or
        # already shared); the second places every block, keeping the given order within
        # each segment.
        inserted = bytearray(len(blocks))
        num_inserted = num_shared = 0
        for position, block in enumerate(blocks):
            block_id = block.block_id
            block_hash = block.block_hash
            was_new = is_new[block_id]
            is_new[block_id] = 0
            was_shared = hit_while_new[block_id]
            hit_while_new[block_id] = 0
            if block_hash is None or not was_new:
                continue
            if block_hash in ghost:
                self._credit(*ghost.pop(block_hash))  # wanted again after its eviction
            elif signature is None:
                continue
            elif was_shared:
                num_shared += 1
            else:
                block_signature[block_id] = signature
                block_epoch[block_id] = self.num_halvings
                inserted[position] = 1
                num_inserted += 1
        evict_inserted_first = False
        if num_inserted or num_shared:
            if num_shared:
                self._credit(signature, self.num_halvings, num_shared)
            self._insert(signature, num_inserted + num_shared)
            evict_inserted_first = self.is_low_reuse(signature)
        unhashed, lower, upper = [], [], []
        for position, block in enumerate(blocks):
            if block.block_hash is None:
                unhashed.append(block)
            elif evict_inserted_first and inserted[position]:
                lower.append(block)
            else:
                upper.append(block)
        self.place(unhashed, lower, upper)

    def _release_preempted(self, blocks: list[KVCacheBlock], request: Request) -> None:
        """Keep a preempted request's content, and its newness, for when it comes back."""
        self._note_shared_since_preempted(blocks, request)
        unhashed, hashed = [], []
        is_new = self.is_new
        preempted_request_ids = self.preempted_request_ids
        request_id = request.request_id
        for block in blocks:
            if block.block_hash is None:
                unhashed.append(block)
                is_new[block.block_id] = 0  # nothing in it to judge later
            else:
                hashed.append(block)
                preempted_request_ids[block.block_id] = request_id
        self.place(unhashed, [], hashed)

    def _note_shared_since_preempted(self, blocks: list[KVCacheBlock],
                                     request: Request) -> None:
        """Mark as hit while new the new content among ``blocks`` that a preempted request
        left free and ``request``, another request, now releases.

        Such a block was free, so ``request`` took it by a cache hit: a reuse, counted
        like a hit in use. The queue is not told who hits a free block, which is why this
        is settled here: after that hit, the next release is by the hitter (or by someone
        whose own hit in use already marked it), and the preempted request coming back
        for its own content is no reuse.
        """
        is_new = self.is_new
        preempted_request_ids = self.preempted_request_ids
        request_id = request.request_id
        for block in blocks:
            block_id = block.block_id
            preempted_id = preempted_request_ids[block_id]
            if preempted_id is not None:
                preempted_request_ids[block_id] = None
                if is_new[block_id] and preempted_id != request_id:
                    self.hit_while_new[block_id] = 1

EVICTION_POLICIES: dict[str, type[FreeKVCacheBlockQueue]] = {
    LRUFreeBlockQueue.policy_name: LRUFreeBlockQueue,
    UnhashedFirstFreeBlockQueue.policy_name: UnhashedFirstFreeBlockQueue,
    TwoQueueFreeBlockQueue.policy_name: TwoQueueFreeBlockQueue,
    LearnedReuseFreeBlockQueue.policy_name: LearnedReuseFreeBlockQueue,
    DocumentLivenessFreeBlockQueue.policy_name: DocumentLivenessFreeBlockQueue,
}
DEFAULT_EVICTION_POLICY = LRUFreeBlockQueue.policy_name


def make_free_block_queue(
    policy_name: str, blocks: Iterable[KVCacheBlock]
) -> FreeKVCacheBlockQueue:
    """The free queue of policy ``policy_name``, initially holding ``blocks`` in order."""
    try:
        policy = EVICTION_POLICIES[policy_name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy_name!r}; choose one of "
            f"{', '.join(EVICTION_POLICIES)}"
        ) from None
    return policy(blocks)

# Registered last: the adaptive queue builds on TwoQueueFreeBlockQueue above.
from prefixcache.core.adaptive_eviction import AdaptiveFreeBlockQueue  # noqa: E402

EVICTION_POLICIES[AdaptiveFreeBlockQueue.policy_name] = AdaptiveFreeBlockQueue
