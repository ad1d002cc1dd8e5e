"""Replicas behind vllm-router, per policy, against one replica with the same total KV.
Prints JSON.

Workload (a generator, not a trace): ``--documents`` distinct documents of about
``--document-words`` words each, then ``--questions`` follow-up questions per document
(the document followed by its own short question). All documents go out at once, then all
follow-ups, shuffled, from ``--concurrency`` clients: the shape of many users asking
about their own documents at the same time. Each request is a completion with
``max_tokens`` 1, so its latency is its time to first token.

Per setup (``kv_aware``, ``cache_aware``, ``round_robin`` with ``--replicas`` replicas via
``prefixcache fleet``'s own router command; ``one_replica`` with ``--replicas`` times the KV
blocks, no router): token hit rate (cached prompt tokens / prompt tokens, over every
request), the share of follow-ups that hit their document (cached >= its full blocks but
one), TTFT p50/p99 of follow-ups, requests per second over the whole run, and each
replica's share of prompt tokens (and the largest share over the fair one). Then the
tokenization endpoints' cost: ``/v1/completions/render`` latency against a full request's
at the longest prompt the model takes (``--render-tokens``).

The default model is the tiny random test model (built offline in a temp folder): two
shared cores cannot run SmolLM2 replicas fast enough for many concurrent documents.

Example (the figures in docs/benchmarks.md)::

    python benchmarks/fleet.py --documents 24 --questions 3 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from prefixcache.entrypoints.fleet import (  # noqa: E402
    Part,
    ReplicaAddress,
    free_port,
    router_command,
    wait_until_healthy,
)

MODEL_NAME = "tiny"
BLOCK_SIZE = 16
WORDS = ("fox", "dog", "breeze", "leaves", "children", "prefix", "blocks", "tokens", "salts",
         "tenants", "requests", "value", "key", "world", "hello", "gentle", "quick", "lazy")


def documents(num: int, num_words: int, rng: random.Random) -> list[str]:
    return [f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."
            for i in range(num)]


def start_replicas(model_dir: Path, num: int, num_blocks: int) -> tuple[list, list]:
    import re

    parts, addresses = [], []
    for index in range(num):
        command = [sys.executable, "-m", "prefixcache", "serve", str(model_dir),
                   "--served-model-name", MODEL_NAME, "--block-size", str(BLOCK_SIZE),
                   "--num-kv-blocks", str(num_blocks), "--host", "127.0.0.1", "--port", "0",
                   "--kv-events-endpoint", "tcp://127.0.0.1:*",
                   "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
        parts.append(Part.start(f"replica {index}", command))
    pattern = re.compile(r"at (http://\S+) .*KV events on (tcp://[^,]+), replay on "
                         r"(tcp://[^)]+)\)")
    for part in parts:
        deadline = time.monotonic() + 300
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
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("prefixcache:prompt_tokens_total "):
            return float(line.split()[1])
    return 0.0


def run_workload(url: str, docs: list[str], questions: int, concurrency: int,
                 rng: random.Random, doc_tokens: list[int]) -> dict:
    def send(prompt: str) -> tuple[float, dict]:
        start = time.perf_counter()
        response = client.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        response.raise_for_status()
        return time.perf_counter() - start, response.json()["usage"]

    follow_ups = [(d, f"{docs[d]} Question {q}: which {rng.choice(WORDS)} comes first?")
                  for d in range(len(docs)) for q in range(questions)]
    rng.shuffle(follow_ups)
    with httpx.Client(base_url=url, timeout=600) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        began = time.perf_counter()
        first = list(pool.map(send, docs))
        second = list(pool.map(send, [p for _, p in follow_ups]))
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
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "requests_per_s": round(len(usages) / elapsed, 2)}


def render_cost(url: str, num_tokens: int, repeats: int = 10) -> dict:
    prompt = [10 + i % 300 for i in range(num_tokens)]  # ids the tiny vocabulary has
    with httpx.Client(base_url=url, timeout=600) as client:
        def timed(path: str, body: dict) -> float:
            start = time.perf_counter()
            client.post(path, json=body).raise_for_status()
            return time.perf_counter() - start
        renders, requests = [], []
        for index in range(repeats):
            unique = [prompt[0] + index + 1, *prompt[1:]]  # no prefix hit: a full prefill
            renders.append(timed("/v1/completions/render",
                                 {"model": MODEL_NAME, "prompt": unique, "max_tokens": 1}))
            requests.append(timed("/v1/completions",
                                  {"model": MODEL_NAME, "prompt": unique, "max_tokens": 1}))
    render_ms = 1000 * statistics.median(renders)
    request_ms = 1000 * statistics.median(requests)
    return {"prompt_tokens": num_tokens, "render_p50_ms": round(render_ms, 2),
            "request_p50_ms": round(request_ms, 2),
            "render_share_of_request": round(render_ms / request_ms, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--blocks-per-replica", type=int, default=256)
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--document-words", type=int, default=60)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--render-tokens", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    from tests.entrypoints.tiny_model import build_tiny_model

    results: dict = {"workload": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        docs = documents(args.documents, args.document_words, random.Random(args.seed))
        setups = [("one_replica", 1, args.replicas * args.blocks_per_replica)]
        setups += [(policy, args.replicas, args.blocks_per_replica)
                   for policy in ("kv_aware", "cache_aware", "round_robin")]
        for name, num_replicas, num_blocks in setups:
            parts, addresses = start_replicas(model_dir, num_replicas, num_blocks)
            router = None
            try:
                url = addresses[0].url
                doc_tokens = [httpx.post(f"{url}/tokenize", json={"prompt": d}).json()["count"]
                              for d in docs]
                if name != "one_replica":
                    url = f"http://127.0.0.1:{free_port()}"
                    router = Part.start("router", router_command(
                        addresses, policy=name, host="127.0.0.1",
                        port_number=int(url.rsplit(":", 1)[1]), prometheus_port=free_port(),
                        block_size=BLOCK_SIZE, served_model_name=MODEL_NAME))
                    if not wait_until_healthy(url, time.monotonic() + 120):
                        raise RuntimeError("the router never became healthy")
                result = run_workload(url, docs, args.questions, args.concurrency,
                                      random.Random(args.seed), doc_tokens)
                loads = [prompt_tokens(a.url) for a in addresses]
                shares = [load / sum(loads) for load in loads]
                result["prompt_token_share_per_replica"] = [round(s, 3) for s in shares]
                result["largest_share_over_fair"] = round(max(shares) * num_replicas, 3)
                if name == "kv_aware":
                    results["tokenization"] = render_cost(addresses[0].url, args.render_tokens)
                results[name] = result
            finally:
                if router is not None:
                    router.stop()
                for part in parts:
                    part.stop()
        one = results["one_replica"]["token_hit_rate"]
        results["kv_aware_hit_rate_vs_one_replica"] = round(
            results["kv_aware"]["token_hit_rate"] / one, 4) if one else None
        results["round_robin_ttft_p50_over_kv_aware"] = round(
            results["round_robin"]["ttft_p50_ms"] / results["kv_aware"]["ttft_p50_ms"], 3)
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
