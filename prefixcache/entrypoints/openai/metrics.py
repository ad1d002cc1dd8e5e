"""``/metrics``: Prometheus text exposition of the engine and the server.

Names follow vLLM's, under a ``prefixcache:`` prefix, so dashboards written for vLLM need
only the prefix changed. Two sources:

- The engine's counters and gauges, declared once with their names, kinds and help in
  :class:`~prefixcache.engine.stats.EngineStats` and read at scrape time from AsyncLLM's
  snapshot (a custom collector: counters are the engine's own cumulative totals, so a
  scrape never disagrees with the engine). E.g. ``prefixcache:prefix_cache_hits_total``,
  ``prefixcache:num_requests_running``, ``prefixcache:kv_cache_usage_perc`` (a fraction,
  like vLLM's despite the name); and, from the same snapshot, labelled series:
  ``prefixcache:cache_config_info`` (vLLM's: the KV cache's settings as labels, among
  them ``block_size``, ``num_gpu_blocks`` and our ``eviction_policy``) and, under a
  policy that chooses its order online (``adaptive``),
  ``prefixcache:eviction_candidate_share{candidate}`` and
  ``prefixcache:eviction_candidate_followed{candidate}``.
- Per-request figures the server observes as requests finish, declared in
  :class:`ServerMetrics`: ``prefixcache:time_to_first_token_seconds`` and
  ``prefixcache:e2e_request_latency_seconds`` (histograms, arrival -> first token and ->
  finished) and ``prefixcache:request_success_total{finished_reason}``.

Other stats declared the same way (fields made with
:func:`~prefixcache.engine.stats.stat`) are added with :meth:`ServerMetrics.add_stats`,
labelled: the per-tenant admission figures
(:class:`~prefixcache.entrypoints.openai.admission.TenantStats`,
``prefixcache:tenant_num_requests{tenant}``, ...).

Each server has its own registry, so several servers in one process (tests) never share
or clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefixcache.engine.stats import COUNTER, EngineStats, metric_fields

PREFIX = "prefixcache:"

# Buckets spanning a cached decode step on a tiny model (~1 ms) to a cold long prompt on
# CPU (tens of seconds).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)

FINISH_REASONS = ("stop", "length", "abort", "error")


class _StatsCollector(Collector):
    """One metric per stat field of ``stats_cls`` (declared with
    :func:`~prefixcache.engine.stats.stat`), read at scrape time. Without ``label``,
    ``read`` returns one snapshot; with it, a map from the label's values to snapshots,
    one series each."""

    def __init__(self, stats_cls: type, read: Callable[[], Any],
                 label: str | None = None) -> None:
        self._read = read
        self._label = label
        self._metric_fields = metric_fields(stats_cls)

    def collect(self) -> Iterator[Any]:
        snapshot = self._read()
        if self._label is None:
            labels, label_values_to_snapshot = [], {(): snapshot}
        else:
            labels = [self._label]
            label_values_to_snapshot = {(value,): stats for value, stats in snapshot.items()}
        for name, spec in self._metric_fields:
            family_cls = CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily
            family = family_cls(PREFIX + spec.metric, spec.help, labels=labels)
            for label_values, stats in label_values_to_snapshot.items():
                family.add_metric(label_values, getattr(stats, name))
            yield family


class _EngineLabelledCollector(Collector):
    """The engine's figures that are labelled series rather than one stat each:
    ``cache_config_info`` (vLLM's: one series of value 1 whose labels are the KV cache's
    settings) and, when the eviction policy chooses among candidate orders online,
    ``eviction_candidate_share`` and ``eviction_candidate_followed`` per candidate."""

    def __init__(self, read_engine: Callable[[], EngineStats]) -> None:
        self._read_engine = read_engine

    def collect(self) -> Iterator[Any]:
        stats = self._read_engine()
        if stats.cache_config_info:
            names = [name for name, _ in stats.cache_config_info]
            info = GaugeMetricFamily(PREFIX + "cache_config_info",
                                     "Information of the KV cache's configuration.",
                                     labels=names)
            info.add_metric([value for _, value in stats.cache_config_info], 1)
            yield info
        if stats.eviction_candidates:
            share = GaugeMetricFamily(
                PREFIX + "eviction_candidate_share",
                "Each candidate order's share of what the eviction policy chooses by "
                "(adaptive: its shadow caches' recent hits).", labels=["candidate"])
            followed = GaugeMetricFamily(
                PREFIX + "eviction_candidate_followed",
                "1 for the candidate order the eviction policy follows now, else 0.",
                labels=["candidate"])
            for standing in stats.eviction_candidates:
                share.add_metric([standing.label], standing.share)
                followed.add_metric([standing.label], int(standing.followed))
            yield share
            yield followed


class ServerMetrics:
    """The server's registry. ``read_engine`` returns the engine's stats snapshot
    (``AsyncLLM.get_stats``)."""

    def __init__(self, read_engine: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(EngineStats, read_engine))
        self.registry.register(_EngineLabelledCollector(read_engine))
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

    def add_stats(self, stats_cls: type, read: Callable[[], Mapping[str, Any]],
                  label: str) -> None:
        """Expose the stat fields of ``stats_cls`` with one series per value of ``label``:
        ``read`` returns a map from the label's values to snapshots (a bounded set)."""
        self.registry.register(_StatsCollector(stats_cls, read, label))

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
