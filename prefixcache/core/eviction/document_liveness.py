"""``document-liveness``: evicts first the blocks of the documents least likely to be asked
about again.

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

Contract:

- Blocks holding nothing cached are taken first, in the order they were released.
- The blocks one finished request releases at one depth class share a key and form a
  group, kept in release order; among equal keys the group released first goes first.
- After each refit of the model every free group is re-keyed with the new ``p`` and ``r``
  (its ``H(release)`` stays).
- A preempted request's release, or one without a request, is not a request: its blocks
  get the key of an unknown document (``logit`` of the overall ``p``, plus ``H``), and
  the request counts when it finishes.
- A prefix-cache reset moves every free block to the empty blocks, in eviction order;
  what was learned about documents is kept.
- Memory is bounded: at most ``max_documents`` documents (least recently asked about
  forgotten first), each with its latest prompt's last 64 block hashes, and the model's
  bounded states. A group release or removal costs O(log groups); every refit re-keys
  the free groups by their lists, one per (class, depth class): O(classes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prefixcache.core.block import KVCacheBlock
from prefixcache.core.eviction.document_liveness_model import (
    DocumentHistory,
    DocumentLivenessModel,
)
from prefixcache.core.eviction.document_tracker import DocumentTracker, prompt_hashes
from prefixcache.core.eviction.scored import GroupedScoredFreeBlockQueue
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request, RequestStatus

# The class of content released without a finished request to tell its document.
UNKNOWN_CLASS = -1


class DocumentLivenessFreeBlockQueue(GroupedScoredFreeBlockQueue):
    """The ``document-liveness`` policy (module docstring): free blocks keyed by
    ``logit(p) + H(release) + log r(depth)``, lowest evicted first; blocks holding
    nothing cached first of all. The blocks one request releases at one depth class
    share a key, so they form one group and a re-key costs one key per group.
    ``max_documents`` bounds the documents remembered (least recently asked about
    forgotten first); ``model`` is the estimator (default: a
    :class:`DocumentLivenessModel` with its default knobs)."""

    policy_name = "document-liveness"
    summary = ("evicts first what belongs to documents least likely to be asked about "
               "again")

    def __init__(self, blocks: Iterable[KVCacheBlock], *, max_documents: int = 20_000,
                 model: DocumentLivenessModel | None = None) -> None:
        self.tracker = DocumentTracker(model if model is not None else DocumentLivenessModel(),
                                       max_documents)
        self._num_fits_keyed = 0
        # log r(depth) per depth class as at the last re-key, for the listed groups' keys.
        self._log_share_at_rekey = [self.model.log_share_reached(depth)
                                    for depth in range(self.model.max_depth_bits + 1)]
        super().__init__(blocks)

    @property
    def model(self) -> DocumentLivenessModel:
        """The estimator (the document tracker feeds it)."""
        return self.tracker.model

    @model.setter
    def model(self, model: DocumentLivenessModel) -> None:
        self.tracker.model = model

    @property
    def max_documents(self) -> int:
        return self.tracker.max_documents

    @max_documents.setter
    def max_documents(self, value: int) -> None:
        self.tracker.max_documents = value

    @property
    def _documents(self) -> OrderedDict[BlockHash, DocumentHistory]:
        return self.tracker.documents

    def parts_for(self, block: KVCacheBlock) -> tuple[int, float, int] | None:
        """A block released without a (finished) request: an unknown document's,
        released now (empty blocks: None)."""
        if block.block_hash is None:
            return None
        return UNKNOWN_CLASS, self.model.clock, 0

    def key_of_parts(self, parts: tuple[int, float, int]) -> float:
        """``logit(p) + H(release) + log r(depth)`` from the current estimates; parts are
        (finest class or UNKNOWN_CLASS, H at release, depth class)."""
        finest_class, clock, depth = parts
        model = self.model
        if finest_class == UNKNOWN_CLASS:
            return model.overall_log_odds + clock
        return (model.class_log_odds(finest_class) + clock
                + model.log_share_reached(depth))

    def listed_key_of_parts(self, parts: tuple[int, float, int]) -> float:
        """:meth:`key_of_parts` from the estimates at the last re-key: ``p`` changes only
        at a fit, which is followed by a re-key, but ``r`` moves with every request."""
        finest_class, clock, depth = parts
        model = self.model
        if finest_class == UNKNOWN_CLASS:
            return model.overall_log_odds + clock
        return (model.class_log_odds(finest_class) + clock
                + self._log_share_at_rekey[depth])

    def list_of_parts(self, parts: tuple[int, float, int]) -> tuple[int, int]:
        """(class, depth class): under one set of estimates a key is a per-list value plus
        the clock at release, which only advances."""
        return parts[0], parts[2]

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
        document = self.tracker.note_request(request, hashes, block_size)
        if model.num_fits != self._num_fits_keyed:
            # Early estimates are poor; keys frozen at release would keep their errors.
            self._num_fits_keyed = model.num_fits
            self._recompute_keys()
        finest_class = model.finest_class(document.state_id)
        clock = model.clock
        depth_of = dict(zip(hashes, model.depth_classes(len(hashes), block_size), strict=True))
        # One group per depth class, made in the order the classes first appear.
        by_depth: dict[int, list[KVCacheBlock]] = {}
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                self._add_empty(block)
                continue
            # Generated content beyond the prompt counts as its deepest block.
            depth = depth_of.get(block_hash, 0)
            same_depth = by_depth.get(depth)
            if same_depth is None:
                by_depth[depth] = [block]
            else:
                same_depth.append(block)
        for depth, same_depth in by_depth.items():
            self._add_n_to_group(self._new_group((finest_class, clock, depth)), same_depth)

    def policy_state(self) -> dict:
        """The model's overall continuation chance, the mean number of requests between
        an alive document's requests, how many times faster than that rate its clock runs
        (the wait's shape), and :meth:`DocumentLivenessModel.class_estimates`."""
        model = self.model
        return {
            "overall_continuation_probability": model.overall_p,
            "requests_between_a_documents_requests": 1.0 / model.rate,
            "clock_over_fitted_rate": model.wait_shape,
            "classes": model.class_estimates(),
        }

    def forget_cached_content(self) -> None:
        # Every block is empty now: all go before any content cached from here on. What
        # was learned about documents stays true and is kept.
        self._empty_every_block()
