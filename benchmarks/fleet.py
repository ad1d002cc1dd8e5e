"""Replicas behind vllm-router, per policy, against one replica with the same total KV.
Prints JSON.

Workload (a generator, not a trace): ``--documents`` distinct documents of
``--document-words`` words each (about one token per word), then ``--questions`` follow-up
questions per document (the document followed by its own short question, about 10
tokens). All documents go out at once, then all follow-ups, shuffled, from
``--concurrency`` clients: the shape of many users asking about their own documents at the
same time. No follow-up is sent before its document has been answered (the result counts
them anyway: a follow-up that arrives while its document is still being computed cannot be
placed by any cache-aware router). Each request is a completion with ``max_tokens`` 1, so
its latency is its time to first token, i.e. its prefill.

Per setup (``kv_aware``, ``cache_aware``, ``round_robin`` with ``--replicas`` replicas via
``prefixcache fleet``'s own router command; ``kv_aware_session``: ``kv_aware`` with
``--kv-aware-session-affinity-ttl-secs`` and each document's requests sharing one
``x-session-id``; ``one_replica`` with ``--replicas`` times the KV blocks, no router): token
hit rate (cached prompt tokens / prompt tokens, over every request), the share of
follow-ups that hit their document (cached >= its full blocks but one), TTFT p50/p99 of
follow-ups, requests per second over the whole run, and each replica's share of prompt
tokens (and the largest share over the fair one). Then the tokenization endpoints' cost on
one replica: ``/v1/completions/render`` latency against a whole uncached request with the
same ``--render-tokens``-token text prompt (0 skips it).

With a shared KV tier (``round_robin_shared_tier``, ``kv_aware_shared_tier``): the same
replicas all on one throwaway local redis-server (``--kv-tier``, as ``prefixcache fleet
--kv-tier redis-local`` runs them), so a document computed on one replica is loaded, not
recomputed, by the others. The token hit rate counts tokens from either tier;
``tier_hit_rate`` the share of prompt tokens loaded from the shared tier (the replicas'
``external_prefix_cache_hits``). ``--setups`` picks which setups run (default: all).

The model is the default SmolLM2 (real prefill cost, so TTFT shows what the cache saves);
each replica runs ``--threads-per-replica`` torch threads. ``--tiny`` uses the tiny random
test model instead (built offline in a temp folder; prefill costs almost nothing there).
The clients set TCP_NODELAY, as vllm-router's do: without it a small POST waits ~40 ms
for a delayed ACK, which would swamp the render cost measured here.

Example (the figures in docs/benchmarks.md)::

    python benchmarks/fleet.py --documents 12 --document-words 1000 --questions 2 \
        --concurrency 6 --render-tokens 2000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from prefixcache.config import DEFAULT_MODEL_NAME  # noqa: E402
from prefixcache.entrypoints.fleet import (  # noqa: E402
    Part,
    ReplicaAddress,
    router_command,
    wait_until_healthy,
)
from prefixcache.kv_tier.local_redis import (  # noqa: E402
    INSTALL_HINT,
    RedisServer,
    find_redis_server,
)
from prefixcache.ports import free_loopback_port  # noqa: E402

BLOCK_SIZE = 16
SHARED_TIER = "_shared_tier"  # a setup name's suffix: its replicas share a KV tier
SESSION_SETUP = "kv_aware_session"  # kv_aware with session affinity, a session per document
SETUPS = ("one_replica", "kv_aware", SESSION_SETUP, "cache_aware", "round_robin",
          "round_robin" + SHARED_TIER, "kv_aware" + SHARED_TIER)
# What vllm-router's HTTP client does; see the module docstring.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def client(base_url: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=1800,
                        transport=httpx.HTTPTransport(socket_options=NODELAY))
WORDS = ("fox", "dog", "breeze", "leaves", "children", "prefix", "blocks", "tokens", "salts",
         "tenants", "requests", "value", "key", "world", "hello", "gentle", "quick", "lazy")


def documents(num: int, num_words: int, rng: random.Random) -> list[str]:
    return [f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."
            for i in range(num)]


def start_replicas(model: Path | None, model_name: str, num: int, num_blocks: int,
                   extra_args: tuple[str, ...] = ()) -> tuple[list, list]:
    parts, addresses = [], []
    for index in range(num):
        command = [sys.executable, "-m", "prefixcache", "serve",
                   *([str(model)] if model else []),
                   "--served-model-name", model_name, "--block-size", str(BLOCK_SIZE),
                   "--num-kv-blocks", str(num_blocks), "--host", "127.0.0.1", "--port", "0",
                   "--kv-events-endpoint", "tcp://127.0.0.1:*",
                   "--kv-events-replay-endpoint", "tcp://127.0.0.1:*", *extra_args]
        parts.append(Part.start(f"replica {index}", command))
    pattern = re.compile(r"at (http://\S+) .*KV events on (tcp://[^,]+), replay on "
                         r"(tcp://[^)]+)\)")
    for part in parts:
        deadline = time.monotonic() + 600
        while True:
            match = next((pattern.search(line) for line in part.lines
                          if pattern.search(line)), None)
            if match:
                addresses.append(ReplicaAddress(*match.groups()))
                break
            if time.monotonic() > deadline or not part.is_running:
                raise RuntimeError(f"{part.name} did not start:\n" + "".join(part.lines))
            time.sleep(0.1)
    return parts, addresses


def prompt_tokens(url: str) -> float:
    return engine_counter(url, "prompt_tokens")


def engine_counter(url: str, name: str) -> float:
    """The replica's counter ``prefixcache:<name>`` (0 when absent)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"prefixcache:{name}_total "):
            return float(line.split()[1])
    return 0.0


def run_workload(url: str, model_name: str, docs: list[str], questions: int,
                 concurrency: int, rng: random.Random, doc_tokens: list[int],
                 session_ids: bool = False) -> dict:
    """``session_ids``: each document's requests carry ``x-session-id: doc-<index>``."""
    answered_at: dict[int, float] = {}
    sent_early = 0

    def send(item: tuple[int, str, bool]) -> tuple[float, dict]:
        nonlocal sent_early
        doc, prompt, is_follow_up = item
        start = time.perf_counter()
        if is_follow_up and not start > answered_at.get(doc, float("inf")):
            sent_early += 1
        headers = {"x-session-id": f"doc-{doc}"} if session_ids else {}
        response = http.post("/v1/completions", headers=headers, json={
            "model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        response.raise_for_status()
        end = time.perf_counter()
        if not is_follow_up:
            answered_at[doc] = end
        return end - start, response.json()["usage"]

    follow_ups = [(d, f"{docs[d]} Question {q}: which {rng.choice(WORDS)} comes first?")
                  for d in range(len(docs)) for q in range(questions)]
    rng.shuffle(follow_ups)
    with client(url) as http, ThreadPoolExecutor(concurrency) as pool:
        began = time.perf_counter()
        first = list(pool.map(send, [(d, doc, False) for d, doc in enumerate(docs)]))
        second = list(pool.map(send, [(d, p, True) for d, p in follow_ups]))
        elapsed = time.perf_counter() - began
    usages = [u for _, u in first + second]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    total = sum(u["prompt_tokens"] for u in usages)
    landed = sum(u["prompt_tokens_details"]["cached_tokens"]
                 >= (doc_tokens[d] // BLOCK_SIZE - 1) * BLOCK_SIZE
                 for (d, _), (_, u) in zip(follow_ups, second, strict=True))
    ttfts = sorted(t for t, _ in second)
    return {"token_hit_rate": round(cached / total, 4),
            "follow_ups_on_their_document": round(landed / len(follow_ups), 4),
            "follow_ups_sent_before_their_document_was_answered": sent_early,
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "requests_per_s": round(len(usages) / elapsed, 2)}


def render_cost(url: str, model_name: str, num_tokens: int, repeats: int = 3) -> dict:
    """Median latency of ``/v1/completions/render`` and of the whole request (uncached:
    each repeat is a new text), for a text prompt of about ``num_tokens`` tokens."""
    rng = random.Random(1)
    renders, requests = [], []
    with client(url) as http:
        def timed(path: str, body: dict) -> float:
            start = time.perf_counter()
            http.post(path, json=body).raise_for_status()
            return time.perf_counter() - start

        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        num_prompt_tokens = http.post("/tokenize", json={"prompt": words}).json()["count"]
        for index in range(repeats):
            body = {"model": model_name, "prompt": f"{index} {words}", "max_tokens": 1}
            renders.append(timed("/v1/completions/render", body))
            requests.append(timed("/v1/completions", body))
    render_ms = 1000 * statistics.median(renders)
    request_ms = 1000 * statistics.median(requests)
    return {"prompt_tokens": num_prompt_tokens, "render_p50_ms": round(render_ms, 2),
            "request_p50_ms": round(request_ms, 2),
            "render_share_of_request": round(render_ms / request_ms, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--blocks-per-replica", type=int, default=512)
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--document-words", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--render-tokens", type=int, default=2000)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny random test model instead of SmolLM2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"comma-separated, from {', '.join(SETUPS)} (default: all)")
    args = parser.parse_args()
    selected = args.setups.split(",")
    if not set(selected) <= set(SETUPS):
        parser.error(f"--setups: unknown {sorted(set(selected) - set(SETUPS))}")
    redis_binary = find_redis_server()
    if redis_binary is None and any(name.endswith(SHARED_TIER) for name in selected):
        parser.error(f"the shared-tier setups need a redis-server: {INSTALL_HINT}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_replica)  # inherited by replicas

    results: dict = {"workload": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model, model_name = None, DEFAULT_MODEL_NAME
        if args.tiny:
            from tests.entrypoints.tiny_model import build_tiny_model

            model, model_name = build_tiny_model(Path(tmp) / "tiny"), "tiny"
        docs = documents(args.documents, args.document_words, random.Random(args.seed))
        setups = [("one_replica", 1, args.replicas * args.blocks_per_replica)]
        setups += [(name, args.replicas, args.blocks_per_replica)
                   for name in ("kv_aware", SESSION_SETUP, "cache_aware", "round_robin")]
        setups += [(name, args.replicas, args.blocks_per_replica)
                   for name in SETUPS if name.endswith(SHARED_TIER)]
        setups = [setup for setup in setups if setup[0] in selected]
        for name, num_replicas, num_blocks in setups:
            policy = name.removesuffix(SHARED_TIER).removesuffix("_session")
            router_args = (["--kv-aware-session-affinity-ttl-secs", "600"]
                           if name == SESSION_SETUP else [])
            tier = RedisServer(redis_binary, Path(tmp)) if name.endswith(SHARED_TIER) \
                else None
            try:
                parts, addresses = start_replicas(
                    model, model_name, num_replicas, num_blocks,
                    ("--kv-tier", tier.url) if tier is not None else ())
            except BaseException:
                if tier is not None:
                    tier.stop()
                raise
            router = None
            try:
                url = addresses[0].url
                with client(url) as http:
                    doc_tokens = [http.post("/tokenize", json={"prompt": d}).json()["count"]
                                  for d in docs]
                if name == "one_replica":
                    if args.render_tokens:
                        results["tokenization"] = render_cost(url, model_name,
                                                              args.render_tokens)
                else:
                    url = f"http://127.0.0.1:{free_loopback_port()}"
                    router = Part.start("router", router_command(
                        addresses, policy=policy, host="127.0.0.1",
                        port_number=int(url.rsplit(":", 1)[1]),
                        prometheus_port=free_loopback_port(),
                        block_size=BLOCK_SIZE, served_model_name=model_name,
                        extra_args=router_args))
                    if not wait_until_healthy(url, time.monotonic() + 120):
                        raise RuntimeError("the router never became healthy")
                result = run_workload(url, model_name, docs, args.questions,
                                      args.concurrency, random.Random(args.seed), doc_tokens,
                                      session_ids=bool(router_args))
                loads = [prompt_tokens(a.url) for a in addresses]
                shares = [load / sum(loads) for load in loads]
                result["prompt_token_share_per_replica"] = [round(s, 3) for s in shares]
                result["largest_share_over_fair"] = round(max(shares) * num_replicas, 3)
                if tier is not None:
                    result["tier_hit_rate"] = round(
                        sum(engine_counter(a.url, "external_prefix_cache_hits")
                            for a in addresses) / sum(loads), 4)
                    result["tier_errors"] = sum(engine_counter(a.url, "kv_tier_errors")
                                                for a in addresses)
                results[name] = result
                print(json.dumps({name: result}), file=sys.stderr, flush=True)
            finally:
                if router is not None:
                    router.stop(signal.SIGTERM)
                for part in parts:
                    part.stop()
                if tier is not None:
                    tier.stop()
        one = results.get("one_replica", {}).get("token_hit_rate")
        for name in ("kv_aware", SESSION_SETUP, *[n for n in SETUPS if n.endswith(SHARED_TIER)]):
            if one and name in results:
                results[f"{name}_hit_rate_vs_one_replica"] = round(
                    results[name]["token_hit_rate"] / one, 4)
        for name in ("kv_aware", SESSION_SETUP):
            if name in results and "round_robin" in results:
                results[f"round_robin_ttft_p50_over_{name}"] = round(
                    results["round_robin"]["ttft_p50_ms"] / results[name]["ttft_p50_ms"], 3)
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
