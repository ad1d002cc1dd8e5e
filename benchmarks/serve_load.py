"""Load on the OpenAI-compatible server over loopback: TTFT and throughput, with and
without a shared prompt prefix, in one run. Prints JSON.

Starts ``prefixcache serve`` itself (``--port 0``, loopback only) unless ``--url`` points at a
running server, then runs two workloads of identical shape and size:

* ``shared_prefix``: every prompt is the same ``--prefix-tokens`` tokens plus its own
  ``--suffix-tokens`` (a system prompt or document shared by all requests);
* ``unique``: every prompt is entirely its own, same length.

Prompts are token-id lists (exact lengths, no client tokenizer). Each workload starts from
an empty prefix cache (``POST /reset_prefix_cache``) and one warm-up request: the shared
prefix for ``shared_prefix`` (the steady state of a deployment whose system prompt is
cached), an unrelated prompt of the same length for ``unique``. Then ``--num-requests``
streamed completions go out from ``--concurrency`` clients; ``ignore_eos`` fixes every
output at ``--max-tokens`` tokens.

Per workload: TTFT (send -> first streamed token) and end-to-end latency percentiles,
per-request decode rate (tokens/s after the first token) percentiles, aggregate output
throughput, and the cached tokens the server reported. The client shares the CPU with the
server, so it is kept lean: httpx and hand-parsed server-sent events.

With ``--hostile`` it measures instead what a tenant-mode server gives a well-behaved tenant
under hostile load (``hostile_load.py``): that tenant's latency alone, then beside a
flooding tenant, invalid requests and vanishing streams from ``--concurrency`` clients in
all; then while a ``--huge-prompt-mb`` prompt is sent (refused before tokenizing) and while
a prompt just under ``--max-prompt-bytes`` is tokenized on the worker pool.

Example (the figures in docs/benchmarks.md)::

    python benchmarks/serve_load.py --num-requests 48 --concurrency 16 \\
        --prefix-tokens 512 --suffix-tokens 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from hostile_load import key_file_text, run_mixed_load, well_behaved, well_behaved_alone

READY_PATTERN = re.compile(r"ready: serving \S+ at (http://127\.0\.0\.1:\d+)")
REPO_ROOT = Path(__file__).resolve().parents[1]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(fraction: float) -> float:
        # Nearest-rank percentile: a value that was actually observed.
        index = min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))
        return round(ordered[index], 4)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99),
            "mean": round(statistics.fmean(ordered), 4)}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "prefixcache", "serve", *([args.model] if args.model else []),
               "--host", "127.0.0.1", "--port", "0", "--served-model-name", "bench",
               "--max-num-seqs", str(max(args.concurrency, 1)), *args.server_arg]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    found: dict[str, str] = {}
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:  # keeps draining stderr so the server never blocks on it
        for line in process.stderr:
            log.append(line)
            match = READY_PATTERN.search(line)
            if match and not ready.is_set():
                found["url"] = match.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(args.startup_timeout) or "url" not in found:
        process.kill()
        raise SystemExit("server did not become ready:\n" + "".join(log))
    return process, found["url"]


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int],
                      max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first_token_at = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and first_token_at is None and chunk["choices"][0]["text"]:
                first_token_at = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    if first_token_at is None:  # every token decoded to nothing visible
        first_token_at = end
    num_tokens = usage["completion_tokens"]
    decode_s = end - first_token_at
    return {"ttft_s": first_token_at - start, "e2e_s": end - start, "tokens": num_tokens,
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "decode_tokens_per_s": (num_tokens - 1) / decode_s if decode_s > 0 else None}


async def run_workload(url: str, model: str, prompts: list[list[int]], warmup: list[int],
                       args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        reset = await client.post("/reset_prefix_cache", params={"wait": "true"})
        assert reset.json() == {"success": True}, reset.text
        await one_request(client, model, warmup, 1)
        pending = list(enumerate(prompts))
        results: list[dict] = []
        errors: list[str] = []

        async def worker() -> None:
            while pending:
                _, prompt = pending.pop(0)
                try:
                    results.append(await one_request(client, model, prompt, args.max_tokens))
                except Exception as exc:  # noqa: BLE001 - reported in the JSON
                    errors.append(f"{type(exc).__name__}: {exc}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall_s = time.perf_counter() - start
    num_tokens = sum(r["tokens"] for r in results)
    return {
        "num_requests": len(prompts), "num_errors": len(errors), "errors": errors[:5],
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(num_tokens / wall_s, 2),
        "requests_per_s": round(len(results) / wall_s, 3),
        "prompt_tokens_per_request": len(prompts[0]),
        "cached_tokens_per_request_mean": round(
            statistics.fmean(r["cached_tokens"] for r in results), 1) if results else 0,
        "ttft_s": percentiles([r["ttft_s"] for r in results]),
        "e2e_s": percentiles([r["e2e_s"] for r in results]),
        "decode_tokens_per_s_per_request": percentiles(
            [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]),
    }


def make_prompts(args: argparse.Namespace) -> dict[str, tuple[list[list[int]], list[int]]]:
    rng = random.Random(args.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(count)]

    length = args.prefix_tokens + args.suffix_tokens
    shared = tokens(args.prefix_tokens)
    return {
        "shared_prefix": ([shared + tokens(args.suffix_tokens)
                           for _ in range(args.num_requests)], shared + tokens(1)),
        "unique": ([tokens(length) for _ in range(args.num_requests)], tokens(length)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model for the server (default: SmolLM2)")
    parser.add_argument("--url", default=None,
                        help="use this running server (http://127.0.0.1:PORT) instead")
    parser.add_argument("--served-model-name", default=None,
                        help="model name to request (default: 'bench', or the first "
                             "model of --url's /v1/models)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-token-id", type=int, default=100)
    parser.add_argument("--max-token-id", type=int, default=10_000,
                        help="prompt token ids are drawn below this (keep under the vocab)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--hostile", action="store_true",
                        help="measure a well-behaved tenant under hostile load instead")
    parser.add_argument("--hostile-seconds", type=float, default=30,
                        help="--hostile: how long the mixed load runs")
    parser.add_argument("--huge-prompt-mb", type=float, default=15,
                        help="--hostile: size of the prompt that must not delay others")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra flag for 'prefixcache serve' (repeatable), "
                             "e.g. --server-arg=--block-size=16")
    args = parser.parse_args(argv)

    if args.hostile:
        return run_hostile(args)
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args)
    try:
        model = args.served_model_name
        if model is None:
            model = "bench" if process is not None else httpx.get(
                url + "/v1/models", timeout=30).json()["data"][0]["id"]
        report: dict = {
            "config": {k: getattr(args, k) for k in (
                "model", "num_requests", "concurrency", "prefix_tokens", "suffix_tokens",
                "max_tokens", "seed", "server_arg")},
            "cpu_count": os.cpu_count(),
        }
        for name, (prompts, warmup) in make_prompts(args).items():
            try:
                report[name] = asyncio.run(run_workload(url, model, prompts, warmup, args))
            except RuntimeError as exc:  # the warm-up request failed: nothing to measure
                raise SystemExit(f"serve_load: {name} warm-up failed: {exc}") from None
        shared, unique = report["shared_prefix"], report["unique"]
        report["shared_vs_unique"] = {
            "ttft_p50_speedup": ratio(unique["ttft_s"].get("p50"), shared["ttft_s"].get("p50")),
            "ttft_p90_speedup": ratio(unique["ttft_s"].get("p90"), shared["ttft_s"].get("p90")),
            "throughput_ratio": ratio(shared["output_tokens_per_s"],
                                      unique["output_tokens_per_s"]),
        }
        print(json.dumps(report, indent=2))
    finally:
        if process is not None:
            stop_server(process)
    # Failed requests are in the JSON; the exit status says whether to trust the ratios.
    return 1 if shared["num_errors"] or unique["num_errors"] else 0


def run_hostile(args: argparse.Namespace) -> int:
    """The ``--hostile`` measurement (see the module docstring); prints its JSON."""
    import tempfile

    max_prompt_bytes = 1024 * 1024
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys"
        keys.write_text(key_file_text())
        huge_bytes = int(args.huge_prompt_mb * 1024 * 1024)
        args.server_arg += ["--api-key-file", str(keys), "--max-prompt-bytes",
                            str(max_prompt_bytes), "--max-requests-per-tenant",
                            str(max(args.concurrency // 4, 1)),
                            "--max-request-body-bytes", str(huge_bytes + 1024 * 1024)]
        process, url = start_server(args)
        try:
            report = asyncio.run(_hostile_phases(url, args, max_prompt_bytes, huge_bytes))
        finally:
            stop_server(process)
    report["config"] = {k: getattr(args, k) for k in (
        "model", "concurrency", "hostile_seconds", "huge_prompt_mb", "server_arg")}
    report["cpu_count"] = os.cpu_count()
    print(json.dumps(report, indent=2))
    return 1 if report["mixed_load"]["server_errors"] else 0


async def _hostile_phases(url: str, args: argparse.Namespace, max_prompt_bytes: int,
                          huge_bytes: int) -> dict:
    model = "bench"
    num_good = max(args.concurrency // 4, 1)
    alone = await well_behaved_alone(url, model, 8, num_good)
    mixed = await run_mixed_load(url, model, args.hostile_seconds, args.concurrency,
                                 max_prompt_bytes)
    huge = await _beside_one_prompt(url, model, "word " * (huge_bytes // 5), num_good)
    near_limit = await _beside_one_prompt(url, model, "word " * (max_prompt_bytes // 5 - 1),
                                          num_good)

    def latencies(report: object) -> dict:
        return percentiles(report.well_behaved_latencies_s)

    reference = latencies(alone)
    return {
        "well_behaved_alone_s": reference,
        "mixed_load": {
            "well_behaved_s": latencies(mixed),
            "p99_vs_alone": ratio(latencies(mixed).get("p99"), reference.get("p99")),
            "well_behaved_failures": len(mixed.well_behaved_failures),
            "server_errors": mixed.server_errors,
            "status_counts": dict(sorted(mixed.status_counts.items())),
        },
        f"beside_{args.huge_prompt_mb:g}MB_prompt": huge,
        "beside_prompt_at_limit": near_limit,
    }


async def _beside_one_prompt(url: str, model: str, prompt: str, num_good: int) -> dict:
    """The well-behaved tenant's latencies while one client sends ``prompt``."""
    from hostile_load import KEYS, LoadReport

    report = LoadReport()
    health_latencies_s: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def probe_health(until: asyncio.Future) -> None:
            # The event loop's responsiveness: /health does no work of its own.
            while not until.done():
                sent = time.monotonic()
                await client.get("/health")
                health_latencies_s.append(time.monotonic() - sent)
                await asyncio.sleep(0.05)

        idle = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(2.0, idle.set_result, None)
        await probe_health(idle)
        idle_health = percentiles(health_latencies_s)
        health_latencies_s.clear()
        start = time.monotonic()
        big = asyncio.ensure_future(client.post(
            "/v1/completions", headers={"Authorization": f"Bearer {KEYS['carol']}"},
            json={"model": model, "prompt": prompt, "max_tokens": 1}))
        prober = asyncio.ensure_future(probe_health(big))
        while not big.done():
            await asyncio.gather(*(well_behaved(client, model, float("inf"), report, i,
                                                max_requests=1) for i in range(num_good)))
        response = await big
        await prober
    return {"prompt_bytes": len(prompt), "status": response.status_code,
            "answered_after_s": round(time.monotonic() - start, 3),
            "health_idle_s": idle_health,
            "health_meanwhile_s": {**percentiles(health_latencies_s),
                                   "max": round(max(health_latencies_s, default=0), 4)},
            "well_behaved_s": percentiles(report.well_behaved_latencies_s),
            "well_behaved_failures": len(report.well_behaved_failures)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` to 2 places; None when a workload had no results."""
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 2)


if __name__ == "__main__":
    sys.exit(main())
