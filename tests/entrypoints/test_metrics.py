"""``/metrics`` exposes every EngineStats field under its declared name, kind and help."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from prefixcache.core.eviction.base import CandidateStanding
from prefixcache.engine.stats import EngineStats, metric_fields
from prefixcache.entrypoints.openai.metrics import ServerMetrics

# The names dashboards use: a rename is a breaking change, so they are pinned here.
ENGINE_METRICS = {
    "prefixcache:prefix_cache_queries": "counter",
    "prefixcache:prefix_cache_hits": "counter",
    "prefixcache:prefix_cache_preempted_queries": "counter",
    "prefixcache:prefix_cache_preempted_hits": "counter",
    "prefixcache:prompt_tokens": "counter",
    "prefixcache:generation_tokens": "counter",
    "prefixcache:num_preemptions": "counter",
    "prefixcache:num_evictions": "counter",
    "prefixcache:eviction_policy_switches": "counter",
    "prefixcache:engine_steps": "counter",
    "prefixcache:kv_events_published": "counter",
    "prefixcache:kv_events_dropped": "counter",
    "prefixcache:num_requests_running": "gauge",
    "prefixcache:num_requests_waiting": "gauge",
    "prefixcache:kv_cache_usage_perc": "gauge",
    "prefixcache:num_kv_blocks": "gauge",
    "prefixcache:external_prefix_cache_queries": "counter",
    "prefixcache:external_prefix_cache_hits": "counter",
    "prefixcache:kv_tier_errors": "counter",
    "prefixcache:kv_tier_invalid_values": "counter",
    "prefixcache:kv_tier_read_bytes": "counter",
    "prefixcache:kv_tier_written_bytes": "counter",
    "prefixcache:kv_tier_writes_dropped": "counter",
    "prefixcache:kv_tier_loads": "counter",
    "prefixcache:kv_tier_load_seconds": "counter",
}
SERVER_METRICS = {
    "prefixcache:time_to_first_token_seconds": "histogram",
    "prefixcache:e2e_request_latency_seconds": "histogram",
    "prefixcache:request_success": "counter",
}


def scrape(stats: EngineStats) -> dict[str, object]:
    text = ServerMetrics(lambda: stats).render().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_stat_is_exposed_under_its_declared_name_kind_and_help():
    # Distinct values, so a stat read from the wrong field shows.
    stats = EngineStats(**{name: index + 1
                           for index, (name, _) in enumerate(metric_fields())})
    families = scrape(stats)
    # (prometheus_client adds a *_created gauge beside each histogram and labelled counter.)
    assert {name: family.type for name, family in families.items()
            if not name.endswith("_created")} == {**ENGINE_METRICS, **SERVER_METRICS}
    for field_name, spec in metric_fields():
        family = families[f"prefixcache:{spec.metric}"]
        assert family.documentation == spec.help and spec.help.endswith(".")
        (sample,) = [s for s in family.samples if not s.name.endswith("_created")]
        assert sample.value == getattr(stats, field_name), field_name


def test_the_cache_configuration_is_one_info_series_labelled_with_its_settings():
    settings = (("block_size", "16"), ("num_gpu_blocks", "4096"),
                ("enable_prefix_caching", "True"), ("prefix_caching_hash_algo", "sha256"),
                ("eviction_policy", "adaptive"))
    family = scrape(EngineStats(cache_config_info=settings))["prefixcache:cache_config_info"]
    assert family.type == "gauge"
    (sample,) = family.samples
    assert sample.labels == dict(settings) and sample.value == 1
    assert "prefixcache:cache_config_info" not in scrape(EngineStats())


def test_eviction_candidates_are_one_series_each_with_their_share_and_the_one_followed():
    candidates = (CandidateStanding("0% protected", 0.25, False),
                  CandidateStanding("50% protected", 0.75, True))
    families = scrape(EngineStats(eviction_candidates=candidates))
    share = families["prefixcache:eviction_candidate_share"]
    followed = families["prefixcache:eviction_candidate_followed"]
    assert share.type == followed.type == "gauge"
    assert {s.labels["candidate"]: s.value for s in share.samples} == {
        "0% protected": 0.25, "50% protected": 0.75}
    assert {s.labels["candidate"]: s.value for s in followed.samples} == {
        "0% protected": 0, "50% protected": 1}
    # A policy that follows one order has none of these series.
    assert not {"prefixcache:eviction_candidate_share",
                "prefixcache:eviction_candidate_followed"} & set(scrape(EngineStats()))


def test_the_engine_stats_keep_vllms_metric_names_where_the_field_names_differ():
    metric_of = {name: spec.metric for name, spec in metric_fields()}
    assert metric_of["num_running"] == "num_requests_running"
    assert metric_of["num_waiting"] == "num_requests_waiting"
    assert metric_of["kv_cache_usage"] == "kv_cache_usage_perc"
    assert metric_of["num_steps"] == "engine_steps"


def test_prefix_cache_counts_accumulate_into_the_declared_counters():
    from prefixcache.core import PrefixCacheStats

    stats = EngineStats(prefix_cache_hits=10)
    stats.add_prefix_cache_stats(PrefixCacheStats(requests=2, queries=40, hits=8,
                                                  preempted_requests=1, preempted_queries=5,
                                                  preempted_hits=4))
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits,
            stats.prefix_cache_preempted_queries, stats.prefix_cache_preempted_hits) == \
        (40, 18, 5, 4)
    assert stats.prefix_cache_hit_rate == 18 / 40
