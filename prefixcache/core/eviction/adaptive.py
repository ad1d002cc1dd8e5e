"""``adaptive`` eviction: a segmented LRU whose protected share, and whether it evicts the
new content of rarely reused kinds of requests first, are chosen online by simulating, on
a sample of the traffic, what each candidate would have hit.

The real free queue is :class:`~prefixcache.core.eviction.TwoQueueFreeBlockQueue`'s:
content referenced a second time (hit while free, or recomputed while its hash is in the
ghost list of recent evictions) goes to a *protected* segment evicted after every
*probation* block. In front of both is a *first* segment: blocks holding nothing (at its
head) and, when the candidate followed says so, *low-reuse* content (at its tail). A
candidate (:data:`CANDIDATES`) is a triple:

- the cap on the protected segment, ``protected_fraction`` times the number of blocks. A
  fraction of 0 protects nothing: the queue is then ``unhashed-first`` (LRU order, empty
  blocks first). Larger fractions resist one-off content (fresh questions, tool outputs,
  one-off prompts) flushing what is looked up again, and lose when what matters is
  recency (a conversation's newest turn);
- whether low-reuse content is evicted first: the content a finished request cached new
  (filled since its block was last taken), when its *signature* — the bit length of the
  number of tokens it generated, as in ``learned-reuse`` — is one whose new content is
  looked up again less than half as often as new content overall
  (:class:`~prefixcache.core.eviction.signature_reuse.SignatureReuseEstimate`: hits on
  free blocks and recomputations from the ghost list count as look-ups; the counts halve
  whenever their decayed total of inserted blocks passes ``8 * num_blocks``, which in a
  steady stream is every ``4 * num_blocks`` insertions). The estimate is kept whichever
  candidate is followed, so switching to it needs no warm-up;
- the ghost list's reach, ``ghost_factor``: a recomputation counts as a second reference
  if its hash was evicted within the last ``ghost_factor * num_blocks`` evictions. The
  ghost list keeps the longest reach of all candidates, each entry with the eviction
  count at its eviction, so a switch changes the reach at once. A recomputation beyond
  the reach followed goes to probation (it still counts for the reuse estimate).

The last candidate is not a segment order: the *liveness order* (``liveness_order.py``),
``document-liveness``'s key without its depth term, from two
:class:`~prefixcache.core.eviction.document_liveness_model.DocumentLivenessModel` fed with
every finished request whichever candidate is followed: one of documents, one of the
conversations inside them (``conversation_tracker.py``). A conversation's own content is
keyed by its chance of going on (or the higher of that and its document's, while it is
its document's only conversation), what it shares with other conversations by its
document's, and silence counts on the conversations' model's clock, where
``document-liveness`` counts it on the documents' (``liveness_classes.py`` says why); each
block holding content remembers the parts of its last release. While it is followed, the
free blocks are also held in a
:class:`~prefixcache.core.eviction.liveness_order.LivenessOrderQueue`, built
from them when it takes the lead and dropped when it loses it, and taken from there; the
segments keep, for a switch back, the order of whichever other candidate's shadow had the
most hits when it took the lead.

Which candidate holds is decided by *shadow caches*, one per candidate: hash-only
segmented LRUs (for the liveness order, a hash-only cache in that order; no KV, no blocks)
of ``sample_rate * num_blocks`` entries, each with a ghost list of its candidate's reach
in its own cache-fulls (``ghost_factor`` times its size), fed with the hashes, among each
finished request's block hashes, whose last byte is below ``256 * sample_rate`` (spatial
sampling: a hash is always in or always out, so the shadows see a consistent miniature of
the traffic), each told which of them the real queue judged low-reuse. A shadow counts a
hit for a sampled hash it holds when the request comes back. Every shadow's hit count
decays by half each time the shadows have seen ``decay_factor`` times their capacity in
sampled hashes, so the choice follows the traffic as it changes. The queue follows the
candidate with the most decayed hits (the first listed among equal counts), but leaves the
current one only for a candidate ahead by more than ``switch_margin`` of its count (noise
in the sample must not make it flap); a switch applies the new order's protected cap at
once, demoting the overflow to probation's tail. It starts at the first candidate, the
design's order with empty blocks first.

Cost: per block taken, a ghost-list entry if it held content; per block released, a
byte-array read, a ghost-list lookup and a note of its release; per finished request, the
liveness models' bookkeeping (a document lookup, a check that none of the prompt's
blocks ends a conversation, for a new conversation a binary search in each of its
document's latest four prompts, and a state in each model; every ``refit_every``
requests a fit over its states), one byte comparison per block hash and, for the sampled
hashes (``sample_rate`` of them), a few table and list operations per shadow. The shadows,
the sample and the per-block work run in C where the package was built with a compiler, in
Python otherwise, with the same decisions (``shadow.py``, ``liveness_order.py``,
``adaptive_bookkeeping.py``). While the liveness order is followed, each block taken, hit
or released also moves in its queue. Memory: the real queue's ghost list (the longest
reach times ``num_blocks`` hashes, each with its eviction count and the signature of its
content when it was still unproven), two bytes and two slots per block, a few counters per
signature, the liveness models' states, at most ``max_documents`` documents and as many
conversations, and the hashes of the prompts kept (at most 200,000), plus, per
shadow, at most ``(1 + ghost_factor) * sample_rate * num_blocks`` hashes (entries and
ghost; ``sample_rate * num_blocks`` is about ``shadow_entries``, and at least ``num_blocks
/ 256``). A prefix-cache reset empties the shadows as well as the queue's marks and ghost;
the learned scores and estimates and the choice are kept. """

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.adaptive_bookkeeping import (
    GhostList,
    mark_hashed,
    note_taken,
    sort_released,
)
from prefixcache.core.eviction.base import CandidateStanding, FreeKVCacheBlockQueue
from prefixcache.core.eviction.conversation_tracker import ConversationTracker
from prefixcache.core.eviction.document_liveness_model import (
    KEPT_TAIL_HASHES,
    DocumentHistory,
    DocumentLivenessModel,
)
from prefixcache.core.eviction.document_tracker import DocumentTracker, prompt_hashes
from prefixcache.core.eviction.learned_reuse import output_length_signature
from prefixcache.core.eviction.liveness_classes import NO_CLASS, LivenessKeyClasses
from prefixcache.core.eviction.liveness_order import (
    UNKNOWN_CLASS,
    LivenessOrderQueue,
    ReleaseParts,
    ShadowLivenessOrder,
)
from prefixcache.core.eviction.segmented import (
    TwoQueueFreeBlockQueue,
    TwoSegmentFreeBlockQueue,
)
from prefixcache.core.eviction.shadow import ShadowSegmentedLRU, sampled_hashes
from prefixcache.core.eviction.signature_reuse import SignatureReuseEstimate
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request, RequestStatus


class Candidate(NamedTuple):
    """One order the queue can follow."""

    protected_fraction: float
    low_reuse_first: bool
    #: Content recomputed while its hash was evicted within the last ``ghost_factor``
    #: cache-fulls of evictions counts as referenced again.
    ghost_factor: int = 4
    #: The liveness order (liveness_order.py) instead of the segments; the other fields
    #: are then unused.
    liveness: bool = False

    @property
    def label(self) -> str:
        if self.liveness:
            return "document liveness"
        return (f"{self.protected_fraction:.0%} protected"
                + (", low-reuse first" if self.low_reuse_first else "")
                + f", ghost {self.ghost_factor}x")


#: The orders the queue chooses among: the design's LRU order, a segmented LRU with half
#: the blocks protected, the LRU order with low-reuse content first, ``2q``'s (90 %
#: protected) with low-reuse content first at two reaches of the ghost list: ``2q``'s 2
#: cache-fulls and twice that, and the liveness order, which ranks content by whether its
#: document is still being asked about rather than by recency. How far back a
#: recomputation still earns protection depends on the traffic: far, where a
#: conversation's next turn comes after thousands of other blocks; not as far, where
#: protecting everything seen twice would crowd out what is used next. ``2q``'s own order
#: is left out: until some kind of request is judged low-reuse, its low-reuse-first twin
#: orders blocks exactly as it does, and every candidate costs a shadow cache fed on every
#: request.
CANDIDATES = (Candidate(0.0, False), Candidate(0.5, False), Candidate(0.0, True),
              Candidate(0.9, True, 2), Candidate(0.9, True, 4),
              Candidate(0.0, False, liveness=True))
#: The protected shares among :data:`CANDIDATES`, in order, without repeats.
CANDIDATE_PROTECTED_FRACTIONS = tuple(dict.fromkeys(c.protected_fraction for c in CANDIDATES
                                                    if not c.liveness))

# Where a free block is: in_upper's values (TwoSegmentFreeBlockQueue uses 0 and 1).
_IN_LOWER, _IN_UPPER, _IN_FIRST = 0, 1, 2
# A block's ``unproven`` state while it holds new content no finished request released.
_NEW = ()


class AdaptiveFreeBlockQueue(TwoQueueFreeBlockQueue):
    """``2q``'s queue, with a first segment for empty and low-reuse blocks, following
    online whichever candidate order its shadows would have hit most with (module
    docstring)."""

    policy_name = "adaptive"
    summary = ("follows online whichever of six orders (recency and protection, or document"
               " liveness) would have hit most")
    shadow_entries = 320  # entries per shadow: sample_rate = shadow_entries / num_blocks
    decay_factor = 4
    switch_margin = 0.02
    # The reuse estimate's counts halve when their decayed insert total passes this x
    # num_blocks.
    reuse_memory_factor = 8
    candidates: tuple[Candidate, ...] = CANDIDATES  # the first is followed at start
    # Documents the liveness model remembers (the least recently asked about forgotten
    # first), and the states it fits on: half of document-liveness's, since every fit
    # runs over all of them and this model runs whichever candidate is followed.
    max_documents = 20_000
    liveness_max_states = 2_500
    # A new conversation's shared blocks are found among its document's latest
    # conversations' prompts, not among every block seen: no insertion per new block
    # (conversation_tracker.py).
    recent_conversations = 4
    # Fits of the conversations' model, every this many finished requests: half as often
    # as the documents', since every fit runs over all the states kept.
    conversation_refit_every = 50
    # The model whose clock counts silence in the liveness order (liveness_classes.py).
    liveness_clock = "conversations"
    # The shadows and the sample, in C when the package was built with a compiler (the
    # same decisions either way: shadow.py).
    shadow_type = ShadowSegmentedLRU
    sampled_hashes = staticmethod(sampled_hashes)
    # The ghost list and the per-block bookkeeping, in C likewise where built (the same
    # decisions either way: adaptive_bookkeeping.py).
    ghost_list_type = GhostList
    liveness_shadow_type = ShadowLivenessOrder
    note_taken = staticmethod(note_taken)
    sort_released = staticmethod(sort_released)
    mark_hashed = staticmethod(mark_hashed)

    @property
    def ghost_factor(self) -> int:
        """The ghost list's reach, in cache-fulls: the longest of the candidates'."""
        return max(candidate.ghost_factor for candidate in self.candidates)

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        self.first = FreeKVCacheBlockQueue(())
        super().__init__(blocks)
        num_blocks = max(1, len(blocks))
        self.num_evicted = 0  # hashed blocks evicted so far: the ghost list's clock
        # The last byte of a hash is uniform: sample the hashes whose byte is below this.
        self.sample_threshold = max(1, min(256, round(256 * self.shadow_entries / num_blocks)))
        self.sample_rate = self.sample_threshold / 256
        shadow_capacity = max(1, round(self.sample_rate * num_blocks))
        # The liveness order's estimates, learned whichever candidate is followed; the
        # parts each block holding content was last released with; the order itself
        # over the free blocks only while it is followed.
        self.liveness = DocumentLivenessModel(max_states=self.liveness_max_states)
        self.documents = DocumentTracker(self.liveness, self.max_documents,
                                         observe_shares=False)
        # And of conversations: a conversation's own content is keyed by its chance of
        # going on, content shared by several by its document's (liveness_classes.py).
        self.conversations = ConversationTracker(
            DocumentLivenessModel(max_states=self.liveness_max_states,
                                  refit_every=self.conversation_refit_every),
            self.max_documents, recent_conversations=self.recent_conversations)
        self.liveness_classes = LivenessKeyClasses(self.liveness, self.conversations.model,
                                                   self.liveness_clock)
        self.release_parts: list[ReleaseParts | None] = [None] * self.num_block_ids
        self.num_releases = 0
        self.liveness_queue: LivenessOrderQueue | None = None
        self.shadows = [self.liveness_shadow_type(shadow_capacity, self.liveness_classes)
                        if c.liveness
                        else self.shadow_type(shadow_capacity, c.protected_fraction,
                                              c.low_reuse_first, c.ghost_factor)
                        for c in self.candidates]
        self.decay_every = self.decay_factor * shadow_capacity
        self.num_sampled_since_decay = 0
        self.num_blocks = num_blocks
        self.reuse = SignatureReuseEstimate(self.reuse_memory_factor * num_blocks)
        # Per block: _NEW while it holds content filled since it was last taken that no
        # finished request has released yet; the [signature, epoch] of its new content
        # while that is unproven (released, not looked up since), one list shared by the
        # blocks a request released; else None.
        self.unproven: list[list | tuple | None] = [None] * self.num_block_ids
        # The real ghost list maps an evicted hash to when it was evicted (num_evicted
        # then) and its content's state at that time.
        self.ghost = self.ghost_list_type(self.max_ghost)
        self.liveness_index = next(
            (index for index, c in enumerate(self.candidates) if c.liveness), None)
        self.leader = 0
        # How many times the leader changed, and per candidate the releases it was
        # followed for, up to the current leader's stint (which began at
        # ``_leader_since``): how the choice went over time, for reports and metrics.
        self.num_switches = 0
        self._releases_followed = [0] * len(self.candidates)
        self._leader_since = 0
        self._follow(self.candidates[0])
        # The engine reads the standings after every step: format the labels once.
        self.candidate_labels = tuple(candidate.label for candidate in self.candidates)

    @property
    def current_candidate(self) -> Candidate:
        return self.candidates[self.leader]

    @property
    def current_protected_fraction(self) -> float:
        """The protected share of the segments (while the liveness order is followed, of
        the order they keep: :meth:`_follow`)."""
        return self.segments_candidate.protected_fraction

    @property
    def follows_liveness(self) -> bool:
        return self.liveness_queue is not None

    @property
    def evicts_low_reuse_first(self) -> bool:
        return self.low_reuse_first_followed

    def _follow(self, candidate: Candidate) -> None:
        if candidate.liveness:
            # The segments keep the best of the other orders, ready for a switch back.
            scores = [shadow.num_hits if not other.liveness else -1.0
                      for shadow, other in zip(self.shadows, self.candidates, strict=True)]
            segments = self.candidates[scores.index(max(scores))]
            if self.liveness_queue is None:
                self.liveness_queue = LivenessOrderQueue.from_free_blocks(
                    self.liveness_classes, self._segment_blocks(), self.release_parts)
        else:
            segments = candidate
            self.liveness_queue = None
        self.segments_candidate = segments
        self.low_reuse_first_followed = segments.low_reuse_first
        self.max_protected = int(segments.protected_fraction * self.num_blocks)
        self.followed_reach = segments.ghost_factor * self.num_blocks
        self._protect([])  # demotes whatever the new cap leaves over to probation

    # -- what the pool calls --------------------------------------------------------------

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n < 0 or n > self.num_free_blocks:
            self._check_take(n)  # raises
        if not n:
            return []
        if self.liveness_queue is not None:
            popped = self.liveness_queue.popleft_n(n)
            for block in popped:
                self._take_from_segments(block)
        elif from_first := self.first.num_free_blocks:
            first = self.first
            from_first = min(n, from_first)
            popped = first.popleft_n(from_first)
            self.num_free_blocks -= from_first
            in_upper = self.in_upper
            for block in popped:
                in_upper[block.block_id] = _IN_LOWER
            if from_first < n:
                popped += self._take_lower_then_upper(n - from_first)
        else:
            popped = self._take_lower_then_upper(n)
        # Blocks holding a hash are about to be evicted by the pool: their hashes join
        # the ghost list.
        self.num_evicted = self.note_taken(popped, self.ghost, self.num_evicted,
                                           self.is_reused, self.unproven, _NEW)
        return popped

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def remove(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        self._take_from_segments(block)
        if self.liveness_queue is not None:
            self.liveness_queue.remove(block)
        self.is_reused[block_id] = 1
        unproven = self.unproven[block_id]
        if unproven:  # neither None nor _NEW: new content, looked up again
            self.reuse.credit(*unproven)
            self.unproven[block_id] = None

    def _take_from_segments(self, block: KVCacheBlock) -> None:
        """Unlink a free block from whichever segment holds it (no other bookkeeping)."""
        block_id = block.block_id
        if self.in_upper[block_id] == _IN_FIRST:
            self.in_upper[block_id] = _IN_LOWER
            self.first.remove(block)
            self.num_free_blocks -= 1
        else:
            TwoSegmentFreeBlockQueue.remove(self, block)

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        """``2q``'s placement, with empty blocks at the head of the first segment and,
        when followed, a finished request's low-reuse new content at its tail (and, while
        the liveness order is followed, its place in that order too); then the shadows
        see the request."""
        finished = request is not None and request.status != RequestStatus.PREEMPTED
        # The liveness models learn from every finished request; each released block
        # holding content remembers the parts it was released with.
        document = self.documents.note_finished(request) if finished else None
        parts, shared_parts, shared_prefix = self._release_parts(request, document)
        own, shared = blocks, ()
        # A finished request's blocks come deepest first, and a shared block is held at
        # least as long as any after it: what it shares and releases comes last.
        if shared_prefix and blocks and blocks[-1].block_hash in shared_prefix:
            shared_hashes = set(shared_prefix)
            split = len(blocks) - 1
            while split and blocks[split - 1].block_hash in shared_hashes:
                split -= 1
            own, shared = blocks[:split], blocks[split:]
        self.mark_hashed(own, self.release_parts, parts)
        if shared:
            self.mark_hashed(shared, self.release_parts, shared_parts)
        if self.liveness_queue is not None:
            self.liveness_queue.add_released(own, parts)
            if shared:
                self.liveness_queue.add_released(shared, shared_parts)
        unproven = self.unproven
        # The (signature, epoch) of this request's new content, shared by its blocks:
        # filled in below. ``lower`` keeps the release order (deepest first) of
        # everything bound for probation; ``new`` is the part of it this request cached
        # new, ``sampled_new`` the hashes of that part the shadows sample. A block in use
        # is never unproven: it was taken (_NEW) or hit (None) since it last was.
        state: list = []
        unhashed, lower, protected, new, sampled_new, credits = self.sort_released(
            blocks, finished, self.is_reused, unproven, self.ghost, self.num_evicted,
            self.followed_reach, self.sample_threshold, state, _NEW)
        for evicted_state in credits:  # unproven new content, wanted again after eviction
            self.reuse.credit(*evicted_state)
        low_reuse = False
        if new:
            signature = output_length_signature(request)
            state += (signature, self.reuse.insert(signature, len(new)))
            low_reuse = self.reuse.is_low_reuse(signature)
        if unhashed:
            self._place_first(unhashed, at_head=True)
        if low_reuse and self.low_reuse_first_followed:
            self._place_first(new, at_head=False)
            lower = ([block for block in lower if unproven[block.block_id] is not state]
                     if len(new) < len(lower) else [])
        if lower:
            self.append_n(lower)
        if protected:
            self._protect(protected)
        if request is not None:
            if self.liveness_index is not None:
                shadow = self.shadows[self.liveness_index]
                shadow.parts, shadow.shared_parts = parts, shared_parts
                # The shared hashes are a prefix of the prompt's, so of the sample's.
                threshold = self.sample_threshold
                shadow.num_shared = (
                    len(shared_prefix) if threshold >= 256 or not shared_prefix
                    else len(self.sampled_hashes(shared_prefix, threshold)))
            self._observe(request.block_hashes,
                          set(sampled_new) if low_reuse and sampled_new else None)

    def _release_parts(self, request: Request | None, document: DocumentHistory | None
                       ) -> tuple[ReleaseParts, ReleaseParts, list[BlockHash]]:
        """The parts of a release: of the request's own content, and of what its
        conversation shares with others, whose hashes (a prefix of its prompt's) come
        third (empty: none). Counts the request on its conversation."""
        liveness, classes = self.liveness, self.liveness_classes
        self.num_releases += 1
        if document is None:
            parts = (UNKNOWN_CLASS, classes.clock, self.num_releases)
            return parts, parts, []
        hashes = prompt_hashes(request)
        # The document's latest prompt before this one, for when the prompts the tracker
        # keeps no longer hold it: what its tail shares still counts
        # (conversation_tracker.py). Kept here, as the document tracker does not observe
        # shares. While the tracker still keeps that prompt (its conversation, first among
        # the document's recent ones, still has it), comparing with the whole prompt finds
        # at least what the tail would, so the tail is not passed.
        recent = document.recent_conversations
        previous_prompt = ((document.num_prompt_blocks, document.prompt_tail_hashes)
                           if document.num_prompt_blocks
                           and (not recent or recent[0].prompt is None) else None)
        document.num_prompt_blocks = len(hashes)
        document.prompt_tail_hashes = hashes[-KEPT_TAIL_HASHES:]
        conversation = self.conversations.note_request(request, hashes, document,
                                                       previous_prompt)
        document_class = liveness.finest_class(document.state_id)
        own_class = classes.key_class(
            document_class if document.num_conversations <= 1 else NO_CLASS,
            self.conversations.model.finest_class(conversation.history.state_id))
        parts = (own_class, classes.clock, self.num_releases)
        if not conversation.own_from:
            return parts, parts, []
        shared_parts = (classes.key_class(document_class, NO_CLASS), classes.clock,
                        self.num_releases)
        return parts, shared_parts, hashes[:conversation.own_from]

    def _place_first(self, blocks: list[KVCacheBlock], at_head: bool) -> None:
        in_upper = self.in_upper
        for block in blocks:
            in_upper[block.block_id] = _IN_FIRST
        if at_head:
            self.first.prepend_n(blocks)
        else:
            self.first.append_n(blocks)
        self.num_free_blocks += len(blocks)

    def _observe(self, block_hashes: list[BlockHash],
                 low_reuse_hashes: set[BlockHash] | None) -> None:
        threshold = self.sample_threshold
        sampled = (self.sampled_hashes(block_hashes, threshold) if threshold < 256
                   else block_hashes)
        if not sampled:
            return
        shadows = self.shadows
        if low_reuse_hashes:
            num_hits = [shadow.access(sampled, low_reuse_hashes) for shadow in shadows]
        else:
            num_hits = [shadow.access(sampled) for shadow in shadows]
        self.num_sampled_since_decay += len(sampled)
        if self.num_sampled_since_decay >= self.decay_every:
            self.num_sampled_since_decay = 0
            for shadow in shadows:
                shadow.num_hits *= 0.5
        # The leader can change only if some shadow hit more than another: adding the
        # same count to every shadow, or halving them all, keeps the leader ahead of each.
        if num_hits.count(num_hits[0]) != len(num_hits):
            scores = [shadow.num_hits for shadow in shadows]
            best = scores.index(max(scores))
            if (best != self.leader
                    and scores[best] > scores[self.leader] * (1 + self.switch_margin)):
                self._releases_followed[self.leader] += self.num_releases - self._leader_since
                self._leader_since = self.num_releases
                self.num_switches += 1
                self.leader = best
                self._follow(self.candidates[best])

    def forget_cached_content(self) -> None:
        first = self.first
        if first.num_free_blocks:
            emptied = first.popleft_n(first.num_free_blocks)
            self.num_free_blocks -= len(emptied)
            for block in emptied:
                self.in_upper[block.block_id] = _IN_LOWER
            self.prepend_n(emptied)
        super().forget_cached_content()
        self.unproven = [_NEW if state is _NEW else None for state in self.unproven]
        for shadow in self.shadows:
            shadow.forget()
        if self.liveness_queue is not None:  # every block is empty now
            self.liveness_queue = LivenessOrderQueue.from_free_blocks(
                self.liveness_classes, self._segment_blocks(), self.release_parts)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """In eviction order: the liveness order's while it is followed, else the first
        segment head to tail, then probation's, then protected's."""
        if self.liveness_queue is not None:
            return self.liveness_queue.get_all_free_blocks()
        return self._segment_blocks()

    def _segment_blocks(self) -> list[KVCacheBlock]:
        return self.first.get_all_free_blocks() + super().get_all_free_blocks()

    def policy_state(self) -> dict:
        """The candidate followed, each candidate's share of the shadows' decayed hits
        (:meth:`candidate_standings`), how many times the one followed changed, and each
        candidate's share of the releases so far during which it was followed
        (:meth:`followed_shares`)."""
        return {"liveness_order": self.follows_liveness,
                "protected_fraction": self.current_protected_fraction,
                "low_reuse_first": self.evicts_low_reuse_first,
                "ghost_factor": self.segments_candidate.ghost_factor,
                "candidate_hit_shares": {standing.label: round(standing.share, 4)
                                         for standing in self.candidate_standings()},
                "switches": self.num_switches,
                "candidate_followed_shares": {
                    label: round(share, 4)
                    for label, share in zip(self.candidate_labels, self.followed_shares(),
                                            strict=True)}}

    def followed_shares(self) -> list[float]:
        """Per candidate, in order, the share of the releases so far (a request's blocks
        freed, finished or preempted) during which it was followed; all zero before the
        first release."""
        followed = list(self._releases_followed)
        followed[self.leader] += self.num_releases - self._leader_since
        return [count / self.num_releases if self.num_releases else 0.0
                for count in followed]

    def candidate_standings(self) -> list[CandidateStanding]:
        """Each candidate's share of the shadows' decayed hits (shares, not counts: the
        counts scale with the sample, which depends on the pool's size, while the choice
        depends only on how they compare), and which one is followed."""
        scores = [shadow.num_hits for shadow in self.shadows]
        total = sum(scores)
        return [CandidateStanding(label, scores[index] / total if total else 0.0,
                                  index == self.leader)
                for index, label in enumerate(self.candidate_labels)]
