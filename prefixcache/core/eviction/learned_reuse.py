"""``learned-reuse``: evicts first the new content of the kinds of requests that rarely
leave content that is looked up again, learning online which kinds those are."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.segmented import TwoSegmentFreeBlockQueue
from prefixcache.core.eviction.signature_reuse import SignatureReuseEstimate
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request, RequestStatus


def output_length_signature(request: Request) -> int:
    """The bit length of the request's number of generated tokens: 0, 1, 2-3, 4-7, ..."""
    return request.num_output_tokens.bit_length()


def output_length_range(signature: int) -> tuple[int, int]:
    """The numbers of generated tokens (lowest, highest) that have ``signature``."""
    return (0, 0) if signature == 0 else (1 << (signature - 1), (1 << signature) - 1)


class LearnedReuseFreeBlockQueue(TwoSegmentFreeBlockQueue):
    """Evicts first the new content of the signatures whose content is rarely looked up
    again, learning online which signatures those are.

    A finished request's *signature* is :func:`output_length_signature`, known once it
    finishes. For each signature the queue counts the cached blocks released with content
    *new* to the cache (filled since the block was last taken, released by nobody
    before), and how many of those were looked up again — hit while free, or recomputed
    while the hash is in the *ghost* list of recently evicted, never-reused content (the
    last ``ghost_factor * num_blocks`` such hashes). Its reuse rate is estimated as
    ``(reused + prior_weight * g) / (inserted + prior_weight)``, shrunk towards the
    overall rate ``g``. Whenever the counted insertions pass ``memory_factor *
    num_blocks``, every count is halved, so the estimates follow changing traffic; a
    reuse is credited with the weight its insertion has left.

    New content another request hits while its filler still holds it (reported through
    :meth:`note_hit_in_use`), or while it is free after its filler was preempted, is
    counted as inserted and reused at once. New content is attributed to the first
    request that releases it as finished. Requests without output tokens all have
    signature 0, and the queue then behaves as ``unhashed-first``.

    Where released blocks go:

    - no hash (partial tails, decode slots): the head of the lower segment;
    - new content of a signature whose estimate is below ``low_reuse_ratio * g``: the tail
      of the lower segment, so it is evicted before any other cached content;
    - everything else — new content of other signatures, content hit before, content
      recomputed from the ghost, the blocks of a preempted request (it comes back for
      them; its new content stays new, to be judged when the request finally finishes)
      and of releases without a request: the tail of the upper segment, in LRU order.

    With no history every estimate equals ``g``, so the queue starts out as
    ``unhashed-first``. The learned table is :meth:`reuse_estimates`. A prefix-cache reset
    forgets the ghost and the pending insertions, not the learned counts.
    """

    policy_name = "learned-reuse"
    summary = "learns which kinds of requests leave reused content"
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
        self.estimate = SignatureReuseEstimate(self.memory_factor * max(len(blocks), 1),
                                               self.prior_weight, self.low_reuse_ratio)

    # -- learning ---------------------------------------------------------------------

    @property
    def num_inserted(self) -> dict[int, float]:
        return self.estimate.num_inserted

    @property
    def num_reused(self) -> dict[int, float]:
        return self.estimate.num_reused

    @property
    def total_inserted(self) -> float:
        return self.estimate.total_inserted

    @property
    def memory(self) -> float:
        return self.estimate.memory_blocks

    @property
    def num_halvings(self) -> int:
        return self.estimate.epoch

    def _credit(self, signature: int, epoch: int, num_blocks: int = 1) -> None:
        self.estimate.credit(signature, epoch, num_blocks)

    def _insert(self, signature: int, num_blocks: int) -> None:
        self.estimate.insert(signature, num_blocks)

    def overall_reuse_rate(self) -> float:
        """``g``: the share of all inserted content looked up again (1/2 with no data)."""
        return self.estimate.overall_reuse_rate()

    def estimated_reuse_rate(self, signature: int) -> float:
        """The shrunk estimate of the share of ``signature``'s new content reused."""
        return self.estimate.reuse_rate(signature)

    def is_low_reuse(self, signature: int) -> bool:
        """Whether ``signature``'s new content is evicted before other cached content."""
        return self.estimate.is_low_reuse(signature)

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

    def policy_state(self) -> dict:
        """The overall reuse rate and :meth:`reuse_estimates`, one row per signature."""
        return {
            "overall_reuse_rate": self.overall_reuse_rate(),
            "signatures": [{"signature": signature, **row}
                           for signature, row in self.reuse_estimates().items()],
        }

    # -- what the pool calls ---------------------------------------------------------------

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        blocks = super().popleft_n(n)
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
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self._credit_hit(block)

    def _credit_hit(self, block: KVCacheBlock) -> None:
        """Count a hit on ``block``'s content as a reuse of its signature, once."""
        signature = self.block_signature[block.block_id]
        if signature is not None:
            self._credit(signature, self.block_epoch[block.block_id])
            self.block_signature[block.block_id] = None

    def note_hit_in_use(self, block: KVCacheBlock) -> None:
        if self.is_new[block.block_id]:
            self.hit_while_new[block.block_id] = 1  # counted when it is first released
        else:
            self._credit_hit(block)

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
