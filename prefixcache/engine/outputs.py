"""What the engine hands back: :class:`RequestOutput` and its :class:`RequestMetrics`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps of one request, wall-clock seconds since the epoch (``time.time()``).

    ``time_to_first_token`` is ``first_token_time - arrival_time`` in seconds, None until
    the first token is sampled; ``finished_time`` is None until the request finishes.
    """

    arrival_time: float
    first_token_time: float | None = None
    time_to_first_token: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step.

    ``text`` and ``token_ids`` are cumulative; ``new_text`` / ``new_token_ids`` are what
    was added since the previous output for this request (so a streaming client
    concatenates deltas). While running, ``text`` never ends in a broken UTF-8 character
    (its bytes wait for the next token), and while a stop string may still be forming, its
    first characters are held back until decided. At finish everything held back is
    flushed, so bytes the model left incomplete appear as U+FFFD.

    ``finish_reason`` is None while running, then ``"stop"`` (EOS, a stop token id or a
    stop string), ``"length"`` (``max_tokens``, the model's context, or the KV pool),
    ``"abort"`` or ``"error"`` (with ``error`` saying why).

    ``num_cached_tokens`` is the number of prompt tokens served from the prefix cache when
    the request was first admitted (the scheduler's ``num_hit_tokens`` then); it is not
    changed by a later preemption and recomputation.

    ``outputs`` is filled only by ``LLM.generate``/``LLM.chat``: the ``n`` samples of a
    prompt, each itself a RequestOutput; the top-level fields then repeat sample 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list)
