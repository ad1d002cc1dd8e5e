"""Engine counters and gauges: :class:`EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine.

    Cumulative since the engine started: ``prefix_cache_queries`` (prompt tokens looked up
    in the prefix cache, once per request, at its admission), ``prefix_cache_hits`` (of
    those, tokens served from the cache), ``prefix_cache_preempted_queries`` and
    ``prefix_cache_preempted_hits`` (the same for preempted requests readmitted: tokens to
    recompute, and of those, tokens still cached),
    ``num_preemptions``, ``num_evictions`` (cached blocks reused for other content),
    ``prompt_tokens`` (prompt tokens of requests admitted at least once) and
    ``generation_tokens`` (tokens sampled).

    Gauges at the time of the call: ``num_running``, ``num_waiting`` (preempted requests
    included) and ``kv_cache_usage``, the fraction of KV blocks held by requests (0..1).
    """

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    num_preemptions: int = 0
    num_evictions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0
