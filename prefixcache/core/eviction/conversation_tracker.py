"""The conversations inside documents: which earlier request a request goes on from, and
which of its blocks are its conversation's own.

A *document* (``document_tracker.py``) is everything behind a prompt's first block. Where
many conversations start with one system prompt they are all one document, and whether
that document is asked about again says little about whether one of its conversations
goes on. A *conversation* is a chain of requests each of whose prompts contains the
previous one's: a request goes on from the conversation whose latest prompt's last full
block its prompt contains (the deepest such block if there are several); otherwise it
starts a conversation. Hashes chain, so containing that block means containing the whole
previous prompt: a conversation's next request reaches all of its blocks.

A conversation's *own* blocks start at the first block of its first prompt that no
earlier prompt had. The blocks before are shared with other conversations (a system
prompt, a document asked about again) and stay the document's. Only prompts of the same
document can share blocks (they share the first), so where the blocks seen have been
forgotten, the shared part is at least what the document's latest prompt shares with it.

Which blocks earlier prompts had is known in one of two ways. By default every prompt
block seen is remembered (a dictionary insertion per new block). With
``recent_conversations=K``, each document remembers instead the latest prompts of its K
most recent conversations, and a new conversation shares the longest prefix it has in
common with one of them (a binary search on each, no insertion): the same answer
whenever a conversation branches off one of those K, as under a system prompt or a
document asked about again, at a fraction of the cost per request.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat

from prefixcache.core.eviction.document_liveness_model import (
    DocumentHistory,
    DocumentLivenessModel,
    tail_blocks_shared,
)
from prefixcache.core.eviction.document_tracker import DocumentTracker
from prefixcache.core.hashing import BlockHash
from prefixcache.core.request import Request


class Conversation:
    """One conversation: the hash that names it (its first prompt's last full block), the
    position of its first own block, and its history in the conversations' model."""

    __slots__ = ("name", "own_from", "history", "prompt")

    def __init__(self, name: BlockHash, own_from: int) -> None:
        self.name = name
        self.own_from = own_from
        self.history: DocumentHistory | None = None
        # Its latest prompt's hashes, while kept (``recent_conversations`` only).
        self.prompt: list[BlockHash] | None = None


def common_prefix_length(first: list[BlockHash], second: list[BlockHash],
                         known: int = 0) -> int:
    """How many leading hashes two prompts share, known to be at least ``known``. Hashes
    chain, so what they share is a prefix: a binary search finds its end."""
    low, high = known, min(len(first), len(second))
    while low < high:
        middle = (low + high) // 2
        if first[middle] == second[middle]:
            low = middle + 1
        else:
            high = middle
    return low


class ConversationTracker:
    """Finds each finished request's conversation (module docstring) and feeds ``model``,
    a :class:`DocumentLivenessModel` of its own whose *documents* are conversations: its
    ``p`` is the chance that a conversation goes on.

    Memory is bounded: at most ``max_conversations`` conversations (the least recently
    continued forgotten first; a request that would have continued a forgotten one starts
    a new one) and ``max_seen_hashes`` prompt block hashes (past that, all but the half
    seen last are forgotten; a forgotten block counts as never seen, but for what the
    document's latest prompt shows). A request costs a check, in C, that none of its
    blocks ends a conversation; in Python, a scan from the prompt's end to the block a
    continued conversation ended on, or a binary search for a new conversation's first
    own block; and one dictionary insertion per block not seen before.

    With ``recent_conversations=K`` (module docstring) no block is inserted: a request
    keeps a reference to its prompt's hashes, and ``max_seen_hashes`` bounds the hashes
    the prompts kept hold (past it, the prompts kept longest are dropped); a new
    conversation costs a binary search in each of its document's K latest prompts."""

    def __init__(self, model: DocumentLivenessModel, max_conversations: int = 20_000,
                 max_seen_hashes: int = 200_000, recent_conversations: int = 0) -> None:
        for name, value, smallest in (("max_conversations", max_conversations, 1),
                                      ("max_seen_hashes", max_seen_hashes, 1),
                                      ("recent_conversations", recent_conversations, 0)):
            if not isinstance(value, int) or value < smallest:
                raise ValueError(f"{name} must be an integer >= {smallest}, got {value!r}")
        self.max_seen_hashes = max_seen_hashes
        self.recent_conversations = recent_conversations
        # With recent_conversations: the prompts kept, oldest first, each with its
        # conversation, and how many hashes they hold (superseded ones included, until
        # they leave: what is held stays within max_seen_hashes).
        self._kept: deque[tuple[Conversation, list[BlockHash]]] = deque()
        self._num_kept_hashes = 0
        # The histories, by conversation name (a conversation's prompts grow, its name
        # stays); the model learns from them as a document tracker's model would.
        self.histories = DocumentTracker(model, max_conversations, observe_shares=False)
        # Each conversation by the last full block of its latest prompt, least recently
        # continued first.
        self._by_tail: OrderedDict[BlockHash, Conversation] = OrderedDict()
        # Every prompt block seen, oldest first. Hashes chain: a prompt whose block was
        # seen had every block before it too, so the blocks of a prompt seen before are
        # a prefix of it (but for blocks forgotten), and only the blocks after that
        # prefix need adding.
        self._seen: dict[BlockHash, None] = {}

    @property
    def model(self) -> DocumentLivenessModel:
        return self.histories.model

    @property
    def max_conversations(self) -> int:
        return self.histories.max_documents

    def note_request(self, request: Request, hashes: list[BlockHash], document: DocumentHistory,
                     previous_prompt: tuple[int, list[BlockHash]] | None = None,
                     ) -> Conversation:
        """Count a finished request with its prompt's full block ``hashes`` (at least
        one) on its conversation, found or started; a new conversation is counted on
        ``document`` (its ``num_conversations``). ``previous_prompt``, the number of full
        blocks of the document's latest prompt before this one and the hashes of its last
        ones, if known, bounds a new conversation's shared part from below. Returns the
        conversation."""
        by_tail = self._by_tail
        conversation = None
        if not by_tail.keys().isdisjoint(hashes):
            for position in range(len(hashes) - 1, -1, -1):
                conversation = by_tail.pop(hashes[position], None)
                if conversation is not None:
                    # Everything up to here was its latest prompt, seen then.
                    new_from = position + 1
                    break
        seen = self._seen
        if conversation is None:
            if self.recent_conversations:
                # The longest prefix shared with one of them: a prompt can share more
                # than the longest so far only if it shares the block after it.
                low = 0
                for recent in document.recent_conversations:
                    prompt = recent.prompt
                    if (prompt is not None and low < len(prompt) and low < len(hashes)
                            and prompt[low] == hashes[low]):
                        low = common_prefix_length(prompt, hashes, low + 1)
            else:
                # The first block not seen: the seen ones are a prefix of the prompt.
                low, high = 0, len(hashes)
                while low < high:
                    middle = (low + high) // 2
                    if hashes[middle] in seen:
                        low = middle + 1
                    else:
                        high = middle
            # Without recent conversations, every block from the first unseen on is added
            # as seen, including any that the document's latest prompt shows was shared
            # (and so was forgotten).
            new_from = own_from = low
            if previous_prompt is not None:
                previous_num_blocks, previous_tail = previous_prompt
                in_tail = tail_blocks_shared(previous_num_blocks, previous_tail, hashes)
                if in_tail:
                    own_from = max(own_from, previous_num_blocks - len(previous_tail) + in_tail)
            conversation = Conversation(hashes[-1], own_from)
            document.num_conversations += 1
        by_tail[hashes[-1]] = conversation
        if len(by_tail) > self.max_conversations:
            by_tail.popitem(last=False)
        if self.recent_conversations:
            self._keep_prompt(conversation, hashes, document)
        elif new_from < len(hashes):
            seen.update(zip(hashes[new_from:], repeat(None)))
            if len(seen) > self.max_seen_hashes:
                self._seen = dict(islice(seen.items(), len(seen) - self.max_seen_hashes // 2,
                                         None))
        conversation.history = self.histories.note(request, conversation.name, len(hashes),
                                                   None, 0)
        return conversation

    def _keep_prompt(self, conversation: Conversation, hashes: list[BlockHash],
                     document: DocumentHistory) -> None:
        """Keep ``hashes`` as the conversation's latest prompt, the conversation first
        among its document's recent ones, and the hashes kept within bounds."""
        conversation.prompt = hashes
        recent = document.recent_conversations
        if recent and recent[0] is not conversation:
            if conversation in recent:
                recent.remove(conversation)
            elif len(recent) >= self.recent_conversations:
                recent.pop()
            recent.insert(0, conversation)
        elif not recent:
            recent.append(conversation)
        kept = self._kept
        kept.append((conversation, hashes))
        self._num_kept_hashes += len(hashes)
        while self._num_kept_hashes > self.max_seen_hashes and len(kept) > 1:
            dropped_from, dropped = kept.popleft()
            self._num_kept_hashes -= len(dropped)
            if dropped_from.prompt is dropped:
                dropped_from.prompt = None
