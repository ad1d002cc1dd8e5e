"""Streaming text out of generated token ids, one step at a time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixcache.model.tokenizer import Tokenizer

# Tokens of context kept before the unread ones: enough for a byte-level BPE character
# split across tokens (a UTF-8 character is at most 4 bytes) to decode whole.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Invariant: the concatenation of every delta returned by `add` equals
    `decode(output ids)` once decoding is complete; a delta is held back while the text
    ends in an incomplete UTF-8 sequence (decoded as U+FFFD), so no replacement character is
    ever emitted for a character whose remaining bytes are still to come.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "_prefix_offset", "_read_offset")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The prompt's tail gives the first output token its context (e.g. a leading space).
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)

    def add(self, new_token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.token_ids[self._prefix_offset : self._read_offset], skip)
        full_text = decode(self.token_ids[self._prefix_offset :], skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = max(self._read_offset, len(self.token_ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]
