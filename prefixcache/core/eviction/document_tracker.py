"""The documents a liveness model learns from: each finished request counted on its
document, and the model told.

A *document* is the content behind the first full block of a prompt: every request whose
prompt starts with the same block (same hash, so same tokens, salt and LoRA) asks about
the same document. ``document-liveness`` and ``adaptive``'s liveness candidate both keep
one of these beside their :class:`DocumentLivenessModel`.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixcache.core.eviction.document_liveness_model import (
    KEPT_TAIL_HASHES,
    DocumentHistory,
    DocumentLivenessModel,
)
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request, RequestStatus


def prompt_hashes(request: Request | None) -> list[BlockHash]:
    """The hashes of the request's full prompt blocks (not of generated tokens); empty
    without a request, hashes or a hasher."""
    if request is None or not request.block_hashes or request.block_hasher is None:
        return []
    num_prompt_blocks = request.num_prompt_tokens // request.block_hasher.block_size
    return request.block_hashes[:num_prompt_blocks]


class DocumentTracker:
    """At most ``max_documents`` documents (the least recently asked about forgotten
    first), each a :class:`DocumentHistory`, fed to ``model`` as their requests finish.
    With ``observe_shares``, what each document's next request shares of its previous
    prompt is observed too (the model's ``r(depth)``); each document then keeps its latest
    prompt's last :data:`KEPT_TAIL_HASHES` hashes."""

    def __init__(self, model: DocumentLivenessModel, max_documents: int = 20_000,
                 observe_shares: bool = True) -> None:
        self.model = model
        self.max_documents = max_documents
        self.observe_shares = observe_shares
        self.documents: OrderedDict[BlockHash, DocumentHistory] = OrderedDict()

    def note_finished(self, request: Request | None) -> DocumentHistory | None:
        """Count a request that finished (one preempted, or without full prompt blocks,
        is not counted: returns None) on its document, a tick of the model's time and a
        new state; returns the document."""
        if (request is None or request.status is RequestStatus.PREEMPTED
                or not request.block_hashes or request.block_hasher is None):
            return None
        block_size = request.block_hasher.block_size
        num_prompt_blocks = request.num_prompt_tokens // block_size
        if not num_prompt_blocks:
            return None
        # Without shares to observe, only the first hash and the count are needed.
        hashes = request.block_hashes[:num_prompt_blocks] if self.observe_shares else None
        return self.note(request, request.block_hashes[0], num_prompt_blocks, hashes,
                         block_size)

    def note_request(self, request: Request, hashes: list[BlockHash],
                     block_size: int) -> DocumentHistory:
        """:meth:`note_finished` for a request known to count, with its prompt's full
        block ``hashes``."""
        return self.note(request, hashes[0], len(hashes), hashes, block_size)

    def note(self, request: Request, root: BlockHash, num_prompt_blocks: int,
             hashes: list[BlockHash] | None, block_size: int) -> DocumentHistory:
        """Count a finished ``request`` with ``num_prompt_blocks`` full prompt blocks on
        the document named ``root`` (made if new); ``hashes`` are its prompt's full block
        hashes, needed only with ``observe_shares`` (else None, and ``block_size`` is
        unused)."""
        documents = self.documents
        document = documents.get(root)
        prompt_tokens = request.num_prompt_tokens
        model = self.model
        if document is None:
            document = documents[root] = DocumentHistory(prompt_tokens, request.num_output_tokens)
            if len(documents) > self.max_documents:
                documents.popitem(last=False)
        else:
            documents.move_to_end(root)
            document.min_prompt_tokens = min(document.min_prompt_tokens, prompt_tokens)
            document.max_prompt_tokens = max(document.max_prompt_tokens, prompt_tokens)
            if self.observe_shares:
                model.observe_next_request(document.num_prompt_blocks,
                                           document.prompt_tail_hashes, hashes, block_size)
        document.num_requests += 1
        if self.observe_shares:
            document.num_prompt_blocks = num_prompt_blocks
            document.prompt_tail_hashes = hashes[-KEPT_TAIL_HASHES:]
        model.tick()
        document.state_id = model.new_state(document)
        return document
