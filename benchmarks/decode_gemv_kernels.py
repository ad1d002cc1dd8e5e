"""Decode speed with and without the C++ quantized matmul kernels, same run.

One stream of the default model (SmolLM2-135M Q4_1, int4 decode) decodes ``--tokens``
tokens after a 16-token prompt, greedy, EOS ignored, ``--runs`` times per engine; each
engine is a fresh process, with the kernels (`prefixcache.kernels.quantized_gemv`) or
without them (``PREFIXCACHE_QUANTIZED_GEMV=0``: PyTorch's weight-only kernels), the two
alternated ``--repeats`` times so that drift in machine load hits both. Prints JSON: per
variant the best and median milliseconds per decoded token (wall) and the best process
CPU milliseconds per token (steadier than wall time on a shared machine at one thread),
and the ratio kernels / PyTorch of the best wall times.

    python benchmarks/decode_gemv_kernels.py [--threads 2] [--optimization-level 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from prefixcache.config import OPTIMIZATION_LEVELS
from prefixcache.kernels.quantized_gemv import DISABLE_ENV

PROMPT_TOKENS = 16
FIRST_ORDINARY_TOKEN = 20  # SmolLM2's special tokens are below this


def run_worker(args) -> dict:
    """Per-token wall and CPU milliseconds of every run, in this process."""
    import torch

    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_options(None, dtype="bfloat16", quantization="auto",
                                    optimization_level=args.optimization_level)
    rng = random.Random(14)
    prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, engine.vocab_size)
              for _ in range(PROMPT_TOKENS)]
    counter = iter(range(10**6))

    def decode(num_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True)
        engine.add_request(str(next(counter)), prompt, params)
        engine.step()  # the prefill, which samples the first token
        wall, cpu = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
        return ((time.perf_counter() - wall) / num_tokens * 1e3,
                (time.process_time() - cpu) / num_tokens * 1e3)

    decode(4)  # warm-up
    runs = [decode(args.tokens) for _ in range(args.runs)]
    return {"wall_ms": [wall for wall, _ in runs], "cpu_ms": [cpu for _, cpu in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimization-level", type=int, default=1,
                        choices=OPTIMIZATION_LEVELS)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--runs", type=int, default=10, help="runs per engine process")
    parser.add_argument("--repeats", type=int, default=2, help="engine processes per variant")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    variants = {"kernels": "1", "pytorch": "0"}
    times = {name: {"wall_ms": [], "cpu_ms": []} for name in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            command = [sys.executable, __file__, "--worker", "--threads", str(args.threads),
                       "--optimization-level", str(args.optimization_level),
                       "--tokens", str(args.tokens), "--runs", str(args.runs)]
            result = subprocess.run(command, capture_output=True, text=True, check=False,
                                    env={**os.environ, DISABLE_ENV: variants[name]})
            if result.returncode != 0:
                raise SystemExit(f"{name} worker failed:\n{result.stderr[-3000:]}")
            for key, values in json.loads(result.stdout.strip().splitlines()[-1]).items():
                times[name][key].extend(values)
    summary = {
        name: {"best_ms_per_token": round(min(t["wall_ms"]), 2),
               "median_ms_per_token": round(statistics.median(t["wall_ms"]), 2),
               "best_cpu_ms_per_token": round(min(t["cpu_ms"]), 2)}
        for name, t in times.items()
    }
    print(json.dumps({
        "benchmark": "decode_gemv_kernels", "prompt_tokens": PROMPT_TOKENS,
        "threads": args.threads, "optimization_level": args.optimization_level,
        "tokens_per_run": args.tokens, "runs": args.runs, "repeats": args.repeats,
        **summary,
        "ratio_best_kernels_to_pytorch": round(summary["kernels"]["best_ms_per_token"]
                                               / summary["pytorch"]["best_ms_per_token"], 3),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()[0],
    }, indent=2))


if __name__ == "__main__":
    main()
