"""Engine counters and gauges, declared once: :class:`EngineStats`.

Each field declares its Prometheus metric (name without the ``prefixcache:`` prefix,
kind, help) in its metadata (:func:`stat`). ``LLMEngine.get_stats`` fills the fields,
``AsyncLLM.get_stats`` adds the event publisher's, and the server's ``/metrics``
collector iterates :func:`metric_fields`: a new stat is a new field here plus the line
that produces its value.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

from prefixcache.core.eviction.base import CandidateStanding

COUNTER = "counter"
GAUGE = "gauge"
STAT = "stat"  # the field metadata key


@dataclass(frozen=True, slots=True)
class Stat:
    """A stat's metric: ``kind`` (``counter``: cumulative since the engine started, exposed
    with a ``_total`` suffix; ``gauge``: a value at the time of the call), ``metric``
    (the name after the prefix) and ``help``. ``prefix_cache`` names the
    :class:`~prefixcache.core.PrefixCacheStats` field a counter accumulates, if any;
    ``kv_tier`` the :class:`~prefixcache.kv_tier.KVTierStats` field it copies."""

    kind: str
    metric: str | None
    help: str
    prefix_cache: str | None = None
    kv_tier: str | None = None


def stat(kind: str, help: str, *, metric: str | None = None,
         prefix_cache: str | None = None, kv_tier: str | None = None,
         default: Any = 0) -> Any:
    """A field declaring one stat; its metric is named like the field unless ``metric``
    says otherwise (vLLM's name, where vLLM has the metric)."""
    return field(default=default,
                 metadata={STAT: Stat(kind, metric, help, prefix_cache, kv_tier)})


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine: counters since it started, gauges at the time of the call.

    The prefix-cache counters count once per request, at its admission: prompt tokens
    looked up (``prefix_cache_queries``) and of those, tokens served from the cache
    (``prefix_cache_hits``); readmitted preempted requests are counted apart
    (``prefix_cache_preempted_*``: tokens to recompute, and of those, tokens still cached).
    ``kv_cache_usage`` is the fraction (0..1) of KV blocks held by requests.
    """

    prefix_cache_queries: int = stat(
        COUNTER, "Prompt tokens looked up in the prefix cache.", prefix_cache="queries")
    prefix_cache_hits: int = stat(
        COUNTER, "Prompt tokens served from the prefix cache.", prefix_cache="hits")
    prefix_cache_preempted_queries: int = stat(
        COUNTER, "Tokens of readmitted preempted requests looked up in the prefix cache.",
        prefix_cache="preempted_queries")
    prefix_cache_preempted_hits: int = stat(
        COUNTER, "Tokens of readmitted preempted requests served from the prefix cache.",
        prefix_cache="preempted_hits")
    prompt_tokens: int = stat(COUNTER, "Prompt tokens of admitted requests.")
    generation_tokens: int = stat(COUNTER, "Generated tokens.")
    num_preemptions: int = stat(
        COUNTER, "Requests preempted (blocks freed, to be recomputed).")
    num_evictions: int = stat(COUNTER, "Cached blocks evicted to make room.")
    eviction_policy_switches: int = stat(
        COUNTER, "Times an eviction policy that chooses among orders online (adaptive) "
        "changed the one it follows.")
    num_steps: int = stat(
        COUNTER, "Engine steps run; each step is one batch of requests.",
        metric="engine_steps")
    kv_events_published: int = stat(COUNTER, "KV event batches sent to subscribers.")
    kv_events_dropped: int = stat(
        COUNTER, "KV event batches dropped because the queue was full.")
    num_running: int = stat(
        GAUGE, "Requests running in the engine.", metric="num_requests_running")
    num_waiting: int = stat(
        GAUGE, "Requests waiting, preempted ones included.", metric="num_requests_waiting")
    kv_cache_usage: float = stat(
        GAUGE, "Fraction (0..1) of KV cache blocks held by requests.",
        metric="kv_cache_usage_perc", default=0.0)
    num_kv_blocks: int = stat(GAUGE, "KV cache blocks in the pool.")
    external_prefix_cache_queries: int = stat(
        COUNTER, "Prompt tokens of admitted requests looked up in the KV tier.")
    external_prefix_cache_hits: int = stat(
        COUNTER, "Prompt tokens loaded from the KV tier instead of computed.")
    kv_tier_errors: int = stat(
        COUNTER, "KV tier calls that failed or timed out (each treated as a miss).",
        kv_tier="num_errors")
    kv_tier_invalid_values: int = stat(
        COUNTER, "KV tier values refused by verification (each treated as a miss).",
        kv_tier="num_invalid_values")
    kv_tier_read_bytes: int = stat(
        COUNTER, "Bytes read from the KV tier.", kv_tier="num_bytes_read")
    kv_tier_written_bytes: int = stat(
        COUNTER, "Bytes written to the KV tier.", kv_tier="num_bytes_written")
    kv_tier_writes_dropped: int = stat(
        COUNTER, "Blocks not written to the KV tier: write queue full or write failed.",
        kv_tier="num_writes_dropped")
    kv_tier_loads: int = stat(COUNTER, "Loads from the KV tier.", kv_tier="num_loads")
    kv_tier_load_seconds: float = stat(
        COUNTER, "Seconds spent loading from the KV tier (divide by kv_tier_loads for "
        "the mean load latency).", kv_tier="load_seconds", default=0.0)
    # Not stats of their own: ``/metrics`` shows these as labelled series.
    #: The KV cache's configuration as (label, value) pairs, vLLM's ``cache_config_info``.
    cache_config_info: tuple[tuple[str, str], ...] = ()
    #: The eviction policy's candidate orders, if it chooses among several online (its
    #: free queue's ``candidate_standings()``).
    eviction_candidates: tuple[CandidateStanding, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0

    def add_kv_tier_stats(self, kv_tier_stats: Any) -> None:
        """Set the counters a :class:`~prefixcache.kv_tier.KVTierStats` (cumulative since
        the tier opened) holds."""
        for stat_field, spec in _STAT_FIELDS:
            if spec.kv_tier is not None:
                setattr(self, stat_field.name, getattr(kv_tier_stats, spec.kv_tier))

    def add_prefix_cache_stats(self, prefix_cache_stats: Any) -> None:
        """Add a :class:`~prefixcache.core.PrefixCacheStats` (counts since its last read)
        to the counters that accumulate it."""
        for stat_field, spec in _STAT_FIELDS:
            if spec.prefix_cache is not None:
                name = stat_field.name
                setattr(self, name,
                        getattr(self, name) + getattr(prefix_cache_stats, spec.prefix_cache))


def metric_fields(stats_cls: type = EngineStats) -> list[tuple[str, Stat]]:
    """``(field name, Stat with its metric name resolved)`` for every stat of
    ``stats_cls`` (a dataclass of :func:`stat` fields, :class:`EngineStats` unless
    another is named), in declaration order."""
    return [(stat_field.name, Stat(spec.kind, spec.metric or stat_field.name, spec.help,
                                   spec.prefix_cache, spec.kv_tier))
            for stat_field, spec in _stat_fields(stats_cls)]


def _stat_fields(stats_cls: type) -> list[tuple[Field, Stat]]:
    return [(f, f.metadata[STAT]) for f in fields(stats_cls) if STAT in f.metadata]


_STAT_FIELDS = _stat_fields(EngineStats)
