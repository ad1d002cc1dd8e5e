"""The free queue's contract, and its default behaviour: the design's LRU order.

The block pool keeps every block with ``ref_cnt == 0`` in its free queue and takes blocks
for new content from the head; where released blocks go, and so which block is evicted
next, is the eviction policy. A policy is a :class:`FreeKVCacheBlockQueue`: this class
declares every method the pool calls and implements each one as the design does, with an
intrusive doubly linked list threaded through the blocks themselves (``prev_free_block`` /
``next_free_block``) between two sentinel blocks, so taking a block out of the middle —
which a cache hit on a free block does — is O(1) and allocates nothing.

A policy overrides the methods whose behaviour it changes, calling the inherited ones for
the list operations; the pool cannot tell policies apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from prefixcache.core.block import KVCacheBlock

if TYPE_CHECKING:
    from prefixcache.core.request import Request


class CandidateStanding(NamedTuple):
    """One candidate order of a policy that chooses online among several."""

    label: str
    #: Its share (0..1) of what the policy compares candidates by (the shares sum to 1,
    #: or are all 0 before there is any evidence).
    share: float
    followed: bool


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order, head (next to evict) first.

    What the pool calls, and what each call means:

    ``popleft_n(n)``
        Take ``n`` blocks from the head to hold new content; the pool then evicts what
        they held (their ``block_hash`` is still set during the call). ValueError, with
        nothing removed, if ``n`` is negative or more than :attr:`num_free_blocks`.
    ``remove(block)``
        A request hit ``block``'s cached content while the block was free: it leaves the
        queue. RuntimeError if it is not in the queue.
    ``release(blocks, request)``
        ``blocks`` just reached ``ref_cnt == 0`` and join the queue. They come in the
        design's append order — a request's block table reversed, so its deepest (least
        reusable) block first — and ``request`` is the request they belonged to (None when
        the pool is driven directly). Default: append them to the tail in that order.
    ``note_hit_in_use(block)``
        A request hit ``block``'s content while another request holds it, so the block is
        not in the queue: a reuse :meth:`remove` never sees. Called only for a policy
        that overrides it (:attr:`observes_hits_in_use`), so the others pay nothing on the
        hit path.
    ``forget_cached_content()``
        A prefix-cache reset has just dropped every hash (so every block is free and
        empty): forget what is remembered of cached content. Default: nothing to forget.
    ``get_all_free_blocks()``
        Every free block, in eviction order. For tests and tools; may be O(n log n).
    ``policy_state()``
        What the policy has learned, as a JSON-able dict for reports, or None.
    ``candidate_standings()``
        For a policy that follows one of several candidate orders, each candidate's
        standing now; cheap enough for the engine to read after every step (its
        ``/metrics``). Default: none (an empty list).
    ``num_switches``
        For such a policy, how many times the order it follows has changed. Default: 0.

    ``popleft``, ``append``, ``append_n`` and ``prepend_n`` are the list operations
    policies place blocks with; the pool never calls them. Invariant under every policy:
    the queue holds exactly the blocks with ``ref_cnt == 0``, each once, and
    :attr:`num_free_blocks` counts them. A block is handed in only while it is out of the
    queue and taken out only while it is in; the pool guarantees both through ``ref_cnt``.

    A registered policy sets ``policy_name``, the name the registry knows it by, and
    ``summary``, its one-line description for help texts. This class is the LRU behaviour
    every policy starts from; the registry's ``lru`` (``lru.py``) only names it.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    policy_name: ClassVar[str]
    summary: ClassVar[str]
    #: Times the order followed has changed: a policy that chooses among candidate orders
    #: (:meth:`candidate_standings`) counts them; one that follows one order never does.
    num_switches: int = 0

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    # -- what the pool calls --------------------------------------------------------------

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first. Raises ValueError, removing
        nothing, if ``n`` is negative or fewer than ``n`` are free."""
        self._check_take(n)
        if not n:
            return []
        head = self.fake_free_list_head
        block = head.next_free_block
        popped = [None] * n
        for i in range(n):
            popped[i] = block
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        """The design's order: ``blocks`` join the tail in the order given."""
        self.append_n(blocks)

    def note_hit_in_use(self, block: KVCacheBlock) -> None:
        """A request hit ``block`` while another holds it (see the class docstring)."""

    @property
    def observes_hits_in_use(self) -> bool:
        """Whether this policy overrides :meth:`note_hit_in_use`, so the pool calls it."""
        return type(self).note_hit_in_use is not FreeKVCacheBlockQueue.note_hit_in_use

    def forget_cached_content(self) -> None:
        """Every hash was just dropped; the linked list itself remembers no content."""

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next to evict) to tail. O(n); for tests and tools."""
        blocks = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def policy_state(self) -> dict | None:
        """What the policy has learned, for reports; LRU learns nothing."""
        return None

    def candidate_standings(self) -> list[CandidateStanding]:
        """The candidate orders this policy chooses among, in a fixed order, with their
        share of the evidence it chooses by and whether it follows each now; LRU follows
        one order and chooses nothing."""
        return []

    # -- the list operations policies place blocks with ---------------------------------

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when empty."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        following = block.next_free_block
        self.fake_free_list_head.next_free_block = following
        following.prev_free_block = self.fake_free_list_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail in the given order (the last one is evicted last)."""
        if blocks:
            tail = self.fake_free_list_tail
            self._link_between(tail.prev_free_block, blocks, tail)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head in the given order (the first one is evicted first)."""
        if blocks:
            head = self.fake_free_list_head
            self._link_between(head, blocks, head.next_free_block)

    def _link_between(self, before: KVCacheBlock, blocks: list[KVCacheBlock],
                      after: KVCacheBlock) -> None:
        """Link ``blocks``, in order, between the adjacent nodes ``before`` and ``after``."""
        last = before
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = after
        after.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def _check_take(self, n: int) -> None:
        """``popleft_n``'s checks, for every queue: ValueError if ``n`` is negative (it
        would corrupt ``num_free_blocks``) or more than are free."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise ValueError(
                f"No free blocks available: asked for {n}, {self.num_free_blocks} free"
            )
