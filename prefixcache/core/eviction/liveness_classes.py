"""The classes ``adaptive``'s liveness order keys content by, when it follows
conversations as well as documents.

Content a conversation shares with others (a system prompt) is judged by its document's
class; a conversation's own content by the conversation's class, or by the higher of the
two while its document has had only that one conversation (as in ``document-liveness``).
Each such pair (document class, conversation class; either may be left out) is a *key
class*, numbered as met, whose log-odds are the document's, the conversation's, or the
higher of the two, from the models' latest fits.

:class:`LivenessKeyClasses` reads as the one model the liveness order expects
(``liveness_order.py``): its classes are the key classes, its clock one model's (by
default the conversations': silence then counts at the pace a live conversation's next
turn comes), and it has refitted whenever either model has.

Why the conversations' clock. A model's clock runs at the rate at which its live
documents' next requests come. Where many conversations share a document (a system
prompt), that document is asked about far more often than any one conversation goes on,
so the documents' clock runs many times faster than the conversations': keyed on it, a
conversation's content is written off after a pause that is ordinary between two turns,
and recency outweighs what the conversations' model knows (that a conversation past its
first turn is far likelier to go on). One clock keeps the order a single static one;
content shared by several conversations is keyed on it too.
"""

from __future__ import annotations

from prefixcache.core.eviction.document_liveness_model import DocumentLivenessModel

#: Leaves a document's or a conversation's class out of a key class.
NO_CLASS = -2


class LivenessKeyClasses:
    """Key classes over ``documents`` and ``conversations``, two liveness models fed the
    same finished requests (module docstring). :meth:`key_class` numbers a pair; the
    rest is what the liveness order reads of a model. ``clock`` names the model (one of
    :attr:`CLOCKS`) whose clock every key is read on."""

    #: The models whose clock a key class can be read on.
    CLOCKS = ("conversations", "documents")

    def __init__(self, documents: DocumentLivenessModel,
                 conversations: DocumentLivenessModel,
                 clock: str = "conversations") -> None:
        if clock not in self.CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(self.CLOCKS)}, got {clock!r}")
        self.documents = documents
        self.conversations = conversations
        self.clock_model = conversations if clock == "conversations" else documents
        self._ids: dict[tuple[int, int], int] = {}
        self._pairs: list[tuple[int, int]] = []
        self._log_odds: list[float] = []
        self._fits_behind = self.num_fits

    def key_class(self, document_class: int, conversation_class: int) -> int:
        """The id of the key class of this pair (NO_CLASS leaves one out; not both)."""
        pair = (document_class, conversation_class)
        key_class = self._ids.get(pair)
        if key_class is None:
            if document_class == NO_CLASS and conversation_class == NO_CLASS:
                raise ValueError("a key class needs a document's or a conversation's class")
            key_class = self._ids[pair] = len(self._pairs)
            self._pairs.append(pair)
            self._log_odds.append(self._pair_log_odds(pair))
        return key_class

    def _pair_log_odds(self, pair: tuple[int, int]) -> float:
        document_class, conversation_class = pair
        if conversation_class == NO_CLASS:
            return self.documents.class_log_odds(document_class)
        log_odds = self.conversations.class_log_odds(conversation_class)
        if document_class != NO_CLASS:
            log_odds = max(log_odds, self.documents.class_log_odds(document_class))
        return log_odds

    @property
    def num_fits(self) -> int:
        """Changes whenever either model refits."""
        return self.documents.num_fits + self.conversations.num_fits

    @property
    def clock(self) -> float:
        """The clock every key is read on (module docstring)."""
        return self.clock_model.clock

    @property
    def overall_log_odds(self) -> float:
        return self.documents.overall_log_odds

    @property
    def all_class_log_odds(self) -> list[float]:
        """The log-odds of every key class, by id, from the models' latest fits (this
        object's own list: read it, do not change it)."""
        num_fits = self.num_fits
        if num_fits != self._fits_behind:
            self._fits_behind = num_fits
            self._log_odds = [self._pair_log_odds(pair) for pair in self._pairs]
        return self._log_odds

    def class_log_odds(self, key_class: int) -> float:
        return self.all_class_log_odds[key_class]
