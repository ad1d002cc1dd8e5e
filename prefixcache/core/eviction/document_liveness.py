"""``document-liveness``: evicts first the blocks of the documents and conversations least
likely to be asked about again.

A *document* is the content behind the first full block of a prompt: every request whose
prompt starts with the same block (same hash, so same tokens, salt and LoRA) asks about
the same document. A free block holding cached content is keyed

    ``logit(p) + H(release) + log r(depth)``

and the lowest key is evicted first, with the estimates of
:class:`~prefixcache.core.eviction.document_liveness_model.DocumentLivenessModel`: ``p``
the chance that a document of its class gets another request, ``H(release)`` the clock
when the block was released, ``r(depth)`` the share of blocks at its depth class that a
document's next request shares. After a silence, a document's log-odds of being alive are
``logit(p) + H(release) - H(now)``; ``H(now)`` is common to every block, so the key ranks
free blocks by their chance of being alive and reached again.

Many conversations may share one document (a system prompt). With ``conversations`` (the
default), a :class:`~prefixcache.core.eviction.conversation_tracker.ConversationTracker`
finds each request's conversation and where the conversation's own blocks start, and a
second model gives ``q``, the chance that a conversation of its class goes on. A
conversation's own blocks are keyed ``logit(q) + H(release)`` (its next request reaches
its whole prompt: no depth term), or the higher of that and the document's key while the
document has had only one conversation; the blocks it shares with other conversations
keep the document's key. ``H`` is the documents' model's clock for both.

Contract:

- Blocks holding nothing cached are taken first, in the order they were released.
- The blocks one finished request releases with the same terms (depth class; shared or
  own) share a key and form a group, kept in release order; among equal keys the group
  released first goes first.
- After each refit of the models every free group is re-keyed with the new ``p``, ``q``
  and ``r`` (its ``H(release)`` stays).
- A preempted request's release, or one without a request, is not a request: its blocks
  get the key of an unknown document (``logit`` of the overall ``p``, plus ``H``), and
  the request counts when it finishes.
- A prefix-cache reset moves every free block to the empty blocks, in eviction order;
  what was learned about documents and conversations is kept.
- Memory is bounded: at most ``max_documents`` documents (least recently asked about
  forgotten first), each with its latest prompt's last 64 block hashes, as many
  conversations, the conversation tracker's 200,000 prompt block hashes, and the models'
  bounded states. A group release or removal costs O(log groups); every refit re-keys
  the free groups by their lists, one per (document class, depth class, conversation
  class): O(classes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.conversation_tracker import ConversationTracker
from prefixcache.core.eviction.document_liveness_model import (
    DocumentHistory,
    DocumentLivenessModel,
)
from prefixcache.core.eviction.document_tracker import DocumentTracker, prompt_hashes
from prefixcache.core.eviction.scored import GroupedScoredFreeBlockQueue
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request, RequestStatus

# The document class of content released without a finished request to tell its document.
UNKNOWN_CLASS = -1
# A class that does not count in a key: the conversation's, for blocks its conversation
# shares with others; the document's, for a conversation's own blocks once the document
# has had more than one conversation.
NO_CLASS = -2


class DocumentLivenessFreeBlockQueue(GroupedScoredFreeBlockQueue):
    """The ``document-liveness`` policy (module docstring): free blocks keyed by
    ``logit(p) + H(release) + log r(depth)``, lowest evicted first; blocks holding
    nothing cached first of all. The blocks one request releases with one key's terms
    (depth class, own or shared) share a key, so they form one group and a re-key costs
    one key per group. ``max_documents`` bounds the documents remembered (least recently
    asked about forgotten first); ``model`` is the documents' estimator (default: a
    :class:`DocumentLivenessModel` with its default knobs). With ``conversations``
    (default), a conversation's own blocks are judged by whether it goes on, with a
    model of their own (``conversation_model``, default like ``model``'s) and at most
    ``max_documents`` conversations; without, every block by its document alone."""

    policy_name = "document-liveness"
    summary = ("evicts first what belongs to documents and conversations least likely to "
               "be asked about again")

    def __init__(self, blocks: Iterable[KVCacheBlock], *, max_documents: int = 20_000,
                 model: DocumentLivenessModel | None = None, conversations: bool = True,
                 conversation_model: DocumentLivenessModel | None = None) -> None:
        self.tracker = DocumentTracker(model if model is not None else DocumentLivenessModel(),
                                       max_documents)
        self.conversations = (ConversationTracker(
            conversation_model if conversation_model is not None else DocumentLivenessModel(),
            max_documents) if conversations else None)
        self._num_fits_keyed = (0, 0)
        # log r(depth) per depth class as at the last re-key, for the listed groups' keys.
        self._log_share_at_rekey = [self.model.log_share_reached(depth)
                                    for depth in range(self.model.max_depth_bits + 1)]
        super().__init__(blocks)

    @property
    def model(self) -> DocumentLivenessModel:
        """The documents' estimator (the document tracker feeds it)."""
        return self.tracker.model

    @model.setter
    def model(self, model: DocumentLivenessModel) -> None:
        self.tracker.model = model

    @property
    def conversation_model(self) -> DocumentLivenessModel | None:
        """The conversations' estimator (None without ``conversations``)."""
        return self.conversations.model if self.conversations is not None else None

    @property
    def max_documents(self) -> int:
        return self.tracker.max_documents

    @max_documents.setter
    def max_documents(self, value: int) -> None:
        self.tracker.max_documents = value

    @property
    def _documents(self) -> OrderedDict[BlockHash, DocumentHistory]:
        return self.tracker.documents

    def parts_for(self, block: KVCacheBlock) -> tuple[int, float, int, int] | None:
        """A block released without a (finished) request: an unknown document's,
        released now (empty blocks: None)."""
        if block.block_hash is None:
            return None
        return UNKNOWN_CLASS, self.model.clock, 0, NO_CLASS

    def key_of_parts(self, parts: tuple[int, float, int, int]) -> float:
        """The key from the current estimates; parts are (the document's finest class,
        UNKNOWN_CLASS or NO_CLASS; H at release; depth class; the conversation's finest
        class or NO_CLASS). With both classes, the higher of the two terms counts: a
        block is reached again if either its document or its conversation is."""
        return self._key(parts, self.model.log_share_reached(parts[2]))

    def listed_key_of_parts(self, parts: tuple[int, float, int, int]) -> float:
        """:meth:`key_of_parts` from the estimates at the last re-key: ``p`` changes only
        at a fit, which is followed by a re-key, but ``r`` moves with every request."""
        return self._key(parts, self._log_share_at_rekey[parts[2]])

    def _key(self, parts: tuple[int, float, int, int], log_share: float) -> float:
        document_class, clock, _, conversation_class = parts
        model = self.model
        if document_class == UNKNOWN_CLASS:
            return model.overall_log_odds + clock
        if conversation_class == NO_CLASS:
            return model.class_log_odds(document_class) + log_share + clock
        # A conversation goes on with the whole of its latest prompt: no depth term.
        term = self.conversations.model.class_log_odds(conversation_class)
        if document_class != NO_CLASS:
            term = max(term, model.class_log_odds(document_class) + log_share)
        return term + clock

    def list_of_parts(self, parts: tuple[int, float, int, int]) -> tuple[int, int, int]:
        """(document class, depth class, conversation class): under one set of estimates a
        key is a per-list value plus the clock at release, which only advances."""
        return parts[0], parts[2], parts[3]

    def _recompute_keys(self) -> None:
        model = self.model
        self._log_share_at_rekey = [model.log_share_reached(depth)
                                    for depth in range(model.max_depth_bits + 1)]
        super()._recompute_keys()

    def release(self, blocks: list[KVCacheBlock], request: Request | None = None) -> None:
        hashes = prompt_hashes(request)
        if not hashes or request.status is RequestStatus.PREEMPTED:
            self.append_n(blocks)
            return
        model = self.model
        block_size = request.block_hasher.block_size
        conversations = self.conversations
        previous = self.tracker.documents.get(hashes[0]) if conversations is not None else None
        # The document's latest prompt before this one (noting this one replaces it).
        previous_prompt = (None if previous is None
                           else (previous.num_prompt_blocks, previous.prompt_tail_hashes))
        document = self.tracker.note_request(request, hashes, block_size)
        conversation = (conversations.note_request(request, hashes, document, previous_prompt)
                        if conversations is not None else None)
        num_fits = (model.num_fits, conversations.model.num_fits if conversations else 0)
        if num_fits != self._num_fits_keyed:
            # Early estimates are poor; keys frozen at release would keep their errors.
            self._num_fits_keyed = num_fits
            self._recompute_keys()
        document_class = model.finest_class(document.state_id)
        clock = model.clock
        depths = model.depth_classes(len(hashes), block_size)
        if conversation is None:
            own_from = len(hashes)
            conversation_class, own_document_class = NO_CLASS, document_class
        else:
            own_from = conversation.own_from
            conversation_class = conversations.model.finest_class(
                conversation.history.state_id)
            # While the document has had one conversation, its own blocks are the
            # document's too; after, a conversation's own blocks are its alone.
            own_document_class = (document_class if document.num_conversations <= 1
                                  else NO_CLASS)
        shared_terms = [(document_class, depth, NO_CLASS) for depth in depths[:own_from]]
        own_terms = [(own_document_class, depth if own_document_class != NO_CLASS else 0,
                      conversation_class) for depth in depths[own_from:]]
        terms_of = dict(zip(hashes, shared_terms + own_terms, strict=True))
        # Generated content beyond the prompt counts as its deepest own block.
        beyond_prompt = (own_document_class, 0, conversation_class)
        # One group per key's terms, made in the order they first appear.
        by_terms: dict[tuple[int, int, int], list[KVCacheBlock]] = {}
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                self._add_empty(block)
                continue
            terms = terms_of.get(block_hash, beyond_prompt)
            same_terms = by_terms.get(terms)
            if same_terms is None:
                by_terms[terms] = [block]
            else:
                same_terms.append(block)
        for (document_term, depth, conversation_term), same_terms in by_terms.items():
            self._add_n_to_group(
                self._new_group((document_term, clock, depth, conversation_term)), same_terms)

    def policy_state(self) -> dict:
        """The model's overall continuation chance, the mean number of requests between
        an alive document's requests, how many times faster than that rate its clock runs
        (the wait's shape), and :meth:`DocumentLivenessModel.class_estimates`; with
        conversations, under ``conversations`` the conversations' model's overall chance
        of going on and its class estimates."""
        model = self.model
        state = {
            "overall_continuation_probability": model.overall_p,
            "requests_between_a_documents_requests": 1.0 / model.rate,
            "clock_over_fitted_rate": model.wait_shape,
            "classes": model.class_estimates(),
        }
        if self.conversations is not None:
            conversation_model = self.conversations.model
            state["conversations"] = {
                "overall_continuation_probability": conversation_model.overall_p,
                "classes": conversation_model.class_estimates(),
            }
        return state

    def forget_cached_content(self) -> None:
        # Every block is empty now: all go before any content cached from here on. What
        # was learned about documents stays true and is kept.
        self._empty_every_block()
