"""The values each workload family's parameters may take.

Wide enough for any traffic worth generating, narrow enough that generating a trace ends
in bounded time and memory and every number in it stays finite. (Beyond them a
popularity exponent of 1e12 overflows a float, an infinite mean tool time divides by
zero, and a NaN concentration never finishes drawing a mixture's shares.)
"""

from __future__ import annotations

#: (lowest, highest), both allowed. Token lengths: a prompt part or an answer.
TOKENS = (1, 10_000_000)
#: How many items popularity is drawn over (documents, tenants, system prompts, agents),
#: or a cap on turns, or a number of phases.
COUNT = (1, 1_000_000)
#: Arrivals per second, and times in seconds.
RATE = (1e-6, 1e6)
SECONDS = (1e-6, 1e9)
#: The spread (sigma) of a log-normal draw.
SPREAD = (0.0, 10.0)
#: Zipf exponents: 0 is uniform; beyond 10 nearly every draw is the most popular item.
ZIPF_EXPONENT = (0.0, 10.0)

#: Requests in one trace: more than any trace worth replaying (the replayer holds a whole
#: trace in memory), few enough that a mistyped count is refused rather than running
#: until killed.
MAX_NUM_REQUESTS = 10_000_000

#: Every family's parameters by name (a name means the same in every family that has it).
PARAMETER_RANGES: dict[str, tuple[float, float]] = {
    # chat
    "num_system_prompts": COUNT,
    "system_prompt_zipf_s": ZIPF_EXPONENT,
    "system_prompt_tokens": TOKENS,
    "conversations_per_s": RATE,
    # Below 0.1 a conversation's length overflows a float before it is capped.
    "turns_tail_index": (0.1, 100.0),
    "max_turns": COUNT,
    "first_message_tokens": TOKENS,
    "first_message_sigma": SPREAD,
    "user_tokens": TOKENS,
    "output_tokens": TOKENS,
    "think_time_s": SECONDS,
    "think_time_sigma": SPREAD,
    "max_context_tokens": TOKENS,
    # rag
    "num_documents": COUNT,
    "zipf_s": ZIPF_EXPONENT,
    "document_tokens": TOKENS,
    "question_tokens": TOKENS,
    "follow_up_probability": (0.0, 1.0),
    "requests_per_s": RATE,
    "popularity_drift_every": (0, 1_000_000_000),  # requests; 0 is never
    # agent
    "num_agents": COUNT,
    "tool_context_tokens": TOKENS,
    "task_tokens": TOKENS,
    "sessions_per_s": RATE,
    "mean_steps": (1.0, 1e6),
    "observation_tokens": TOKENS,
    "mean_tool_time_s": SECONDS,
    # tenants
    "num_tenants": COUNT,
    "follow_up_delay_s": SECONDS,
    # mixture
    "num_phases": COUNT,
    "share_concentration": (0.01, 1000.0),
}


def check_parameter(name: str, value: float) -> None:
    """ValueError, naming the range, unless ``value`` is a number within ``name``'s range
    (which NaN and the infinities never are). KeyError for a name no family has."""
    low, high = PARAMETER_RANGES[name]
    if not (isinstance(value, int | float) and low <= value <= high):
        raise ValueError(f"{name} must be between {_readable(low)} and {_readable(high)}, "
                         f"got {shortened(value)}")


def shortened(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to its first ``limit`` characters and its length if longer:
    an error message quotes what it refuses without repeating thousands of characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def _readable(bound: float) -> str:
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"


#: A popularity drift reshuffles every document (tenant): its cost grows with their
#: number, not with the trace. So there may be at most this many of them per request
#: between drifts (``popularity_drift_every``), which bounds what drifting adds to a
#: request at a shuffle of this many items, whatever the counts: without the bound, a
#: million documents redrawn every request would make each request cost a million-item
#: shuffle. Every value the docs use is far within.
MAX_DRIFTING_ITEMS_PER_REQUEST = 100
#: The family whose popularity drifts, and the parameter counting what is reshuffled.
DRIFTING_COUNTS = {"rag": "num_documents", "tenants": "num_tenants"}


def check_drift_cost(workload: str, family: str, num_items: int, drift_every: int) -> None:
    """ValueError, naming ``workload`` and the least ``popularity_drift_every`` allowed,
    if ``family``'s ``num_items`` (its :data:`DRIFTING_COUNTS` parameter) are more than
    :data:`MAX_DRIFTING_ITEMS_PER_REQUEST` per request between drifts; 0 is no drift."""
    if drift_every and num_items > MAX_DRIFTING_ITEMS_PER_REQUEST * drift_every:
        least = -(-num_items // MAX_DRIFTING_ITEMS_PER_REQUEST)
        raise ValueError(f"{workload}: with {DRIFTING_COUNTS[family]}={num_items:,}, "
                         f"popularity_drift_every must be 0 or at least {least:,} (each "
                         f"drift reshuffles all {num_items:,}), got {drift_every:,}")


#: Chat and agent traffic skip a turn whose prompt would pass ``max_context_tokens``. A
#: trace from sensible parameters skips a few in a row at most; this many in a row means
#: the parameters leave no room for a request, and generation stops with a ValueError
#: (:func:`no_room`) instead of drawing forever.
MAX_SKIPPED_IN_A_ROW = 100_000


def no_room(family: str, max_context_tokens: int, lengths: str) -> ValueError:
    """The error for parameters under which no prompt fits ``max_context_tokens``."""
    return ValueError(f"{family}: {MAX_SKIPPED_IN_A_ROW:,} prompts in a row would pass "
                      f"max_context_tokens ({max_context_tokens:,}); raise it or lower "
                      f"{lengths}")
