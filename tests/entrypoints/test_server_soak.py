"""A bounded soak on loopback: 64 clients for ``SOAK_S`` seconds mixing well-behaved
streamed and plain requests, invalid ones, vanishing streams and one tenant flooding
(``benchmarks/hostile_load.py``). It stops by itself; latencies are measured by
``benchmarks/serve_load.py --hostile``, never asserted here."""

from __future__ import annotations

import asyncio

import httpx

from benchmarks.hostile_load import KEYS, key_file_text, run_mixed_load
from tests.entrypoints.conftest import (
    MODEL_NAME,
    SERVER_ARGS,
    ServerProcess,
    assert_clean_exit,
    wait_for_idle,
)

SOAK_S = 20
NUM_CLIENTS = 64
MAX_PROMPT_BYTES = 16 * 1024


def test_soak_with_a_flooding_tenant(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(key_file_text())
    process = ServerProcess(tiny_model_dir, *SERVER_ARGS, "--api-key-file", str(keys),
                            "--max-requests-per-tenant", str(NUM_CLIENTS // 4),
                            "--max-prompt-bytes", str(MAX_PROMPT_BYTES),
                            "--request-body-timeout", "5", "--log-level", "debug")
    try:
        report = asyncio.run(run_mixed_load(process.url, MODEL_NAME, SOAK_S, NUM_CLIENTS,
                                            MAX_PROMPT_BYTES))
        with httpx.Client(base_url=process.url, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['alice']}"}) as client:
            assert client.get("/health").status_code == 200
            values = wait_for_idle(client)
            assert client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                        "max_tokens": 2}).status_code == 200
    finally:
        assert_clean_exit(process)
    assert values["prefixcache:kv_cache_usage_perc"] == 0
    assert report.server_errors == []
    assert report.well_behaved_failures == [], "".join(
        line for line in process.log if "prefixcache" in line and "DEBUG asyncio" not in line)
    # The well-behaved tenant sends as many at once as its limit allows.
    assert len(report.well_behaved_latencies_s) >= NUM_CLIENTS // 4
    counts = report.status_counts
    assert counts["bob:429"] > 0 and counts["bob:200"] > 0  # the flood met its limit
    # carol's vanishing streams count against her limit too, so on a slow machine her
    # invalid requests may meet it first: 429 is then the right answer, a 5xx never is.
    assert {status for who, status in (key.split(":") for key in counts)
            if who == "carol-invalid"} <= {"400", "401", "404", "429"}
