"""``/metrics``: Prometheus text exposition of the engine and the server.

Names follow vLLM's, under a ``prefixcache:`` prefix, so dashboards written for vLLM need
only the prefix changed. Engine figures are read at scrape time from AsyncLLM's stats
snapshot (a custom collector: counters are the engine's own cumulative totals, so a scrape
never disagrees with the engine); per-request latencies are histograms observed by the
server as requests finish.

==============================================  =========  ================================
metric                                          type       meaning
==============================================  =========  ================================
prefixcache:prefix_cache_queries_total          counter    prompt tokens looked up
prefixcache:prefix_cache_hits_total             counter    of those, served from the cache
prefixcache:prefix_cache_preempted_queries_total  counter  the same, for preempted requests
prefixcache:prefix_cache_preempted_hits_total   counter    readmitted (not in the above)
prefixcache:prompt_tokens_total                 counter    prompt tokens admitted
prefixcache:generation_tokens_total             counter    tokens generated
prefixcache:num_preemptions_total               counter    requests preempted
prefixcache:num_evictions_total                 counter    cached blocks evicted
prefixcache:engine_steps_total                  counter    engine steps (one batch each)
prefixcache:kv_events_published_total           counter    KV event batches sent
prefixcache:kv_events_dropped_total             counter    KV event batches dropped
prefixcache:request_success_total{finished_reason}  counter  engine requests finished
prefixcache:num_requests_running                gauge      requests running
prefixcache:num_requests_waiting                gauge      requests waiting (incl. preempted)
prefixcache:kv_cache_usage_perc                 gauge      fraction (0..1) of KV blocks in use
prefixcache:num_kv_blocks                       gauge      KV blocks in the pool
prefixcache:time_to_first_token_seconds         histogram  arrival -> first token
prefixcache:e2e_request_latency_seconds         histogram  arrival -> finished
==============================================  =========  ================================

``kv_cache_usage_perc`` is a fraction, like vLLM's despite the name. Each server has its own
registry, so several servers in one process (tests) never share or clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "prefixcache:"

# Buckets spanning a cached decode step on a tiny model (~1 ms) to a cold long prompt on
# CPU (tens of seconds).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)

FINISH_REASONS = ("stop", "length", "abort", "error")


class _EngineCollector(Collector):
    """Reads the engine's snapshot (and the event publisher's counters) at scrape time."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        values = self._read()
        for name, documentation in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
            ("prefix_cache_preempted_queries",
             "Tokens of readmitted preempted requests looked up in the prefix cache."),
            ("prefix_cache_preempted_hits",
             "Tokens of readmitted preempted requests served from the prefix cache."),
            ("prompt_tokens", "Prompt tokens of admitted requests."),
            ("generation_tokens", "Generated tokens."),
            ("num_preemptions", "Requests preempted (blocks freed, to be recomputed)."),
            ("num_evictions", "Cached blocks evicted to make room."),
            ("engine_steps", "Engine steps run; each step is one batch of requests."),
            ("kv_events_published", "KV event batches sent to subscribers."),
            ("kv_events_dropped", "KV event batches dropped because the queue was full."),
        ):
            yield CounterMetricFamily(PREFIX + name, documentation, value=values[name])
        for name, documentation in (
            ("num_requests_running", "Requests running in the engine."),
            ("num_requests_waiting", "Requests waiting, preempted ones included."),
            ("kv_cache_usage_perc", "Fraction (0..1) of KV cache blocks held by requests."),
            ("num_kv_blocks", "KV cache blocks in the pool."),
        ):
            yield GaugeMetricFamily(PREFIX + name, documentation, value=values[name])


class ServerMetrics:
    """The server's registry. ``read_engine`` returns the collector's dict (keys: the
    counter and gauge names of the module table, without prefix and suffix)."""

    def __init__(self, read_engine: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(read_engine))
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the request's last output.",
            buckets=E2E_BUCKETS_S, registry=self.registry)
        self.request_success = Counter(
            PREFIX + "request_success", "Engine requests finished, by finish reason.",
            labelnames=("finished_reason",), registry=self.registry)
        for reason in FINISH_REASONS:  # present from the start, so rates work at zero
            self.request_success.labels(finished_reason=reason)

    def observe_first_token(self, time_to_first_token_s: float) -> None:
        """Record the first token of one engine request, whether or not it finishes."""
        self.time_to_first_token.observe(time_to_first_token_s)

    def observe_finished(self, finish_reason: str | None, e2e_latency_s: float) -> None:
        """Record one finished engine request (one choice of an API request)."""
        reason = finish_reason if finish_reason in FINISH_REASONS else "error"
        self.request_success.labels(finished_reason=reason).inc()
        self.e2e_request_latency.observe(max(e2e_latency_s, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
