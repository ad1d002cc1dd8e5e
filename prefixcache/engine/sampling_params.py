"""How to pick tokens and when to stop: :class:`SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass

# Temperatures below this sample greedily (see SamplingParams).
GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping options (vLLM/OpenAI meanings).

    - ``n``: independent samples per prompt. The engine runs one sample per request; ``LLM``
      and the server expand ``n`` into ``n`` requests (with seeds ``seed``, ``seed + 1``, ...).
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it. Below
      ``GREEDY_BELOW`` (1e-5) it is greedy too: dividing by a tinier one overflows float32
      logits into NaN probabilities, and the distribution is argmax by then anyway.
    - ``top_k``: keep the ``k`` most likely tokens; 0 (or -1) keeps all.
    - ``top_p``: keep the smallest set of most likely tokens whose probability reaches it.
    - ``seed``: makes this request's samples reproducible whatever else is in the batch.
    - ``max_tokens``: generate at most this many tokens (finish reason ``"length"``).
    - ``stop``: strings that end generation (finish reason ``"stop"``); the stop string and
      anything after it are not part of the returned text.
    - ``stop_token_ids``: token ids that end generation; they are kept in ``token_ids`` but
      not rendered into the text, like EOS.
    - ``ignore_eos``: keep generating past the model's end-of-sequence tokens.

    Call :meth:`validate` (the engine does) to get a ValueError naming any bad option.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first invalid option."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if (not _is_number(self.temperature) or self.temperature < 0.0
                or self.temperature == float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, "
                             f"got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1: no limit), "
                             f"got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -(2**63) <= self.seed < 2**63):
            # A torch generator's seed is a 64-bit integer; the server and CLI take signed.
            raise ValueError(f"seed must be a signed 64-bit integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        stops = self.stop_strings
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, "
                             f"got {self.stop!r}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or any(not _is_int(t) or t < 0 for t in self.stop_token_ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, "
                             f"got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        try:
            return tuple(self.stop)
        except TypeError:
            raise ValueError(f"stop must be a string or a list of strings, "
                             f"got {self.stop!r}") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
