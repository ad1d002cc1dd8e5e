"""The engine's per-request output state: text so far, stop checks, timing.

The scheduler's :class:`~prefixcache.core.Request` holds the tokens; :class:`RequestState`
holds everything the engine adds on top — sampling options, the request's own random
generator, incremental detokenization, stop-string matching and the timestamps — and turns
them into :class:`RequestOutput` deltas.
"""

from __future__ import annotations

import time

import torch

from prefixcache.core.request import Request, RequestStatus
from prefixcache.engine.outputs import RequestMetrics, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model.detokenizer import IncrementalDetokenizer
from prefixcache.model.tokenizer import Tokenizer


class RequestState:
    """Output bookkeeping of one request.

    Invariants: ``output_text`` is the decoded text of the output tokens minus any stop
    token and minus everything from a matched stop string on; the emitted text
    (``output_text[:num_emitted_chars]``) never includes the last ``len(longest stop) - 1``
    characters while the request runs, since they may be the start of a stop string.
    """

    __slots__ = (
        "request", "params", "generator", "detokenizer", "stop_strings", "stop_token_ids",
        "eos_token_ids", "hold_back_chars", "output_text", "num_emitted_chars",
        "num_emitted_tokens", "num_cached_tokens", "metrics", "finish_reason", "error",
        "prompt", "matched_stop_string",
    )

    def __init__(
        self,
        request: Request,
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        arrival_time: float,
        prompt: str | None = None,
    ) -> None:
        self.request = request
        self.params = params
        self.prompt = prompt
        # A private generator per seeded request: its samples depend only on its own seed
        # and its own history, never on what else shares the batch.
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.is_greedy:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.detokenizer = (
            None if tokenizer is None
            else IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        )
        self.stop_strings = params.stop_strings
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.hold_back_chars = max((len(s) for s in self.stop_strings), default=1) - 1
        self.output_text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.num_cached_tokens: int | None = None  # set at first admission
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.matched_stop_string = False

    def append_token(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Record a sampled token (already appended to the request); return the finished
        status it causes, or None. Order of checks, as in vLLM: a stop string in the new
        text, then EOS / a stop token id, then ``max_tokens``, then the model's context."""
        if self.metrics.first_token_time is None:
            now = time.time()
            self.metrics.first_token_time = now
            self.metrics.time_to_first_token = now - self.metrics.arrival_time
        is_stop_token = token_id in self.eos_token_ids or token_id in self.stop_token_ids
        if self.detokenizer is not None and not is_stop_token:
            new_text = self.detokenizer.add((token_id,))
            if new_text:
                old_len = len(self.output_text)
                self.output_text += new_text
                if self.stop_strings and self._truncate_at_stop_string(old_len):
                    return RequestStatus.FINISHED_STOPPED
        if is_stop_token:
            return RequestStatus.FINISHED_STOPPED
        if self.request.num_output_tokens >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.request.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _truncate_at_stop_string(self, old_len: int) -> bool:
        """Cut ``output_text`` before the earliest stop string that the text added after
        ``old_len`` completes; True if one matched."""
        text = self.output_text
        earliest = -1
        for stop in self.stop_strings:
            # A match must end in the new text, so it starts at most len(stop)-1 earlier.
            index = text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (earliest == -1 or index < earliest):
                earliest = index
        if earliest == -1:
            return False
        self.output_text = text[:earliest]
        self.matched_stop_string = True
        return True

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        self.finish_reason = status.value
        self.error = error
        self.metrics.finished_time = time.time()
        flushed_a_stop_string = (self.detokenizer is not None
                                 and not self.matched_stop_string and self._flush_text())
        if flushed_a_stop_string and status is RequestStatus.FINISHED_LENGTH:
            # Generation did end on that stop string, with its last token.
            self.finish_reason = RequestStatus.FINISHED_STOPPED.value

    def _flush_text(self) -> bool:
        """Append the text the detokenizer still holds back; True if it completed a stop
        string (the text is then cut before it, as for any stop string)."""
        # The detokenizer holds back a trailing incomplete character; at the end, whatever
        # the tokens decode to is the answer (incomplete bytes become U+FFFD, as in HF).
        token_ids = self.request.output_token_ids
        if token_ids and (token_ids[-1] in self.eos_token_ids
                          or token_ids[-1] in self.stop_token_ids):
            token_ids = token_ids[:-1]
        full_text = self.detokenizer.tokenizer.decode(token_ids)
        old_len = len(self.output_text)
        if len(full_text) <= old_len or not full_text.startswith(self.output_text):
            return False
        self.output_text = full_text
        return bool(self.stop_strings) and self._truncate_at_stop_string(old_len)

    def make_output(self) -> RequestOutput:
        """The output for this step: cumulative fields plus the delta since the last one."""
        finished = self.finish_reason is not None
        text = self.output_text
        visible = len(text) if finished else max(self.num_emitted_chars,
                                                 len(text) - self.hold_back_chars)
        token_ids = self.request.output_token_ids
        output = RequestOutput(
            request_id=self.request.request_id,
            prompt_token_ids=self.request.prompt_token_ids,
            text=text[:visible],
            token_ids=token_ids,
            new_text=text[self.num_emitted_chars:visible],
            new_token_ids=token_ids[self.num_emitted_tokens:],
            finished=finished,
            finish_reason=self.finish_reason,
            error=self.error,
            num_cached_tokens=self.num_cached_tokens or 0,
            metrics=RequestMetrics(
                self.metrics.arrival_time, self.metrics.first_token_time,
                self.metrics.time_to_first_token, self.metrics.finished_time,
            ),
            prompt=self.prompt,
        )
        self.num_emitted_chars = visible
        self.num_emitted_tokens = len(token_ids)
        return output
